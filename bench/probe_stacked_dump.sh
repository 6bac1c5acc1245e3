#!/usr/bin/env bash
# GPU probe (NOTES_decode.md session 14-15): which of q's dtype, open_full and the pools' offset width makes
# the subnormal planes slow on a stacked layer, with the device's own PTX of each variant (XLA dump) and
# ptxas' register / spill report of it.
#
#   PYTHONPATH=. bench/probe_stacked_dump.sh OUT_DIR ["Q:OPEN:LAYERS:CAPACITY ..."]
#
# Writes OUT_DIR/probe.log (us per call, bench/probe_stacked_speed.py), OUT_DIR/<variant>_<module>_*.ptx (the
# XLA modules that hold the decode kernel) and OUT_DIR/ptxas.txt. (Only the timing part has run on the H200,
# session 15 call 1: the PTX copy-out was rewritten after that call and has not run yet.)
set -u
OUT=${1:?OUT_DIR}
# (since common.kernel_q the subnormal kernel gets a float32 q whatever Q says: the Q cases differ only for the
# magic planes)
CASES=${2:-"bfloat16:1:1:32832 float32:1:1:32832 bfloat16:0:1:32832 float32:0:1:32832 bfloat16:1:32:65600"}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.}
for c in $CASES; do
  IFS=: read -r q open layers cap <<<"$c"
  name="q${q}_open${open}_L${layers}_cap${cap}"
  XLA_FLAGS="--xla_dump_to=$OUT/$name --xla_dump_hlo_module_re=.*loop.*" PROBE_Q=$q PROBE_OPEN_FULL=$open \
    PROBE_SHAPES="$layers:$cap" timeout -k 5 150 python3 bench/probe_stacked_speed.py 2>&1 | grep -v "^W0000\|^I0000" \
    | tee -a "$OUT/probe.log"
  # keep the PTX of the modules that hold the decode kernel, flat (the dump nests a folder per module)
  find "$OUT/$name" -name "*.ptx" | while read -r f; do
    grep -q hack_decode_attention "$f" && cp "$f" "$OUT/${name}_$(basename "$(dirname "$f")")_$(basename "$f")"
  done
  rm -rf "${OUT:?}/$name"
done
PTXAS=$(command -v ptxas || python3 -c "import triton, os; print(os.path.dirname(triton.__file__) + '/backends/nvidia/bin/ptxas')")
for f in "$OUT"/*.ptx; do
  echo "== $f" >>"$OUT/ptxas.txt"
  "$PTXAS" -v --gpu-name sm_90a "$f" -o /dev/null 2>&1 | grep -i "hack\|registers\|spill" >>"$OUT/ptxas.txt"
done
cat "$OUT/ptxas.txt"
ls -la "$OUT" | head -40
