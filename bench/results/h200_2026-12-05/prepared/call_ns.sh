#!/usr/bin/env bash
# Session 22: the sums-free cache (QuantConfig.code_sums=False) on the GPU: its gpu tests, then its decode rows.
set -u
O=/tmp/cn; mkdir -p $O
export PYTHONPATH=. PYTHONUNBUFFERED=1
(XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 240 python -m pytest -q -m gpu -p no:cacheprovider tests/test_code_sums.py \
  > $O/tests_code_sums.log 2>&1; echo "rc $?" >> $O/tests_code_sums.log)
timeout 200 python bench/bench_decode_attention.py --out $O/dec --impls hackw hackwns hack bf16 --hack-dots folded_f16 \
  --shapes llama3.1-8b:8:32768 llama3.1-8b:1:131072 --reps 3 --no-plot > $O/dec.log 2>&1
tar czf $OUT/cn.tgz -C /tmp cn
