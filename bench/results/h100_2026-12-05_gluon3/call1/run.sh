#!/usr/bin/env bash
# Session 26 call A: Gluon PAIRS 2 / single-buffer staging vs direct vs Pallas (harness, b8_32k); HACK-4 at P 64 / 128 vs bf16;
# the 4-bit P 128 gpu test; Gluon harness at b1_128k, b1_32k.
set -u
O=/tmp/s2; mkdir -p $O
export PYTHONPATH=. PYTHONUNBUFFERED=1
pk() { tar czf $OUT/s2.tgz -C /tmp s2; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > $O/env.txt 2>&1
python -c "import jax, triton; print(jax.__version__, triton.__version__)" >> $O/env.txt 2>&1
git log -1 --format=%H >> $O/env.txt 2>&1; git status --short >> $O/env.txt 2>&1
timeout 150 python bench/gluon_harness.py harn_tmp/glh $O/gl.jsonl --shapes b8_32k \
  --variants s16=16:0:2 p12r168=12:168:2:2 p11r184=11:184:2:2 p16=16:0:2:2 s16s=16:0:21 s16t=16:0:25 \
  > $O/gl_b8.log 2>&1; pk
timeout 150 python bench/bench_decode_attention.py --out $O/dec4 --impls hack4 hack4p128 bf16 --hack-dots folded_f16 \
  --shapes llama3.1-8b:8:32768 llama3.1-8b:1:131072 llama3.1-8b:8:131072 --reps 3 --no-plot > $O/dec4.log 2>&1; pk
(XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 70 python -m pytest -q -m gpu -p no:cacheprovider tests/test_bits.py \
  -k "within_2x_naive" > $O/tests_bits.log 2>&1; echo "rc $?" >> $O/tests_bits.log); pk
timeout 100 python bench/gluon_harness.py harn_tmp/glh $O/gl.jsonl --shapes b1_128k b1_32k \
  --variants s128=128:0:2 p64r168=64:168:2:2 p128r168=128:168:2:2 s128s=128:0:21 > $O/gl_b1.log 2>&1; pk
