"""The compiled forward steps both generation drivers run (Generator: models/generate.py, Engine:
models/engine.py), and what they share around them: cache sizing, page allocators, the executable
cache and compile timing.

One jitted function, `forward_step`, runs every step: a prefill, a prefill chunk or a decode step
(hack_jax.step.Step's mode), over all max_seqs slots or over a subset of them (`rows`: the call
computes only those rows, the shared page pool and the other slots' open blocks untouched), and
ends in a static `head` that turns the hidden states into what the driver needs:
  SampleHead(sampling)  one Sampling for the batch, key fold_in(step.key, num_layers); returns the
                        token sampled after each slot's last written row and log p(targets) there
                        (the Generator: generation, teacher forcing).
  RowSampleHead(greedy) per-row sampling settings and keys (sample_rows); returns the token
                        and its own log-prob (the Engine: requests with their own settings).
  ScoreHead()           -log p(targets[:, t]) at every row (the Generator's perplexity).
A Stepper holds the split model (graphdef, state), the attention backend, the cache geometry and
the ahead-of-time compiled executables keyed by every non-array property of a call (shapes, the
Step's static mode / seal, the head), so a driver never recompiles for a shape it has seen.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from hack_jax import kv_cache
from hack_jax.kv_cache import mixed
from hack_jax.layer_formats import LayerFormats
from hack_jax.config import QuantConfig
from hack_jax.paging import PageAllocator
from hack_jax.step import Step
from models import sharding
from models.llama import Llama, init_cache

MIN_BUCKET = 64
FINE_BUCKETS_FROM = 4096  # longer prompts: 4 length buckets per octave instead of 1


def length_bucket(n: int) -> int:
  """The prefill length for an n-token prompt: the smallest power of two >= max(n, 64) up to
  FINE_BUCKETS_FROM; above it, the smallest multiple of an eighth of that power of two (4 buckets per
  octave, e.g. 33000 -> 40960, not 65536): padding <= 25% instead of <= 100% of the prompt, for at
  most 4 compiles per octave instead of 1."""
  b = max(MIN_BUCKET, 1 << (max(n, 1) - 1).bit_length())
  if b <= FINE_BUCKETS_FROM:
    return b
  step = b // 8
  return -(-n // step) * step


def chunk_length(n: int, chunk: int | None) -> int:
  """Tokens of the first prefill step of an n-token prompt: its length bucket, capped at `chunk`
  (None = no chunking). Every later chunk of a chunked prefill is `chunk` tokens."""
  return length_bucket(n) if chunk is None else min(length_bucket(n), chunk)


def sample(logits: jax.Array, key: jax.Array, sampling) -> jax.Array:
  """logits f32[B, V] -> i32[B] token ids under one generate.Sampling (temperature, then top-k,
  then top-p filtering)."""
  if sampling.temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits / sampling.temperature
  if sampling.top_k:
    kth = jax.lax.top_k(logits, min(sampling.top_k, logits.shape[-1]))[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if sampling.top_p < 1:
    desc = jnp.sort(logits, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(desc, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it < top_p.
    keep = jnp.cumsum(probs, axis=-1) - probs < sampling.top_p
    cutoff = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < cutoff, -jnp.inf, logits)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def sample_rows(logits, keys, counters, temperature, top_k, top_p):
  """Per-row sampling. logits f32[S, V]; keys: u32 key data [S, ...] (one per row), counters
  i32[S] (the row draws with fold_in(key, counter)); temperature f32[S] (0 = argmax), top_k
  i32[S] (0 = off), top_p f32[S] (1 = off) -> i32[S]. Per row the same filtering as `sample`:
  temperature, then top-k, then the smallest top-p nucleus."""
  v = logits.shape[-1]
  greedy = temperature <= 0
  scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
  desc = jnp.sort(scaled, axis=-1)[:, ::-1]
  kth = jnp.take_along_axis(desc, jnp.clip(top_k - 1, 0, v - 1)[:, None], axis=-1)
  kth = jnp.where(top_k[:, None] > 0, kth, -jnp.inf)
  desc = jnp.where(desc < kth, -jnp.inf, desc)
  probs = jax.nn.softmax(desc, axis=-1)
  keep = jnp.cumsum(probs, axis=-1) - probs < top_p[:, None]
  cutoff = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
  cutoff = jnp.where(top_p[:, None] < 1, jnp.maximum(cutoff, kth), kth)
  filtered = jnp.where(scaled < cutoff, -jnp.inf, scaled)
  row_keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(keys), counters)
  drawn = jax.vmap(jax.random.categorical)(row_keys, filtered)
  return jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)


# ---------------------------------------------------------------------------------------- heads

@dataclasses.dataclass(frozen=True)
class SampleHead:
  """Generator sampling: one generate.Sampling (hashable) for every slot."""
  sampling: Any

  def __call__(self, model, hidden, step, targets):
    last = _last_written(hidden, step)
    logits = model.logits(last)
    logp = jax.nn.log_softmax(logits, axis=-1)
    key = jax.random.fold_in(step.key, model.config.num_layers)
    return (sample(logits, key, self.sampling),
            jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0])


@dataclasses.dataclass(frozen=True)
class RowSampleHead:
  """Engine sampling: greedy (static) = argmax for every row, else sample_rows on the
  per-row arrays `samp` (sample_rows' keys, counters, temperature, top_k, top_p)."""
  greedy: bool

  def __call__(self, model, hidden, step, samp):
    logits = model.logits(_last_written(hidden, step))
    token = (jnp.argmax(logits, axis=-1).astype(jnp.int32) if self.greedy
             else sample_rows(logits, **samp))
    logp = jax.nn.log_softmax(logits, axis=-1)
    return token, jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]


@dataclasses.dataclass(frozen=True)
class ScoreHead:
  """-log p(targets[s, t]) at every row t: f32[S, T]."""

  def __call__(self, model, hidden, step, targets):
    logp = jax.nn.log_softmax(model.logits(hidden), axis=-1)
    return (-jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0],)


@dataclasses.dataclass(frozen=True)
class LogpHead:
  """log-softmax f32[S, V] of each slot's last written row (decode: its one row), the whole
  next-token distribution (models/eval_score.py); takes no head arrays."""

  def __call__(self, model, hidden, step, head_args):
    del head_args
    logits = model.logits(_last_written(hidden, step))
    return (jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1),)


def _last_written(hidden, step):
  """hidden [S, T, D] -> [S, D], each slot's last written row (row 0 for a decode step)."""
  last = jnp.maximum(step.write_lens - 1, 0)[:, None, None]
  return jnp.take_along_axis(hidden, last, axis=1)[:, 0]


# ---------------------------------------------------------------------------------- the step

@functools.partial(jax.jit, static_argnames=("graphdef", "attention", "head"),
                   donate_argnames=("cache",))
def forward_step(state, tokens, step, cache, rows, head_args, *, graphdef, attention, head):
  """One cached forward step.

  tokens i32[R, T] (decode: i32[R], the token fed per slot at position step.kv_lens - 1; else
  row t of slot s is position step.start[s] + t); step a Step over the R rows computed; rows None
  (R = max_seqs: every slot) or i32[R] distinct slots (the call reads and writes only their
  per-sequence cache arrays; step.page_indices are their table rows); head_args: the head's
  arrays. Returns (cache, *head outputs).
  """
  model = nnx.merge(graphdef, state)
  if step.mode == "decode":
    tokens, positions = tokens[:, None], step.kv_lens[:, None] - 1
  else:
    positions = step.start[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
  sub = cache if rows is None else take_rows(cache, rows)
  sub, hidden = model.run(tokens, positions, sub, step, attention)
  cache = sub if rows is None else put_rows(cache, sub, rows)
  return (cache, *head(model, hidden, step, head_args))


# Per-sequence arrays of a LayerCache (hack_jax.kv_cache: open blocks and sinks, [max_seqs, ...]);
# every other array is the shared page pool [num_pages, ...].
_PER_SEQUENCE = ("open_k", "open_v", "sink_k", "sink_v")


def take_rows(cache, rows):
  """The cache restricted to slots `rows` (i32[R], distinct): the rows' per-sequence arrays (axis 1
  of a stacked cache), the page pool shared."""
  axis = 1 if cache.stacked else 0
  def take(layer):
    return dataclasses.replace(layer, **{f: jnp.take(getattr(layer, f), rows, axis=axis)
                                         for f in _PER_SEQUENCE if hasattr(layer, f)})
  layers = mixed.map_groups(take, cache.layers) if cache.stacked else tuple(map(take, cache.layers))
  return dataclasses.replace(cache, layers=layers)


def put_rows(cache, sub, rows):
  """Inverse of take_rows: sub's pool and its rows written back into cache."""
  def put(layer, new):
    at = (lambda a: a.at[:, rows]) if cache.stacked else (lambda a: a.at[rows])
    return dataclasses.replace(new, **{f: at(getattr(layer, f)).set(getattr(new, f))
                                       for f in _PER_SEQUENCE if hasattr(layer, f)})
  layers = (mixed.map_groups(put, cache.layers, sub.layers) if cache.stacked
            else tuple(map(put, cache.layers, sub.layers)))
  return dataclasses.replace(cache, layers=layers)


def decode_record(alloc: PageAllocator, quant: QuantConfig, kv_lens, active, key, *,
                  deferred: bool = False) -> Step:
  """The decode Step after which active slot s holds kv_lens[s] tokens (its new one included):
  reserves the page each new token needs. deferred (Stepper.deferred_seal): seal "after" on every
  step (one decode executable; Stepper.__call__ seals after the steps that fill a region); else the
  sealing path compiled out (seal "never") where no active slot fills its open block
  (kv_cache.seals_block), "always" where one does. The sink rows' writes compiled out (sinks False)
  unless some active slot's token is a sink (kv_cache.writes_sink: a prompt shorter than the sinks),
  so prompts of num_sink_tokens tokens or more never compile the sinks=True step."""
  for s in np.nonzero(active)[0]:
    alloc.reserve(int(s), int(kv_lens[s]))
  seal = "after" if deferred else "always" if kv_cache.seals_block(quant, kv_lens, active) else "never"
  return Step.decode(alloc.page_indices, kv_lens, active, key, seal, kv_cache.writes_sink(quant, kv_lens, active))


def check_sinks(quant: QuantConfig, step: Step) -> None:
  """ValueError if a decode Step says sinks=False while its host lengths (NumPy arrays; traced or
  device ones are not read) have an active slot write a sink token (kv_cache.writes_sink): under jit
  the token would be dropped. Raised before the step runs, so the caller's cache is untouched."""
  if step.mode != "decode" or step.sinks or not isinstance(step.kv_lens, np.ndarray):
    return
  lens, active = step.kv_lens, np.asarray(step.active)
  if kv_cache.writes_sink(quant, lens, active):
    slots = [s for s in range(len(lens)) if kv_cache.writes_sink(quant, lens[s:s + 1], active[s:s + 1])]
    raise ValueError(f"decode Step with sinks=False, but active slot(s) {slots} write a sink token "
                     f"(kv_lens={lens.tolist()}); build it with Step.decode(..., "
                     f"sinks=kv_cache.writes_sink(quant, kv_lens, active))")


def defers_seal(attention: Any, quant: QuantConfig) -> bool:
  """Whether decode steps seal apart (docs/DESIGN.md "Deferred sealing"): every decode step is seal
  "after" (the layers write their rows; a slot whose token fills its open region reads the region's
  16-bit rows) and a small executable seals every layer at once after the steps that fill one, so one
  decode executable serves every step and no layer compiles a seal. Where the backend can
  (Backend.defers_seal: reference / pallas, not the opt-in fused kernel) and the formats can: some
  layer's seals apart (kivi) and none seals inside its append only (seed); per-layer formats
  (hack_jax.layer_formats) included, Backend.finish sealing each format's stack of layers."""
  formats = [kv_cache.FORMATS[kv_cache.format_of(c)] for c in mixed.formats_of(quant)]
  return bool(getattr(attention, "defers_seal", False) and any(f.seal for f in formats)
              and all(f.seal or not f.blocked for f in formats))


@functools.partial(jax.jit, static_argnames=("attention",), donate_argnums=(0,))
def seal_step(cache, step, rows, *, attention):
  """After a decode step with seal "after": the slots whose token filled their open region sealed in
  every layer (attention.finish; rows as forward_step's). Returns (cache,), as forward_step returns
  (cache, *head outputs)."""
  sub = cache if rows is None else take_rows(cache, rows)
  sub = attention.finish(sub, step)
  return (sub if rows is None else put_rows(cache, sub, rows),)


def _seal_record(step: Step) -> Step:
  """The Step seal_step is compiled for and called with: its sinks flag normalized (the seal writes no
  sink), so decode steps with and without the sink writes share one seal executable."""
  return dataclasses.replace(step, sinks=True)


# -------------------------------------------------------------------------------- the stepper

class Stepper:
  """A model split for jit, its attention backend, one cache geometry and the compiled steps.

  Args: model (a Llama), quant (the cache format: a QuantConfig, or per-layer formats, a
  hack_jax.layer_formats.LayerFormats), max_seqs, max_len (tokens per slot; the cache
  holds whole pages), num_pages (None = room for every slot at max_len, plus the null page),
  attention (None = model.config.attention), mesh (None = the model's, for a
  sharding.shard_model model, else one device; or a 1-D "tp" mesh: the weights and the cache are
  placed sharded and the attention runs per shard, sharding.ShardedBackend), on_stage(stage,
  info) called around each compile: "compiling" (what) and "compiled" (what, seconds).
  Attributes: graphdef, state, config, quant, attention, mesh, max_seqs, pages_per_seq,
  num_pages, compile_s (seconds spent compiling so far).
  Raises ValueError (sharding.check_config) for a model that the mesh does not divide.
  """

  def __init__(self, model: Llama, quant: QuantConfig, *, max_seqs: int, max_len: int,
               num_pages: int | None = None, attention: Any = None, mesh: Mesh | None = None,
               on_stage: Callable[[str, dict], None] | None = None):
    self.mesh = sharding.mesh_of(model) if mesh is None else mesh
    if self.mesh is not None and sharding.mesh_of(model) is None:
      model = sharding.shard_model(model, self.mesh)  # weights placed, config.attention wrapped
    self.config, self.quant, self.max_seqs = model.config, quant, max_seqs
    self.attention = model.config.attention if attention is None else attention
    if self.mesh is not None and not isinstance(self.attention, sharding.ShardedBackend):
      self.attention = sharding.ShardedBackend(self.attention, self.mesh)
    if isinstance(quant, LayerFormats):
      quant.configs(self.config.num_layers)  # ValueError now for a rule the model's depth does not fit
    self.graphdef, self.state = nnx.split(model)
    self.num_sink_tokens = kv_cache.sink_tokens(quant)
    self.pages_per_seq = max(1, math.ceil((max_len - self.num_sink_tokens) / quant.page_size))
    self.num_pages = 1 + max_seqs * self.pages_per_seq if num_pages is None else num_pages
    self.on_stage = on_stage
    self.deferred_seal = defers_seal(self.attention, quant)  # decode_record's `deferred`
    self.compile_s = 0.0
    self._executables: dict[Any, Any] = {}

  def new_cache(self) -> kv_cache.KVCache:
    """An empty cache of this geometry (placed sharded over the mesh, if any)."""
    return self.placed(init_cache(self.config, self.quant, num_pages=self.num_pages,
                                  max_seqs=self.max_seqs, pages_per_seq=self.pages_per_seq))

  def placed(self, cache: kv_cache.KVCache) -> kv_cache.KVCache:
    """The cache sharded over the mesh (as the compiled steps expect it), or as it is."""
    return cache if self.mesh is None else sharding.shard_cache(cache, self.mesh)

  def new_allocator(self) -> PageAllocator:
    return PageAllocator(self.num_pages, self.max_seqs, self.pages_per_seq, self.quant.page_size,
                         self.num_sink_tokens)

  def __call__(self, tokens, step: Step, cache, head, head_args=None, rows=None, *, what="step"):
    """forward_step(state, tokens, step, cache, rows, head_args) through its executable (compiled
    on first use); returns (cache, *head outputs). A decode step with seal "after" in which some
    active slot fills its open region (kv_cache.seals_block on the step's host lengths) is followed
    by seal_step's executable. ValueError (check_sinks) for a decode Step whose sinks=False its host
    lengths contradict, before anything runs."""
    check_sinks(self.quant, step)
    args = (self.state, tokens, step, cache, rows, head_args)
    cache, *out = self.compiled(args, head, what)(*args)
    if step.mode == "decode" and step.seal == "after" and kv_cache.seals_block(
        self.quant, np.asarray(step.kv_lens), np.asarray(step.active)):
      step = _seal_record(step)
      (cache,) = self._seal_executable(cache, step, rows)(cache, step, rows)
    return (cache, *out)

  def _seal_executable(self, cache, step, rows):
    args = (self.state, None, step, cache, rows, None)
    if self._seal_key(args) not in self._executables:
      self.compile_many([(args, None, "seal")])
    return self._executables[self._seal_key(args)]

  def compiled(self, args, head, what="step"):
    """The executable of forward_step for these arguments' shapes and statics (compiled once)."""
    key = self._key(args, head)
    if key not in self._executables:
      self.compile_many([(args, head, what)])
    return self._executables[key]

  def compile_many(self, calls, *, threads: int = 8) -> None:
    """Compiles the executables of `calls` ((args, head, what) each) not compiled yet: traced and
    lowered one after the other (decode and prefill steps first, seals last), each handed to one of up
    to `threads` compile threads as soon as it is lowered (XLA compiles without the GIL: the wait
    before a server's first request is the longest compile plus the lowering ahead of it, not the
    sum). compile_s grows by the wall time of the whole."""
    todo = {}
    for args, head, what in calls:
      todo.setdefault(self._seal_key(args) if what == "seal" else self._key(args, head), (args, head, what))
      step = args[2]
      if what != "seal" and step.mode == "decode" and step.seal == "after":  # its seal, compiled beside it
        todo.setdefault(self._seal_key(args), (args, None, "seal"))
    todo = {k: v for k, v in todo.items() if k not in self._executables}
    if not todo:
      return
    whats = ", ".join(what for _, _, what in todo.values())
    self._stage("compiling", what=whats)
    t0 = time.perf_counter()
    order = sorted(todo, key=lambda k: todo[k][2] == "seal")
    with concurrent.futures.ThreadPoolExecutor(max(1, min(threads, len(todo)))) as pool:
      futures = {}
      for k in order:
        args, head, what = todo[k]
        low = (seal_step.lower(args[3], _seal_record(args[2]), args[4], attention=self.attention) if what == "seal" else
               forward_step.lower(*args, graphdef=self.graphdef, attention=self.attention, head=head))
        futures[k] = pool.submit(low.compile)
      self._executables.update({k: f.result() for k, f in futures.items()})
    dt = time.perf_counter() - t0
    self.compile_s += dt
    self._stage("compiled", what=whats, seconds=dt)

  def _seal_key(self, args):
    """The executable key of seal_step for forward_step's args (its Step and rows)."""
    return ("seal", self._key((None, None, _seal_record(args[2]), None, args[4], None), None))

  @staticmethod
  def _key(args, head):
    leaves, treedef = jax.tree.flatten((args[1:3], args[4:]))  # tokens, Step, rows, head_args
    return (treedef, tuple((np.shape(a), str(getattr(a, "dtype", type(a)))) for a in leaves), head)

  @property
  def num_executables(self) -> int:
    return len(self._executables)

  def _stage(self, stage, **info):
    if self.on_stage is not None:
      self.on_stage(stage, info)
