#!/usr/bin/env bash
# Session 22: Qwen2.5-Coder-1.5B-Instruct (the sums-free layer-18 configuration; its gpu tests beside) (Q4_K_M GGUF, 23 pieces in /tmp/m) accuracy grid at 2K / 4K + passkey.
set -u
cp p23/* /tmp/m/
O=/tmp/cq; mkdir -p $O
cat /tmp/m/q15.part?? > /tmp/m/qwen15.gguf
sha256sum /tmp/m/qwen15.gguf > $O/sha.txt; ls -la /tmp/m | tail -3 >> $O/sha.txt
grep -q cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046 $O/sha.txt || { tar czf $OUT/cq.tgz -C /tmp cq; exit 3; }
C=hack-k32v64-vhad-w128-clip-s16-ns+18:hack:bits=4,partition_size=64
F=kivi2-cache,$C
(XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. timeout 300 python -m pytest -q -m gpu -p no:cacheprovider \
  tests/test_code_sums.py > $O/tests_code_sums.log 2>&1; echo "rc $?" >> $O/tests_code_sums.log) &
SKIP_TESTS=1 SKIP_BENCH=1 GRID=1 PASSKEY=1 GRID_TIMEOUT=${GT:-430} \
GRID_JOBS="/tmp/m/qwen15.gguf:2048:$F /tmp/m/qwen15.gguf:4096:$F" \
GRID_ARGS="--windows 16 --tokens 128 --text .whl/2026-Trump-1,.whl/pg-essays --scan-layers on" \
PASSKEY_JOBS="/tmp/m/qwen15.gguf:1024,2048,4096" \
PASSKEY_ARGS="--formats float32,$C --depths 0.1,0.5,0.9 --trials 4 --haystack .whl/pg-essays --scan-layers on --batch 2" \
bash bench/gpu_check.sh $O > $O/gpu_check.log 2>&1
wait; tar czf $OUT/cq.tgz -C /tmp cq
