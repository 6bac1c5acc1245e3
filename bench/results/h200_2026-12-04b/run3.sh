#!/bin/bash
set -u
OUT=${OUT:-/tmp/out}
timeout -k 5 150 python3 bench/kernel_harness.py run harn_tmp --variants w4s2r168=4:2:168 w4s3r168=4:3:168 --out $OUT/harness3.jsonl > $OUT/harness3.log 2>&1
PYTHONPATH=. timeout -k 5 200 python3 bench/bench_hack_decode.py --out $OUT/hd --stages bench --shapes b8_32k b1_32k b1_128k b8_128k b8_1k \
  --variants f=folded_f16 f3=folded_f16:d:4:3 i=int8 bf16=bf16paged --reps 3 > $OUT/hd.log 2>&1
cp $OUT/hd/hack_decode.jsonl $OUT/hd.jsonl 2>/dev/null; rm -rf $OUT/hd
PYTHONPATH=. timeout -k 5 220 python3 -m pytest -q -m gpu tests/test_decode_kernels.py tests/test_bits.py tests/test_fused_decode.py -x -p no:cacheprovider > $OUT/gpu_tests.log 2>&1
echo "pytest rc $?" >> $OUT/gpu_tests.log
