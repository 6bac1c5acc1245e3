#!/bin/bash
set -u
OUT=${OUT:-/tmp/out}
STALLS="regex:smsp__average_warps_issue_stalled_(long_scoreboard|short_scoreboard|wait|barrier|math_pipe_throttle|dispatch_stall|mio_throttle)_per_issue_active\.ratio"
XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. timeout -k 5 120 ncu --clock-control none -k regex:hack_decode \
  --launch-skip 30 --launch-count 1 --section LaunchStats --section SchedulerStats --metrics "$STALLS" \
  python3 bench/probe_maxnreg.py --caps 0 --shapes b8_32k --reps 1 2>&1 | grep -E "Registers|Duration|Issued Warp|stalled|Shared Memory|rc|Error|error" > $OUT/ncu_xla.txt
PYTHONPATH=. timeout -k 5 200 python3 bench/probe_maxnreg.py --caps 0 168 0 --shapes b8_32k b1_32k b1_128k > $OUT/probe.log 2>&1
