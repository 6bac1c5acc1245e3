#!/bin/bash
# Call 3 (session 18): three sources of the decode kernel (harn_tmp/da_{base,v1,v16}.py) in one process each way:
# pip Triton's build in the harness (TTIR made on the CPU, cap 168), XLA's build (code_ab.py); the gpu tests of
# test_decode_kernels against v1 and v16 (copies of the tree with that source as pallas_kernels/decode_attention.py).
set -u
O=/tmp/o3; mkdir -p $O; export PYTHONPATH=.
for t in v1 v16; do
  rm -rf /tmp/t_$t; mkdir -p /tmp/t_$t; cp -r pallas_kernels hack_jax models tests pyproject.toml /tmp/t_$t/
  cp harn_tmp/da_$t.py /tmp/t_$t/pallas_kernels/decode_attention.py
  (cd /tmp/t_$t && PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 200 python3 -m pytest -q -m gpu -n 4 \
     tests/test_decode_kernels.py -p no:cacheprovider > $O/tests_$t.log 2>&1; echo "pytest rc $?" >> $O/tests_$t.log) &
done
wait
timeout -k 5 150 python3 bench/kernel_harness.py run harn_tmp --variants w4s2r168=4:2:168 --out $O/harness.jsonl > $O/harness.log 2>&1
timeout -k 5 200 python3 bench/results/h200_2026-12-04c/code_ab.py $O/code_ab.jsonl base v1 v16 > $O/code_ab.log 2>&1
tar czf $OUT/call3.tgz -C $O .
