#!/usr/bin/env bash
# Session 25 call 2: single-buffer operand-split cp.async (ASYNC 16+) vs direct loads vs Pallas (harness); ncu of one.
set -u
O=/tmp/s2; mkdir -p $O
export PYTHONPATH=. PYTHONUNBUFFERED=1
pk() { tar czf $OUT/s2.tgz -C /tmp s2; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > $O/env.txt 2>&1
timeout 120 python bench/gluon_harness.py harn_tmp/glh $O/gl.jsonl --shapes b8_32k \
  --variants s16=16:0:2 s16s=16:0:21 s16t=16:0:25 s16s184=16:184:21 > $O/gl_b8.log 2>&1; pk
timeout 70 python bench/gluon_harness.py harn_tmp/glh $O/gl.jsonl --shapes b1_128k \
  --variants s128=128:0:2 s128s=128:0:21 s128t=128:0:25 > $O/gl_b1.log 2>&1; pk
SEC="--section SpeedOfLight --section LaunchStats --section Occupancy --section SchedulerStats --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section InstructionStats --section SourceCounters"
timeout 80 ncu --clock-control none -k regex:hack_gluon --launch-skip 2 --launch-count 1 $SEC -f -o $O/ncu_s16t \
  python bench/gluon_harness.py harn_tmp/glh $O/ncu_runs.jsonl --shapes b8_32k --variants s16t=16:0:25 > $O/ncu_s16t.log 2>&1
ncu -i $O/ncu_s16t.ncu-rep --page details > $O/ncu_s16t.txt 2>&1
ncu -i $O/ncu_s16t.ncu-rep --page source --csv --print-source sass > $O/ncu_s16t_sass.csv 2>&1
rm -f $O/*.ncu-rep; pk
