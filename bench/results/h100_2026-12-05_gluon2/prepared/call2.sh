#!/usr/bin/env bash
# Prepared in session 25, not run: the Gluon kernel's single-buffer staging (ASYNC 21 / 25) and two programs per
# split over two planes each (PAIRS 2, register caps 168 / 184: 12 / 11 warps per SM) vs direct loads vs the
# Pallas kernel (harness), ncu of the PAIRS variant, then the gpu tests of both options. From the repository root,
# with harn_tmp/glh = `python bench/kernel_harness.py prepare harn_tmp/glh --shapes b8_32k b1_128k b1_32k --make-ttir`.
set -u
O=/tmp/s2; mkdir -p $O
export PYTHONPATH=. PYTHONUNBUFFERED=1
pk() { tar czf $OUT/s2.tgz -C /tmp s2; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > $O/env.txt 2>&1
timeout 150 python bench/gluon_harness.py harn_tmp/glh $O/gl.jsonl --shapes b8_32k \
  --variants s16=16:0:2 p12r168=12:168:2:2 p11r184=11:184:2:2 p16=16:0:2:2 s16s=16:0:21 s16t=16:0:25 \
  > $O/gl_b8.log 2>&1; pk
timeout 100 python bench/gluon_harness.py harn_tmp/glh $O/gl.jsonl --shapes b1_128k b1_32k \
  --variants s128=128:0:2 p64r168=64:168:2:2 p128r168=128:168:2:2 s128s=128:0:21 > $O/gl_b1.log 2>&1; pk
SEC="--section SpeedOfLight --section LaunchStats --section Occupancy --section SchedulerStats --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section InstructionStats --section SourceCounters"
timeout 80 ncu --clock-control none -k regex:hack_gluon --launch-skip 2 --launch-count 1 $SEC -f -o $O/ncu_p12 \
  python bench/gluon_harness.py harn_tmp/glh $O/ncu_runs.jsonl --shapes b8_32k --variants p12r168=12:168:2:2 > $O/ncu_p12.log 2>&1
ncu -i $O/ncu_p12.ncu-rep --page details > $O/ncu_p12.txt 2>&1
ncu -i $O/ncu_p12.ncu-rep --page source --csv --print-source sass > $O/ncu_p12_sass.csv 2>&1
rm -f $O/*.ncu-rep; pk
(XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 python -m pytest -q -m gpu -p no:cacheprovider tests/test_gluon_decode.py \
  -k "plane_pairs or async" > $O/tests_gluon.log 2>&1; echo "rc $?" >> $O/tests_gluon.log); pk
