#!/bin/bash
# Call 4 (session 18): the committed kernel (tau + 0 * nu, 4-bit subnormal planes): its gpu tests, the kernel table,
# HACK-4's rows, and the whole-model step hack vs bf16.
set -u
O=/tmp/o4; mkdir -p $O; export PYTHONPATH=.
git log -1 --format='commit %H' > $O/env.txt 2>/dev/null; git status --short >> $O/env.txt 2>/dev/null
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 120 python3 -m pytest -q -m gpu -n 6 tests/test_decode_kernels.py tests/test_bits.py \
  tests/test_fused_decode.py tests/test_stacked_decode.py -p no:cacheprovider > $O/gpu_tests.log 2>&1; echo "pytest rc $?" >> $O/gpu_tests.log
timeout -k 5 110 python3 bench/bench_hack_decode.py --out $O/hd --stages bench --shapes b8_32k b1_32k b1_128k b8_128k b8_1k \
  --variants f=folded_f16 i=int8 bf16=bf16paged --reps 3 > $O/hd.log 2>&1
timeout -k 5 70 python3 bench/bench_decode_attention.py --out $O/h4 --impls hack4 bf16 --hack-dots folded_f16 \
  --reps 3 --no-plot --shapes llama3.1-8b:8:32768 llama3.1-8b:1:131072 > $O/h4.log 2>&1
timeout -k 5 200 python3 bench/bench_generate.py --out $O/gen --models llama-3.1-8b --batches 8 1 --contexts 32768 65536 \
  --formats hack bf16 --profile-steps 3 --steps 64 --reps 3 --no-plot --max-seconds 190 > $O/gen.log 2>&1
tar czf $OUT/call4.tgz -C $O .
