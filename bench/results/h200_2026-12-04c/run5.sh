#!/bin/bash
# Call 5 (session 18): the committed kernel (ship) vs the page id loaded one trip ahead (pf1) vs 3 pipeline stages (s3),
# XLA's builds side by side (code_ab.py); then test_decode_kernels' gpu tests against pf1.
set -u
O=/tmp/o5; mkdir -p $O; export PYTHONPATH=.
CODE_AB_SHAPES="b8_32k b1_128k" timeout -k 5 110 python3 bench/results/h200_2026-12-04c/code_ab.py $O/code_ab.jsonl ship pf1 s3 > $O/code_ab.log 2>&1
rm -rf /tmp/t_pf1; mkdir -p /tmp/t_pf1; cp -r pallas_kernels hack_jax models tests pyproject.toml /tmp/t_pf1/
cp harn_tmp/da_pf1.py /tmp/t_pf1/pallas_kernels/decode_attention.py
(cd /tmp/t_pf1 && PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 80 python3 -m pytest -q -m gpu -n 8 \
   tests/test_decode_kernels.py -p no:cacheprovider > $O/tests_pf1.log 2>&1; echo "pytest rc $?" >> $O/tests_pf1.log)
tar czf $OUT/call5.tgz -C $O .
