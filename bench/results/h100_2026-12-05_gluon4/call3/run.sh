#!/usr/bin/env bash
# Session 27 call 3 (call 2's ncu crashed with multi-pass metrics): one ncu process per config, duration + registers.
set -u
O=/tmp/c3; mkdir -p $O
export PYTHONPATH=. PYTHONUNBUFFERED=1
pk() { tar czf $OUT/c3.tgz -C /tmp c3; }
M=gpu__time_duration.sum,launch__registers_per_thread
for c in gluon:1:32768 gluon:1:32772 gluon:1:32768:jnp gluon:1:32772:direct gluon:8:32768 gluon:8:32772 hack:1:32772; do
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 45 ncu --clock-control none -k regex:hack_ --metrics $M --csv \
    python harn_tmp/ncu_call.py $c > $O/ncu_${c//:/_}.csv 2> $O/ncu_${c//:/_}.err; echo "exit $?" >> $O/ncu_${c//:/_}.err; pk
done
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 60 ncu --clock-control none -k regex:gluon --launch-count 5 --metrics $M --csv \
  python bench/gluon_harness.py harn_tmp/glh $O/gl.jsonl --shapes b1_32k --variants s128=128:0:21 > $O/ncu_harness.csv 2> $O/ncu_harness.err
echo "exit $?" >> $O/ncu_harness.err; pk
