#!/bin/bash
# Call 1 (session 18): the capped kernel's gpu tests (2- and 4-bit), a register-cap / warps sweep, HACK-4 planes, ncu.
set -u
O=/tmp/o; mkdir -p $O; export PYTHONPATH=.
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $O/env.txt
python3 -c 'import jax, jaxlib, triton; print("jax", jax.__version__, "jaxlib", jaxlib.__version__, "triton", triton.__version__, jax.devices())' >> $O/env.txt 2>&1
git log -1 --format='commit %H %s' >> $O/env.txt 2>/dev/null; git status --short >> $O/env.txt 2>/dev/null
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 150 python3 -m pytest -q -m gpu -n 4 tests/test_bits.py tests/test_decode_kernels.py \
  -p no:cacheprovider > $O/gpu_tests.log 2>&1; echo "pytest rc $?" >> $O/gpu_tests.log
timeout -k 5 120 python3 bench/bench_hack_decode.py --out $O/hd --stages bench --shapes b8_32k b1_32k b1_128k \
  --variants f=folded_f16 f4=folded_f16:d4:4:2:128 w8=folded_f16:d2:8:2:128 w8n=folded_f16:d2:8:2:0 bf16=bf16paged --reps 3 > $O/hd.log 2>&1
timeout -k 5 100 python3 bench/bench_decode_attention.py --out $O/h4 --impls hack4 bf16 --hack-dots folded_f16m folded_f16d \
  --reps 3 --no-plot --shapes llama3.1-8b:8:32768 llama3.1-8b:1:131072 > $O/h4.log 2>&1
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 90 ncu --clock-control none -k regex:hack_decode --launch-skip 2 --launch-count 1 \
  --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats \
  --section MemoryWorkloadAnalysis_Tables --section InstructionStats \
  --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
  python3 bench/bench_hack_decode.py --out /tmp/ncu_run --stages profile --shapes b8_32k --variants hack=folded_f16 > $O/ncu.txt 2>&1
echo "ncu rc $?" >> $O/ncu.txt
tar czf $OUT/call1.tgz -C $O .
