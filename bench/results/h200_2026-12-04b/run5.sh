#!/bin/bash
set -u
OUT=${OUT:-/tmp/out}
PYTHONPATH=. timeout -k 5 220 python3 bench/bench_hack_decode.py --out /tmp/hd --stages bench --shapes b8_32k b1_32k b1_128k b8_128k b8_1k \
  --variants f=folded_f16 f3=folded_f16:d:4:3 i=int8 ic=int8:d:4:2:168 bf16=bf16paged --reps 3 > $OUT/hd.log 2>&1
cp /tmp/hd/hack_decode.jsonl $OUT/hd.jsonl
PYTHONPATH=. timeout -k 5 150 python3 bench/bench_decode_attention.py --out /tmp/dec --impls bf16 hack4 --hack-dots folded_f16 --hack-stages 3 \
  --heads llama3.1-8b --batches 1 8 --kv-lens 32768 131072 --reps 3 --no-plot > $OUT/dec.log 2>&1
cp /tmp/dec/decode_attention.jsonl $OUT/dec.jsonl
PYTHONPATH=. timeout -k 5 150 python3 -m pytest -q -m gpu tests/test_decode_kernels.py tests/test_bits.py -p no:cacheprovider > $OUT/gpu_tests.log 2>&1
echo "pytest rc $?" >> $OUT/gpu_tests.log
