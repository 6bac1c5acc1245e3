#!/usr/bin/env bash
# Session 28, short call: the gpu tests of the DENSE 3 Gluon kernel and the 4-bit prefill kernel; issue 16's two
# 32K rows with HACK-4 (issue 22) in one process.
set -u
O=/tmp/c6; mkdir -p $O
export PYTHONPATH=. PYTHONUNBUFFERED=1
pk() { tar czf $OUT/c6.tgz -C /tmp c6; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > $O/wheels.log 2>&1
export PYTHONPATH="/tmp/site:$PYTHONPATH"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > $O/env.txt 2>&1
(XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python -m pytest -q -m gpu -n 6 -p no:cacheprovider tests/test_gluon_decode.py \
  tests/test_bits.py tests/test_prefill_kernels.py tests/test_prefill.py \
  -k "gluon or prefill_kernel or prefix_kernel or helpers or prefix_through" > $O/tests.log 2>&1; echo "rc $?" >> $O/tests.log); pk
timeout 110 python bench/bench_decode_attention.py --out $O/dec --impls hack gluon hack4 bf16 --hack-dots folded_f16 \
  --shapes llama3.1-8b:8:32768 llama3.1-8b:1:32768 --reps 3 --no-plot > $O/dec.log 2>&1; pk
