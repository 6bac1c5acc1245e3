#!/usr/bin/env bash
# Session 28, last short call: gpu tests of the DENSE 3 Gluon kernel and of the 4-bit prefill kernel only.
set -u
O=/tmp/c7; mkdir -p $O
export PYTHONPATH=. PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > $O/wheels.log 2>&1
export PYTHONPATH="/tmp/site:$PYTHONPATH"
nvidia-smi --query-gpu=name --format=csv > $O/env.txt 2>&1
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 130 python -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_gluon_decode.py \
  tests/test_bits.py tests/test_prefill.py -k "gluon or prefill_kernel or prefix_kernel or prefix_through" 2>&1 | tee $O/tests.log
echo "rc $?" >> $O/tests.log; tar czf $OUT/c7.tgz -C /tmp c7
