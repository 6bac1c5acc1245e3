#!/bin/bash
# Call 5 (session 19): the split combine as one small Pallas kernel (common.combine_splits, working tree) vs the jnp
# form XLA runs as four kernels (harn_tmp/da_oldcombine.py: the committed kernel file with that combine), through XLA
# in one process; the GPU kernels of one call (ncu, all kernels); the gpu tests; the whole-model step hack vs bf16.
set -u
O=/tmp/s19o5; rm -rf $O; mkdir -p $O; export PYTHONPATH=.
git status --short > $O/env.txt 2>/dev/null
timeout -k 5 150 python3 bench/kernel_ab.py $O/ab.jsonl old=harn_tmp/da_oldcombine.py new=pallas_kernels/decode_attention.py \
  --shapes b1_32k b8_32k b1_128k b8_1k b8_128k > $O/ab.log 2>&1; echo "ab rc $?" >> $O/ab.log
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 50 ncu --clock-control none --launch-count 300 \
  --metrics gpu__time_duration.sum python3 bench/bench_hack_decode.py --out /tmp/ncu_b1 --stages profile --shapes b1_32k \
  --variants hack=folded_f16 > $O/ncu_all_b1_32k.txt 2>&1; echo "ncu rc $?" >> $O/ncu_all_b1_32k.txt
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 140 python3 -m pytest -q -m gpu -n 8 tests/test_decode_kernels.py tests/test_bits.py \
  tests/test_fused_decode.py tests/test_stacked_decode.py tests/test_attention.py -p no:cacheprovider > $O/gpu_tests.log 2>&1
echo "pytest rc $?" >> $O/gpu_tests.log
timeout -k 5 150 python3 bench/bench_generate.py --out $O/gen --models llama-3.1-8b --batches 1 8 --contexts 32768 \
  --formats hack bf16 --profile-steps 3 --steps 64 --reps 3 --no-plot --prefill-contexts --max-seconds 140 > $O/gen.log 2>&1
tar czf $OUT/call5.tgz -C $O .
