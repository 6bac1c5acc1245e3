#!/usr/bin/env bash
# GPU call 3 (session 24): the Gluon kernel with cp.async double-buffered tiles / page ids one group ahead vs direct
# loads vs the Pallas kernel (harness, 8 x 32K); the cp.async path's bit-identity gpu tests
set -u
O=/tmp/g3; mkdir -p $O
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv > $O/env.txt 2>&1
timeout 80 python bench/gluon_harness.py harn_tmp/glh $O/gl.jsonl --shapes b8_32k --variants s16=16:0:0 s16c=16:0:2 s16a=16:0:1 s16ac=16:0:3 > $O/gl_b8.log 2>&1
tar czf $OUT/g3.tgz -C /tmp g3
(XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 50 python -m pytest -q -m gpu -p no:cacheprovider tests/test_gluon_decode.py -k async > $O/tests_gluon.log 2>&1; echo "rc $?" >> $O/tests_gluon.log)
tar czf $OUT/g3.tgz -C /tmp g3
