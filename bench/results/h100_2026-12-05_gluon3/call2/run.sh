#!/usr/bin/env bash
# Session 26 call B: the Gluon kernel with the sinks / open region in the kernel and impl="gluon": its gpu tests, the
# decode matrix through JAX (hack Pallas, gluon, gluon with the jnp open region, bf16; one process), harness variants.
set -u
O=/tmp/s3; mkdir -p $O
export PYTHONPATH=. PYTHONUNBUFFERED=1
pk() { tar czf $OUT/s3.tgz -C /tmp s3; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > $O/env.txt 2>&1
python -c "import jax, triton; print(jax.__version__, triton.__version__)" >> $O/env.txt 2>&1
(XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/test_gluon_decode.py \
  > $O/tests_gluon.log 2>&1; echo "rc $?" >> $O/tests_gluon.log); pk
timeout 230 python bench/bench_decode_attention.py --out $O/dec --impls hack gluon gluonjnp bf16 --hack-dots folded_f16 \
  --heads llama3.1-8b --batches 8 1 --kv-lens 32768 131072 1024 --reps 3 --no-plot > $O/dec.log 2>&1; pk
timeout 100 python bench/gluon_harness.py harn_tmp/glh $O/gl.jsonl --shapes b8_32k \
  --variants s16s=16:0:21 s16s0=16:0:21:1:0 s12s=12:0:21 s20s=20:0:21 s24s=24:0:21 s16c=16:0:16 s16s232=16:232:21 \
  > $O/gl_b8.log 2>&1; pk
timeout 70 python bench/gluon_harness.py harn_tmp/glh $O/gl.jsonl --shapes b1_128k b1_32k \
  --variants s128s=128:0:21 s96s=96:0:21 s64s=64:0:21 s128c=128:0:16 > $O/gl_b1.log 2>&1; pk
