#!/bin/bash
# Call 2 (session 19): the kernel with meta_flat + kchain in place (the working tree): its gpu tests, the kernel table,
# HACK-4's rows, and the time of every GPU kernel of one decode-attention call (ncu, all kernels) at b1_32k / b8_32k.
set -u
O=/tmp/o2; mkdir -p $O; export PYTHONPATH=.
git status --short > $O/env.txt 2>/dev/null; git diff --stat >> $O/env.txt 2>/dev/null
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 130 python3 -m pytest -q -m gpu -n 6 tests/test_decode_kernels.py tests/test_bits.py \
  tests/test_fused_decode.py tests/test_stacked_decode.py -p no:cacheprovider > $O/gpu_tests.log 2>&1; echo "pytest rc $?" >> $O/gpu_tests.log
timeout -k 5 120 python3 bench/bench_hack_decode.py --out $O/hd --stages bench --shapes b8_32k b1_32k b1_128k b8_128k b8_1k \
  --variants f=folded_f16 i=int8 bf16=bf16paged --reps 3 > $O/hd.log 2>&1
timeout -k 5 70 python3 bench/bench_decode_attention.py --out $O/h4 --impls hack4 bf16 --hack-dots folded_f16 \
  --reps 3 --no-plot --shapes llama3.1-8b:8:32768 llama3.1-8b:1:131072 > $O/h4.log 2>&1
for s in b1_32k b8_32k; do
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 60 ncu --clock-control none --launch-count 300 \
    --metrics gpu__time_duration.sum python3 bench/bench_hack_decode.py --out /tmp/ncu_$s --stages profile --shapes $s \
    --variants hack=folded_f16 > $O/ncu_all_$s.txt 2>&1; echo "ncu rc $?" >> $O/ncu_all_$s.txt
done
tar czf $OUT/call2.tgz -C $O .
