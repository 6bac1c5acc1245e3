#!/usr/bin/env bash
# Prepared in session 26, not run: the first device call of the next session (~7 min; best on an H200, where issue 16's
# and 22's targets were set). From the repository root with harn_tmp/glh (`python bench/kernel_harness.py prepare
# harn_tmp/glh --shapes b8_32k b1_128k b1_32k --make-ttir`, carried). 1) the gpu tests added after session 26's last
# call (dense part in split 0, no sinks / 16 sinks, f16 q, FFI vs legacy launch) and the P 128 4-bit test; 2) issue 16's
# matrix and HACK-4 in one process; 3) the harness at the committed kernel.
set -u
O=/tmp/nx; mkdir -p $O
export PYTHONPATH=. PYTHONUNBUFFERED=1
pk() { tar czf $OUT/nx.tgz -C /tmp nx; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > $O/env.txt 2>&1
(XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 130 python -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/test_gluon_decode.py \
  tests/test_triton_decode.py -k "gluon or dispatch" > $O/tests.log 2>&1; echo "rc $?" >> $O/tests.log); pk
timeout 240 python bench/bench_decode_attention.py --out $O/dec --impls hack gluon hack4 bf16 --hack-dots folded_f16 \
  --heads llama3.1-8b --batches 8 1 --kv-lens 32768 131072 1024 --reps 3 --no-plot > $O/dec.log 2>&1; pk
timeout 70 python bench/gluon_harness.py harn_tmp/glh $O/gl.jsonl --shapes b8_32k b1_128k \
  --variants s16=16:0:21 s128=128:0:21 > $O/gl.log 2>&1; pk
