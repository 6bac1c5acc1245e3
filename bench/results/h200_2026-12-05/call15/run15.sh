#!/usr/bin/env bash
# Session 22 grid call: both GGUFs from /tmp/m pieces, the accuracy grid (4 processes) + Qwen passkey beside it.
set -u
cp p12/* /tmp/m/
O=/tmp/cg; mkdir -p $O
cat /tmp/m/smol.part1 /tmp/m/smol.part2 > /tmp/m/smol.gguf
cat /tmp/m/qwen.part0? > /tmp/m/qwen.gguf
sha256sum /tmp/m/smol.gguf /tmp/m/qwen.gguf > $O/sha.txt; ls -la /tmp/m >> $O/sha.txt
grep -q b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 $O/sha.txt && \
grep -q 1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 $O/sha.txt || { tar czf $OUT/cg.tgz -C /tmp cg; exit 3; }
F=kivi2-cache,hack-k32v64-vhad-w128-clip-s16+18:hack:bits=4,partition_size=64
C=hack-k32v64-vhad-w128-clip-s16+18:hack:bits=4,partition_size=64
SKIP_TESTS=1 SKIP_BENCH=1 GRID=1 PASSKEY=1 GRID_TIMEOUT=${GT:-500} \
GRID_JOBS="/tmp/m/smol.gguf:2048:$F /tmp/m/smol.gguf:4096:$F /tmp/m/qwen.gguf:2048:$F /tmp/m/qwen.gguf:4096:$F" \
GRID_ARGS="--windows 24 --tokens 128 --text .whl/2026-Trump-1,.whl/pg-essays --scan-layers on" \
PASSKEY_JOBS="/tmp/m/qwen.gguf:1024,2048,4096" \
PASSKEY_ARGS="--formats float32,$C --depths 0.1,0.5,0.9 --trials 4 --haystack .whl/pg-essays --scan-layers on --batch 2" \
bash bench/gpu_check.sh $O > $O/gpu_check.log 2>&1
tar czf $OUT/cg.tgz -C /tmp cg
