#!/usr/bin/env bash
# Session 26 call C: impl="gluon" with the sinks / open region before the last program's sealed groups (DENSE 2): gpu tests,
# the decode matrix through JAX (hack Pallas, gluon, gluon with the jnp open region, bf16; one process), harness DENSE 0/1/2.
set -u
O=/tmp/s4; mkdir -p $O
export PYTHONPATH=. PYTHONUNBUFFERED=1
pk() { tar czf $OUT/s4.tgz -C /tmp s4; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > $O/env.txt 2>&1
python -c "import jax, triton; print(jax.__version__, triton.__version__)" >> $O/env.txt 2>&1
(XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 120 python -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/test_gluon_decode.py \
  > $O/tests_gluon.log 2>&1; echo "rc $?" >> $O/tests_gluon.log); pk
timeout 210 python bench/bench_decode_attention.py --out $O/dec --impls hack gluon gluonjnp bf16 --hack-dots folded_f16 \
  --heads llama3.1-8b --batches 8 1 --kv-lens 32768 131072 1024 --reps 3 --no-plot > $O/dec.log 2>&1; pk
timeout 60 python bench/gluon_harness.py harn_tmp/glh $O/gl.jsonl --shapes b8_32k \
  --variants s16s2=16:0:21:1:2 s16s1=16:0:21:1:1 s16s0=16:0:21:1:0 > $O/gl_b8.log 2>&1; pk
timeout 50 python bench/gluon_harness.py harn_tmp/glh $O/gl.jsonl --shapes b1_128k b1_32k \
  --variants s128s2=128:0:21:1:2 s128s0=128:0:21:1:0 > $O/gl_b1.log 2>&1; pk
