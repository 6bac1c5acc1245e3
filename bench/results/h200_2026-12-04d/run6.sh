#!/bin/bash
# Call 6 (session 19): combine_splits' Pallas kernel from 16 programs up only (PALLAS_COMBINE_MIN_PROGRAMS; fewer: XLA's
# lse_combine as before), vs the committed kernel file with the jnp combine (harn_tmp/da_oldcombine.py), one process;
# gpu tests of the decode kernels.
set -u
O=/tmp/s19o6; rm -rf $O; mkdir -p $O; export PYTHONPATH=.
git status --short > $O/env.txt 2>/dev/null
timeout -k 5 110 python3 bench/kernel_ab.py $O/ab.jsonl old=harn_tmp/da_oldcombine.py new=pallas_kernels/decode_attention.py \
  --shapes b1_32k b8_32k b8_1k b1_128k > $O/ab.log 2>&1; echo "ab rc $?" >> $O/ab.log
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 80 python3 -m pytest -q -m gpu -n 8 tests/test_decode_kernels.py \
  tests/test_fused_decode.py tests/test_stacked_decode.py -p no:cacheprovider > $O/gpu_tests.log 2>&1
echo "pytest rc $?" >> $O/gpu_tests.log
tar czf $OUT/call6.tgz -C $O .
