#!/bin/bash
# one-off: token-major V codes and 8/16-warp programs (2026-12-01 session 3)
export PYTHONPATH=.
OUT=${1:?out dir}
B="python3 bench/bench_hack_decode.py --out $OUT --reps 3 --target-ms 20 --stages bench"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt 2>&1
timeout 150 $B --shapes b8_32k --variants v=default t=int8asm:d:4:2:dqrbepot w8t=int8asm:4:8:2:dqrbepot w16t=int8asm:2:16:2:dqrbepot 2>&1 | grep -v Warn | tail -5
timeout 150 $B --shapes b1_32k b1_128k --variants v=default t=int8asm:d:4:2:dqrbepot w8t=int8asm:32:8:2:dqrbepot 2>&1 | grep -v Warn | tail -7
timeout 100 $B --shapes b8_8k b8_1k --variants v=default t=int8asm:d:4:2:dqrbepot w8t=int8asm:4:8:2:dqrbepot 2>&1 | grep -v Warn | tail -7
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_decode_kernels.py -k "v_token_major or diet_flags_other" 2>&1 | tail -4
