#!/usr/bin/env bash
# Session 25 call 1 (planned for an H200; ran on an H100): Gluon cp.async / page-ahead variants vs Pallas (harness), Nsight Compute stall reasons
# of both kernels at 8 x 32K, the Gluon gpu tests.
set -u
O=/tmp/s1; mkdir -p $O
export PYTHONPATH=. PYTHONUNBUFFERED=1
pk() { tar czf $OUT/s1.tgz -C /tmp s1; }
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv; python -c "import jax,triton,torch;print(jax.__version__,triton.__version__,torch.__version__)"; which ncu; ncu --version; } > $O/env.txt 2>&1
timeout 150 python bench/gluon_harness.py harn_tmp/glh $O/gl.jsonl --shapes b8_32k \
  --variants s16=16:0:2 s16a=16:0:3 s12a=12:0:3 s16m=16:0:7 s10m=10:0:7 s16k=16:0:11 s8k=8:0:11 > $O/gl_b8.log 2>&1; pk
timeout 120 python bench/gluon_harness.py harn_tmp/glh $O/gl.jsonl --shapes b1_128k b1_32k \
  --variants s128=128:0:2 s128a=128:0:3 s80m=80:0:7 s128m=128:0:7 > $O/gl_b1.log 2>&1; pk
SEC="--section SpeedOfLight --section LaunchStats --section Occupancy --section SchedulerStats --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section InstructionStats --section SourceCounters"
for v in s16=16:0:2 s10m=10:0:7; do
  n=${v%%=*}
  timeout 120 ncu --clock-control none -k regex:hack_gluon --launch-skip 2 --launch-count 1 $SEC -f -o $O/ncu_$n \
    python bench/gluon_harness.py harn_tmp/glh $O/ncu_runs.jsonl --shapes b8_32k --variants $v > $O/ncu_$n.log 2>&1
  ncu -i $O/ncu_$n.ncu-rep --page details > $O/ncu_$n.txt 2>&1
  ncu -i $O/ncu_$n.ncu-rep --page source --csv --print-source sass > $O/ncu_${n}_sass.csv 2>&1
  pk
done
timeout 120 ncu --clock-control none -k regex:hack_decode_attention --launch-skip 2 --launch-count 1 $SEC -f -o $O/ncu_pallas \
  python bench/gluon_harness.py harn_tmp/glh $O/ncu_runs.jsonl --shapes b8_32k --variants s16=16:0:2 > $O/ncu_pallas.log 2>&1
ncu -i $O/ncu_pallas.ncu-rep --page details > $O/ncu_pallas.txt 2>&1
ncu -i $O/ncu_pallas.ncu-rep --page source --csv --print-source sass > $O/ncu_pallas_sass.csv 2>&1
rm -f $O/*.ncu-rep; pk
(XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 120 python -m pytest -q -m gpu -p no:cacheprovider tests/test_gluon_decode.py > $O/tests_gluon.log 2>&1; echo "rc $?" >> $O/tests_gluon.log)
pk
# pending from #18 (session 22's call_ns.sh), as far as the call's time allows
left=$((560 - SECONDS))
if (( left > 120 )); then
  (XLA_PYTHON_CLIENT_PREALLOCATE=false timeout $((left - 10)) python -m pytest -q -m gpu -p no:cacheprovider tests/test_code_sums.py \
    > $O/tests_code_sums.log 2>&1; echo "rc $?" >> $O/tests_code_sums.log)
fi
pk
