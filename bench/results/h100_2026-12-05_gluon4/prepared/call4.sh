#!/usr/bin/env bash
# Session 27 call 4: the Gluon kernel with the sinks / open region in a program of their own (DENSE 3) and partial
# rows of q_per_kv_pad query heads: gpu tests; issue 16's matrix hack / gluon / bf16 in one process; ncu per-kernel
# durations of one gluon call at 1 x 32768 (ncu segfaulted there in call 3) and 8 x 1024.
set -u
O=/tmp/c4; mkdir -p $O
export PYTHONPATH=. PYTHONUNBUFFERED=1
pk() { tar czf $OUT/c4.tgz -C /tmp c4; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > $O/wheels.log 2>&1
export PYTHONPATH="/tmp/site:$PYTHONPATH"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > $O/env.txt 2>&1
(XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 120 python -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/test_gluon_decode.py \
  tests/test_triton_decode.py -k "gluon or dispatch" > $O/tests.log 2>&1; echo "rc $?" >> $O/tests.log); pk
timeout 230 python bench/bench_decode_attention.py --out $O/dec --impls hack gluon hack4 bf16 --hack-dots folded_f16 \
  --shapes llama3.1-8b:8:32768 llama3.1-8b:8:131072 llama3.1-8b:1:32768 llama3.1-8b:1:131072 llama3.1-8b:8:1024 \
  --reps 3 --no-plot > $O/dec.log 2>&1; pk
timeout 70 python bench/bench_decode_attention.py --out $O/dec_splits --impls hack gluon gluons32 gluons64 \
  --hack-dots folded_f16 --shapes llama3.1-8b:1:32768 llama3.1-8b:1:131072 --reps 3 --no-plot > $O/dec_splits.log 2>&1; pk
for c in gluon:1:32768 gluon:8:1024; do
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 45 ncu --clock-control none --metrics gpu__time_duration.sum --csv \
    python bench/ncu_call.py $c > $O/ncu_${c//:/_}.csv 2> $O/ncu_${c//:/_}.err; echo "exit $?" >> $O/ncu_${c//:/_}.err; pk
done
# the dense part in the first program (DENSE 2) vs a program of its own (DENSE 3), 60 open tokens, same tensors
timeout 90 python bench/gluon_harness.py harn_tmp/glh $O/gl_open.jsonl --shapes b8_32k b1_32k --open 60 \
  --variants s16d2=16:0:21:2 s16d3=16:0:21:3 s128d2=128:0:21:2 s128d3=128:0:21:3 s64d3=64:0:21:3 > $O/gl_open.log 2>&1; pk
