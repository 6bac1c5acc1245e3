#!/bin/bash
# Call 2 (session 18): whole-model step with the capped kernel (hack vs hack-nocap vs bf16); HACK-4 with the
# subnormal planes as default_config's choice (its gpu tests; kernel rows subnormal vs magic; end to end).
set -u
O=/tmp/o2; mkdir -p $O; export PYTHONPATH=.
git log -1 --format='commit %H' > $O/env.txt 2>/dev/null; git status --short >> $O/env.txt 2>/dev/null
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 100 python3 -m pytest -q -m gpu -n 4 tests/test_bits.py \
  -p no:cacheprovider > $O/gpu_tests.log 2>&1; echo "pytest rc $?" >> $O/gpu_tests.log
timeout -k 5 130 python3 bench/bench_decode_attention.py --out $O/h4 --impls hack4 bf16 --hack-dots folded_f16m folded_f16d \
  --reps 3 --no-plot --shapes llama3.1-8b:1:1024 llama3.1-8b:8:1024 llama3.1-8b:1:32768 llama3.1-8b:8:32768 \
  llama3.1-8b:1:131072 llama3.1-8b:8:131072 > $O/h4.log 2>&1
timeout -k 5 260 python3 bench/bench_generate.py --out $O/gen --models llama-3.1-8b --batches 1 8 --contexts 32768 65536 \
  --formats hack hack-nocap bf16 --profile-steps 3 --steps 64 --reps 3 --no-plot --max-seconds 250 > $O/gen.log 2>&1
timeout -k 5 100 python3 bench/bench_generate.py --out $O/gen4 --models llama-3.1-8b --batches 8 --contexts 32768 \
  --formats hack4 hack4-magic bf16 --steps 64 --reps 3 --no-plot --max-seconds 90 > $O/gen4.log 2>&1
tar czf $OUT/call2.tgz -C $O .
