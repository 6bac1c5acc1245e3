#!/usr/bin/env bash
# GPU call 2 (session 24): Gluon kernel latency variants (L1 prefetch, V hoisted) vs the Pallas kernel; the
# wrapper's gpu tests after the open-region NaN fix
set -u
O=/tmp/g2; mkdir -p $O
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv > $O/env.txt 2>&1
timeout 130 python harn_tmp/gl/run_gl.py harn_tmp/glh $O/gl.jsonl --shapes b8_32k --variants s16=16:0:0 s16pf1=16:0:1 s16pf2=16:0:2 s16pf3=16:0:3 s24pf1=24:0:1 > $O/gl_b8.log 2>&1
tar czf $OUT/g2.tgz -C /tmp g2
timeout 70 python harn_tmp/gl/run_gl.py harn_tmp/glh $O/gl.jsonl --shapes b1_128k --variants s128=128:0:0 s128pf1=128:0:1 s128pf3=128:0:3 > $O/gl_b1l.log 2>&1
tar czf $OUT/g2.tgz -C /tmp g2
(XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 100 python -m pytest -q -m gpu -p no:cacheprovider tests/test_gluon_decode.py > $O/tests_gluon.log 2>&1; echo "rc $?" >> $O/tests_gluon.log)
tar czf $OUT/g2.tgz -C /tmp g2
