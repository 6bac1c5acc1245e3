#!/bin/bash
# Call 3 (session 19): the whole-model step (Llama-3.1-8B, random bf16 weights) with the kernel of calls 1-2 in place,
# hack vs bf16 at batch 8 / 1 and 32K / 64K, then hack4 vs bf16 at 8 x 32K, each in one process.
set -u
O=/tmp/s19o3; rm -rf $O; mkdir -p $O; export PYTHONPATH=.
git status --short > $O/env.txt 2>/dev/null
timeout -k 5 230 python3 bench/bench_generate.py --out $O/gen --models llama-3.1-8b --batches 8 1 --contexts 32768 65536 \
  --formats hack bf16 --profile-steps 3 --steps 64 --reps 3 --no-plot --max-seconds 220 > $O/gen.log 2>&1
timeout -k 5 120 python3 bench/bench_generate.py --out $O/gen4 --models llama-3.1-8b --batches 8 --contexts 32768 \
  --formats hack4 bf16 --steps 64 --reps 3 --no-plot --max-seconds 110 > $O/gen4.log 2>&1
tar czf $OUT/call3.tgz -C $O .
