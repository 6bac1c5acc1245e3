#!/bin/bash
# Call 4 (session 19): split combine as one variadic reduction (common.lse_combine, working tree) vs session 18's
# max / exp / sum / divide form (harn_tmp/da_oldcombine.py: the same kernel file with the old combine inline), through
# XLA in one process; the GPU kernels of one call (ncu, all kernels) with the new combine; gpu tests of the kernels
# whose splits it merges.
set -u
O=/tmp/s19o4; rm -rf $O; mkdir -p $O; export PYTHONPATH=.
git status --short > $O/env.txt 2>/dev/null
timeout -k 5 150 python3 bench/kernel_ab.py $O/ab.jsonl old=harn_tmp/da_oldcombine.py new=pallas_kernels/decode_attention.py \
  --shapes b1_32k b8_32k b1_128k b8_1k > $O/ab.log 2>&1; echo "ab rc $?" >> $O/ab.log
for s in b1_32k b8_32k; do
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 60 ncu --clock-control none --launch-count 300 \
    --metrics gpu__time_duration.sum python3 bench/bench_hack_decode.py --out /tmp/ncu_$s --stages profile --shapes $s \
    --variants hack=folded_f16 > $O/ncu_all_$s.txt 2>&1; echo "ncu rc $?" >> $O/ncu_all_$s.txt
done
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 150 python3 -m pytest -q -m gpu -n 6 tests/test_decode_kernels.py \
  tests/test_bf16_decode_kernel.py tests/test_baseline_caches.py tests/test_fused_decode.py tests/test_attention.py \
  -p no:cacheprovider > $O/gpu_tests.log 2>&1; echo "pytest rc $?" >> $O/gpu_tests.log
tar czf $OUT/call4.tgz -C $O .
