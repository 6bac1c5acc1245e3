#!/usr/bin/env bash
# Session 27 call 1 (session 26's prepared next.sh + Gluon partial rows of q_per_kv_pad query heads, not 8, and ncu
# per-kernel durations of one call at 1 x 32K). From the repository root with harn_tmp/glh carried.
set -u
O=/tmp/c1; mkdir -p $O
export PYTHONPATH=. PYTHONUNBUFFERED=1
pk() { tar czf $OUT/c1.tgz -C /tmp c1; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > $O/env.txt 2>&1
python -c "import jax, triton; print(jax.__version__, triton.__version__)" >> $O/env.txt 2>&1
(XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/test_gluon_decode.py \
  tests/test_triton_decode.py -k "gluon or dispatch" > $O/tests.log 2>&1; echo "rc $?" >> $O/tests.log); pk
timeout 230 python bench/bench_decode_attention.py --out $O/dec --impls hack gluon hack4 bf16 --hack-dots folded_f16 \
  --shapes llama3.1-8b:8:32768 llama3.1-8b:8:131072 llama3.1-8b:1:32768 llama3.1-8b:1:131072 llama3.1-8b:8:1024 \
  --reps 3 --no-plot > $O/dec.log 2>&1; pk
for impl in gluon hack; do
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 60 ncu --clock-control none --metrics gpu__time_duration.sum --csv \
    --launch-count 3000 python harn_tmp/ncu_call.py $impl 1 32768 > $O/ncu_${impl}_b1_32k.csv 2> $O/ncu_${impl}.err
  echo "ncu $impl exit $?" >> $O/ncu_${impl}.err; pk
done
timeout 70 python bench/gluon_harness.py harn_tmp/glh $O/gl.jsonl --shapes b8_32k b1_128k b1_32k \
  --variants s16=16:0:21 s128=128:0:21 s43=43:0:21 > $O/gl.log 2>&1; pk
