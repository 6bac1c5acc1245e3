"""Continuous batching on the hack_jax paged KV cache: requests join and leave between decode steps.

An Engine owns one fixed-shape cache (max_seqs slots x max_len tokens) and a host PageAllocator.
Each `step()`:
  1. finishes cancelled requests (their pages go back to the pool);
  2. admits waiting requests (first come, first served) into free slots while the pool can hold
     their prompt + max_tokens, and prefills them, prefill_rows prompts per call: tokens [R, T]
     with T a length bucket (generate.length_bucket), written into those R slots of the cache
     (the call sees only their open blocks, sinks and table rows, plus the shared page pool), so
     a prefill costs R prompts, not max_seqs, and running sequences keep their cache;
  3. runs one decode step for every running request (one token each, all max_seqs rows).
Shapes never depend on which slots are busy, so the compiled steps are reused: one prefill
executable per (length bucket, greedy), and for decode one per (seal, greedy) pair
(kv_cache.seals_block; greedy = every request of the step has temperature 0). Nothing
recompiles when a request is admitted.

Sampling settings are per request, passed to the step as arrays (temperature f32[S], top_k i32[S],
top_p f32[S]); token i of a request is drawn with fold_in(key(request.seed), i), so what a request
samples does not depend on which requests share its batch.

Output is a stream of Events (`stream()`, `step()`): one per generated token with its text delta,
and a final one with finished=True and finish_reason "stop" (a stop id or stop string), "length"
(max_tokens) or "cancelled". Text is decoded incrementally: a delta holds back an incomplete UTF-8
character and any tail that could be the start of a stop string; a stop string and what follows
it never appear in the text. The stop id itself is not part of the output (token_id None).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from hack_jax import handoff, kv_cache, paging
from hack_jax.config import QuantConfig
from hack_jax.step import Step
from models import sharding
from models.generate import Sampling, length_bucket
from models.llama import Llama, init_cache
from models.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class Request:
  """One generation request.

  Attributes:
    prompt_ids: token ids (non-empty). max_tokens: tokens to generate at most (>= 1).
    sampling: generate.Sampling. seed: PRNG seed of this request's sampling.
    stop: strings that end generation (not included in the text). stop_ids: extra token ids that
      end it. ignore_eos: do not stop at the tokenizer's stop ids (stop_ids still apply).
  Raises TypeError / ValueError naming the field for a value of the wrong type or range.
  """
  prompt_ids: Sequence[int]
  max_tokens: int = 64
  sampling: Sampling = Sampling()
  stop: Sequence[str] = ()
  stop_ids: Sequence[int] = ()
  ignore_eos: bool = False
  seed: int = 0

  def __post_init__(self):
    ids = np.asarray(self.prompt_ids)
    if ids.ndim != 1 or ids.size == 0:
      raise ValueError(f"prompt_ids must be a non-empty list of token ids, got shape {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
      raise TypeError(f"prompt_ids must be integers, got dtype {ids.dtype}")
    for name in ("max_tokens", "seed"):
      paging.require_int(name, getattr(self, name))
    if self.max_tokens < 1:
      raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
    if not isinstance(self.sampling, Sampling):
      raise TypeError(f"sampling must be a generate.Sampling, got {type(self.sampling).__name__}")
    if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
      raise TypeError(f"stop must be a list of non-empty strings, got {self.stop!r}")
    for i in self.stop_ids:
      paging.require_int("stop_ids entry", i)
    object.__setattr__(self, "prompt_ids", tuple(int(i) for i in ids))
    object.__setattr__(self, "stop", tuple(self.stop))
    object.__setattr__(self, "stop_ids", frozenset(int(i) for i in self.stop_ids))


@dataclasses.dataclass(frozen=True)
class Event:
  """token_id None on a final event that adds no token (a stop id, a cancel); logprob: natural
  log-probability of token_id under the model's distribution (before temperature, top-k and
  top-p)."""
  request_id: int
  token_id: int | None
  text: str
  finished: bool
  finish_reason: str | None = None
  logprob: float | None = None


@dataclasses.dataclass
class Completion:
  """A finished request: tokens (stop id excluded), text, logprobs (one per token), finish_reason,
  and times (perf_counter seconds): submitted, first_token, finished."""
  request_id: int
  prompt_ids: tuple[int, ...]
  tokens: list[int]
  text: str
  logprobs: list[float]
  finish_reason: str
  times: dict[str, float]


@dataclasses.dataclass
class _Seq:
  """Host state of one admitted request."""
  rid: int
  req: Request
  slot: int
  key: np.ndarray  # u32 key data of jax.random.key(req.seed)
  tokens: list[int] = dataclasses.field(default_factory=list)
  text: str = ""  # decoded so far (complete characters)
  prefix: int = 0  # incremental detokenization window: tokens[prefix:read] decoded last time
  read: int = 0
  sent: int = 0  # characters of text already emitted


def sample_rows(logits, keys, counters, temperature, top_k, top_p):
  """Per-row sampling. logits f32[S, V]; keys: u32 key data [S, ...] (one per row), counters
  i32[S] (the row draws with fold_in(key, counter)); temperature f32[S] (0 = argmax), top_k
  i32[S] (0 = off), top_p f32[S] (1 = off) -> i32[S]. Per row the same filtering as
  generate.sample: temperature, then top-k, then the smallest top-p nucleus."""
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


def _sample_and_logprob(logits, samp, greedy):
  token = (jnp.argmax(logits, axis=-1).astype(jnp.int32) if greedy else sample_rows(logits, **samp))
  logp = jax.nn.log_softmax(logits, axis=-1)
  return token, jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]


def _round_key(count):  # stochastic rounding of the cache (QuantConfig.rounding): a key per step
  return jax.random.fold_in(jax.random.key(0), count)


# Per-sequence arrays of a LayerCache (hack_jax.kv_cache: open blocks and sinks, [max_seqs, ...]);
# every other array is the shared page pool [num_pages, ...].
_PER_SEQUENCE = ("open_k", "open_v", "sink_k", "sink_v")


def _take_rows(cache, rows):
  """The cache restricted to slots `rows` (i32[R], distinct): the rows' per-sequence arrays (axis 1
  of a stacked cache), the page pool shared."""
  axis = 1 if cache.stacked else 0
  def take(layer):
    return dataclasses.replace(layer, **{f: jnp.take(getattr(layer, f), rows, axis=axis)
                                         for f in _PER_SEQUENCE if hasattr(layer, f)})
  layers = take(cache.layers) if cache.stacked else tuple(take(l) for l in cache.layers)
  return dataclasses.replace(cache, layers=layers)


def _put_rows(cache, sub, rows):
  """Inverse of _take_rows: sub's pool and its rows written back into cache."""
  def put(layer, new):
    at = (lambda a: a.at[:, rows]) if cache.stacked else (lambda a: a.at[rows])
    return dataclasses.replace(new, **{f: at(getattr(layer, f)).set(getattr(new, f))
                                       for f in _PER_SEQUENCE if hasattr(layer, f)})
  layers = (put(cache.layers, sub.layers) if cache.stacked
            else tuple(map(put, cache.layers, sub.layers)))
  return dataclasses.replace(cache, layers=layers)


@functools.partial(jax.jit, static_argnames=("graphdef", "greedy"), donate_argnames=("cache",))
def _prefill(state, tokens, rows, step, cache, samp, *, graphdef, greedy):
  """Prefills R slots: rows i32[R] (distinct slots), tokens i32[R, T], step a prefill Step over those
  R rows (its page_indices the rows' table rows; write_lens 0 = row untouched) -> (cache, first
  token i32[R], its log-prob f32[R]). Only R rows are computed, whatever max_seqs is."""
  model = nnx.merge(graphdef, state)
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  sub, hidden = model.run(tokens, positions, _take_rows(cache, rows), step)
  last = jnp.take_along_axis(hidden, jnp.maximum(step.write_lens - 1, 0)[:, None, None], axis=1)[:, 0]
  return _put_rows(cache, sub, rows), *_sample_and_logprob(model.logits(last), samp, greedy)


@functools.partial(jax.jit, static_argnames=("graphdef", "greedy"), donate_argnames=("cache",))
def _decode(state, tokens, step, cache, samp, *, graphdef, greedy):
  """tokens i32[S] fed at positions step.kv_lens - 1 (step: a decode Step) -> (cache, next token
  i32[S], its log-prob f32[S])."""
  model = nnx.merge(graphdef, state)
  cache, hidden = model.run(tokens[:, None], step.kv_lens[:, None] - 1, cache, step)
  return cache, *_sample_and_logprob(model.logits(hidden[:, 0]), samp, greedy)


class Engine:
  """Continuous-batching driver for one model and one cache format (module docstring).

  Args:
    model: a Llama. tokenizer: its Tokenizer. quant: the cache format.
    max_seqs: slots (requests decoded together). max_len: tokens per request (prompt + generated),
      at most the model's context length.
    num_pages: page pool incl. the null page; None = room for every slot at max_len. With fewer,
      a request waits until the pool can hold its prompt + max_tokens (no preemption).
    prefill_rows: prompts per prefill call (R): a call computes R rows, not max_seqs, so admitting
      one request costs one prompt's prefill; more requests admitted at once take several calls.
    on_stage: optional callback(stage, info dict), e.g. for a progress display: "compiling"
      (what) and "compiled" (what, seconds) around each compile; "prefilling" (requests, tokens)
      and "prefilled" (requests, tokens, seconds incl. the first token, compile excluded) around
      each prefill call.
    mesh: None (the model's, for a models.sharding.shard_model model, else one device) or a 1-D
      "tp" mesh: tensor parallelism over kv heads (models/sharding.py), weights and cache sharded.
  Thread safety: submit() and cancel() may be called from any thread; step() / stream() from one.
  Raises ValueError for bad sizes, or num_kv_heads / hidden_dim not divisible by the mesh's size.
  """

  def __init__(self, model: Llama, tokenizer: Tokenizer, quant: QuantConfig = QuantConfig(), *,
               max_seqs: int = 8, max_len: int = 2048, num_pages: int | None = None,
               prefill_rows: int = 1, on_stage: Callable[[str, dict], None] | None = None,
               mesh: Mesh | None = None):
    self.mesh = sharding.mesh_of(model) if mesh is None else mesh
    if self.mesh is not None and sharding.mesh_of(model) is None:
      model = sharding.shard_model(model, self.mesh)
    c = model.config
    if max_seqs < 1 or not 2 <= max_len <= c.max_seq_len or not 1 <= prefill_rows <= max_seqs:
      raise ValueError(f"need max_seqs >= 1, 2 <= max_len <= context length {c.max_seq_len} and "
                       f"1 <= prefill_rows <= max_seqs: {max_seqs=} {max_len=} {prefill_rows=}")
    self.prefill_rows = prefill_rows
    self.config, self.quant, self.tokenizer = c, quant, tokenizer
    self.max_seqs, self.capacity = max_seqs, max_len
    self.graphdef, self.state = nnx.split(model)
    sinks = kv_cache.sink_tokens(quant)
    pages_per_seq = max(1, math.ceil((max_len - sinks) / quant.page_size))
    num_pages = 1 + max_seqs * pages_per_seq if num_pages is None else num_pages
    self.allocator = paging.PageAllocator(num_pages, max_seqs, pages_per_seq, quant.page_size, sinks)
    self.cache = self._placed(init_cache(c, quant, num_pages=num_pages, max_seqs=max_seqs,
                                         pages_per_seq=pages_per_seq))
    self.on_stage = on_stage
    self.stats = dict(compile_s=0.0, prefill_s=0.0, decode_s=0.0, prompt_tokens=0,
                      decode_tokens=0, decode_steps=0, prefill_calls=0, cancelled=0)
    self._executables: dict[Any, Any] = {}
    self._slots: list[_Seq | None] = [None] * max_seqs
    self._kv_lens = np.zeros(max_seqs, np.int32)
    self._pending = np.zeros(max_seqs, np.int32)  # the token each running slot feeds next
    self._committed = 0  # pages promised to running requests (prompt + max_tokens each)
    self._waiting: collections.deque[tuple[int, Request]] = collections.deque()
    self._cancelled: set[int] = set()
    self._lock = threading.Lock()
    self._ids = itertools.count()
    self._steps = 0
    self._key_shape = jax.random.key_data(jax.random.key(0)).shape
    self.times: dict[int, dict[str, float]] = {}

  # ------------------------------------------------------------------------------ requests

  def check(self, request: Request) -> None:
    """ValueError if the request can never run here: ids outside [0, vocab_size), prompt +
    max_tokens beyond max_len, or more pages than the pool has."""
    ids = np.asarray(request.prompt_ids)
    bad = ids[(ids < 0) | (ids >= self.config.vocab_size)]
    if bad.size:
      raise ValueError(f"prompt token id {int(bad[0])} outside "
                       f"[0, vocab_size={self.config.vocab_size})")
    need = len(ids) + request.max_tokens
    if need > self.capacity:
      raise ValueError(f"prompt of {len(ids)} tokens + max_tokens {request.max_tokens} = {need} "
                       f"tokens exceeds the engine's max_len {self.capacity}")
    if self._pages_for(request) > self.allocator.num_pages - 1:
      raise ValueError(f"request needs {self._pages_for(request)} pages, the pool has "
                       f"{self.allocator.num_pages - 1}")

  def submit(self, request: Request) -> int:
    """Queues a request (validated, see check); returns its request id."""
    self.check(request)
    with self._lock:
      rid = next(self._ids)
      self._waiting.append((rid, request))
      self.times[rid] = dict(submitted=time.perf_counter())
    return rid

  def cancel(self, request_id: int) -> None:
    """Ends a waiting or running request at the next step (finish_reason "cancelled"); unknown or
    finished ids are ignored."""
    with self._lock:
      self._cancelled.add(request_id)

  @property
  def has_work(self) -> bool:
    with self._lock:
      return bool(self._waiting) or any(s is not None for s in self._slots)

  @property
  def num_running(self) -> int:
    return sum(s is not None for s in self._slots)

  @property
  def num_waiting(self) -> int:
    return len(self._waiting)

  def stream(self, requests: Iterable[Request] = ()) -> Iterator[Event]:
    """Submits `requests`, then steps until no request is waiting or running, yielding Events."""
    for r in requests:
      self.submit(r)
    while self.has_work:
      yield from self.step()

  def generate(self, requests: Sequence[Request]) -> list[Completion]:
    """Runs `requests` to the end; Completions in the order given."""
    rids = [self.submit(r) for r in requests]
    parts: dict[int, list[Event]] = {rid: [] for rid in rids}
    for ev in self.stream():
      parts.setdefault(ev.request_id, []).append(ev)
    return [self.completion(rid, req, parts[rid]) for rid, req in zip(rids, requests)]

  def completion(self, rid: int, req: Request, events: Sequence[Event]) -> Completion:
    """Assembles request `rid`'s Events (ending with its final one) into a Completion; takes its
    times out of self.times."""
    tok = [e for e in events if e.token_id is not None]
    return Completion(rid, req.prompt_ids, [e.token_id for e in tok],
                      "".join(e.text for e in events),
                      [e.logprob for e in tok], events[-1].finish_reason, self.times.pop(rid, {}))

  # ---------------------------------------------------------------------------------- step

  def step(self) -> list[Event]:
    """One scheduler iteration (module docstring); returns the Events it produced."""
    events = self._cancel()
    admitted = self._admit()
    if admitted:
      events += self._prefill(admitted)
    running = [s for s in self._slots if s is not None and s not in admitted]
    if running:
      events += self._decode(running)
    return events

  def _cancel(self) -> list[Event]:
    with self._lock:
      gone, self._cancelled = self._cancelled, set()
      kept = collections.deque((rid, r) for rid, r in self._waiting if rid not in gone)
      dropped = [rid for rid, _ in self._waiting if rid in gone]
      self._waiting = kept
    events = [Event(rid, None, "", True, "cancelled") for rid in dropped]
    for seq in self._slots:
      if seq is not None and seq.rid in gone:
        events.append(self._finish(seq, None, "cancelled", ""))
    self.stats["cancelled"] += len(events)
    return events

  def _pages_for(self, req: Request) -> int:
    a = self.allocator
    return paging.pages_needed(len(req.prompt_ids) + req.max_tokens, page_size=a.page_size,
                               num_sink_tokens=a.num_sink_tokens)

  def _admit(self) -> list[_Seq]:
    admitted = []
    with self._lock:
      while self._waiting and None in self._slots:
        rid, req = self._waiting[0]
        need = self._pages_for(req)
        if self._committed + need > self.allocator.num_pages - 1:
          break
        self._waiting.popleft()
        slot = self._slots.index(None)
        self.allocator.admit(slot, len(req.prompt_ids))
        self._committed += need
        seq = _Seq(rid, req, slot, np.asarray(jax.random.key_data(jax.random.key(req.seed))))
        self._slots[slot] = seq
        admitted.append(seq)
    return admitted

  def _sampling_arrays(self, rows: Sequence[_Seq | None], greedy=None):
    """(sampling arrays, one entry per row (None: an idle row), or None for a greedy step:
    nothing to transfer; greedy). greedy None: whether every temperature is 0."""
    r = len(rows)
    temp, top_k, top_p = np.zeros(r, np.float32), np.zeros(r, np.int32), np.ones(r, np.float32)
    counters = np.zeros(r, np.int32)
    keys = np.zeros((r,) + self._key_shape, np.uint32)
    for i, q in enumerate(rows):
      if q is not None:
        sm = q.req.sampling
        temp[i], top_k[i], top_p[i] = sm.temperature, sm.top_k, sm.top_p
        counters[i], keys[i] = len(q.tokens), q.key
    greedy = bool(np.all(temp == 0)) if greedy is None else greedy
    return None if greedy else dict(keys=keys, counters=counters, temperature=temp, top_k=top_k,
                                    top_p=top_p), greedy

  def _run(self, fn, args, what, **static):
    """Runs jitted `fn` through its ahead-of-time compiled executable."""
    return self._compiled(fn, args, what, **static)(*args)

  def _compiled(self, fn, args, what, **static):
    """The executable of jitted `fn` for these shapes and statics, compiled once (time -> stats)."""
    # tokens' shape and the Step's structure (its static mode and seal) pick the executable
    key = (fn, args[1].shape, jax.tree.structure(args[2]), tuple(sorted(static.items())))
    if key not in self._executables:
      self._stage("compiling", what=what)
      t0 = time.perf_counter()
      self._executables[key] = fn.lower(*args, graphdef=self.graphdef, **static).compile()
      dt = time.perf_counter() - t0
      self.stats["compile_s"] += dt
      self._stage("compiled", what=what, seconds=dt)
    return self._executables[key]

  def _stage(self, stage, **info):
    if self.on_stage is not None:
      self.on_stage(stage, info)

  def warmup(self, prompt_lengths: Iterable[int], *, greedy: bool = True) -> None:
    """Compiles ahead of time every step that requests with these prompt lengths can use (one
    prefill per length bucket; decode with and without block sealing), so that no compile falls
    inside the run. greedy: compile the greedy variants (all temperatures 0) or the sampling
    ones."""
    s, r, pages = self.max_seqs, self.prefill_rows, self.allocator.page_indices
    zeros = np.zeros(s, np.int32)
    samp, _ = self._sampling_arrays([None] * r, greedy)
    for bucket in sorted({length_bucket(int(n)) for n in prompt_lengths}):
      self._compiled(_prefill, (self.state, np.zeros((r, bucket), np.int32),
                                np.arange(r, dtype=np.int32),
                                Step.prefill(pages[:r], zeros[:r], _round_key(0)), self.cache, samp),
                     f"prefill, {bucket}-token bucket", greedy=greedy)
    samp, _ = self._sampling_arrays([None] * s, greedy)
    for seal in ("never", "always") if self.quant.kv_format == "hack" else ("never",):
      self._compiled(_decode, (self.state, zeros, Step.decode(pages, zeros, np.zeros(s, bool), _round_key(0), seal),
                               self.cache, samp), "decode step", greedy=greedy)

  def _round_key(self) -> jax.Array:
    self._steps += 1
    return _round_key(self._steps)

  def _prefill(self, seqs: list[_Seq]) -> list[Event]:
    """Prefills the admitted seqs, prefill_rows at a time (idle rows padded with other slots,
    written 0 tokens); returns their first-token Events."""
    tokens_in = sum(len(q.req.prompt_ids) for q in seqs)
    self._stage("prefilling", requests=len(seqs), tokens=tokens_in)
    r, events, seconds = self.prefill_rows, [], 0.0
    for lo in range(0, len(seqs), r):
      chunk = seqs[lo:lo + r]
      taken = {q.slot for q in chunk}
      idle = [i for i in range(self.max_seqs) if i not in taken]
      rows = [q.slot for q in chunk] + idle[:r - len(chunk)]
      lengths = np.zeros(r, np.int32)
      lengths[:len(chunk)] = [len(q.req.prompt_ids) for q in chunk]
      bucket = length_bucket(int(lengths.max()))
      tokens = np.zeros((r, bucket), np.int32)
      for i, q in enumerate(chunk):
        tokens[i, :lengths[i]] = q.req.prompt_ids
      rows = np.asarray(rows, np.int32)
      kv_lens = np.where(lengths > 0, lengths, self._kv_lens[rows]).astype(np.int32)
      samp, greedy = self._sampling_arrays(chunk + [None] * (r - len(chunk)))
      compile0, t0 = self.stats["compile_s"], time.perf_counter()
      step = Step.prefill(self.allocator.page_indices[rows], lengths, self._round_key())
      self.cache, tok, logp = self._run(_prefill, (self.state, tokens, rows, step, self.cache, samp),
                                        f"prefill, {bucket}-token bucket", greedy=greedy)
      tok, logp = np.asarray(tok), np.asarray(logp)
      seconds += time.perf_counter() - t0 - (self.stats["compile_s"] - compile0)
      self._kv_lens[rows] = kv_lens
      self.stats["prefill_calls"] += 1
      for i, q in enumerate(chunk):
        events += self._on_token(q, int(tok[i]), float(logp[i]))
    self.stats["prefill_s"] += seconds
    self.stats["prompt_tokens"] += tokens_in
    self._stage("prefilled", requests=len(seqs), tokens=tokens_in, seconds=seconds)
    return events

  def _decode(self, seqs: list[_Seq]) -> list[Event]:
    active = np.zeros(self.max_seqs, bool)
    for q in seqs:
      active[q.slot] = True
      self.allocator.reserve(q.slot, int(self._kv_lens[q.slot]) + 1)
    rows: list[_Seq | None] = [None] * self.max_seqs
    for q in seqs:
      rows[q.slot] = q
    samp, greedy = self._sampling_arrays(rows)
    kv_lens = self._kv_lens + active
    seal = "always" if kv_cache.seals_block(self.quant, kv_lens, active) else "never"
    compile0, t0 = self.stats["compile_s"], time.perf_counter()
    step = Step.decode(self.allocator.page_indices, kv_lens, active, self._round_key(), seal)
    self.cache, tok, logp = self._run(_decode, (self.state, self._pending.copy(), step, self.cache,
                                                samp), "decode step", greedy=greedy)
    tok, logp = np.asarray(tok), np.asarray(logp)
    self.stats["decode_s"] += time.perf_counter() - t0 - (self.stats["compile_s"] - compile0)
    self.stats["decode_tokens"] += len(seqs)
    self.stats["decode_steps"] += 1
    self._kv_lens = kv_lens
    return [ev for q in seqs for ev in self._on_token(q, int(tok[q.slot]), float(logp[q.slot]))]

  # ------------------------------------------------------------------------------ output

  def _on_token(self, seq: _Seq, token: int, logprob: float) -> list[Event]:
    req = seq.req
    if token in req.stop_ids or (not req.ignore_eos and token in self.tokenizer.stop_ids):
      return [self._finish(seq, None, "stop", self._decoded(seq, final=True)[seq.sent:])]
    seq.tokens.append(token)
    self.times.setdefault(seq.rid, {}).setdefault("first_token", time.perf_counter())
    last = len(seq.tokens) == req.max_tokens
    text = self._decoded(seq, final=last)
    found = (text.find(s, max(0, seq.sent - len(s) + 1)) for s in req.stop)
    cut = min((i for i in found if i >= 0), default=-1)
    if cut >= 0:
      return [self._finish(seq, token, "stop", text[seq.sent:max(cut, seq.sent)], logprob)]
    if last:
      return [self._finish(seq, token, "length", text[seq.sent:], logprob)]
    # hold back the longest tail that may still grow into a stop string
    safe = len(text) - max((k for s in req.stop for k in range(1, min(len(s) - 1, len(text)) + 1)
                            if text.endswith(s[:k])), default=0)
    delta = text[seq.sent:max(safe, seq.sent)]
    seq.sent += len(delta)
    self._pending[seq.slot] = token
    return [Event(seq.rid, token, delta, False, None, logprob)]

  def _decoded(self, seq: _Seq, *, final: bool = False) -> str:
    """seq.text grown by the newly decoded characters. Incremental detokenization (as in TGI):
    only the tokens since seq.prefix are decoded, and new text is taken only once it does not end
    in U+FFFD (an incomplete UTF-8 character), unless final (then all that remains)."""
    decode = self.tokenizer.decode
    before = decode(seq.tokens[seq.prefix:seq.read])
    now = decode(seq.tokens[seq.prefix:])
    if len(now) > len(before) and (final or not now.endswith("\ufffd")):
      seq.text += now[len(before):]
      seq.prefix, seq.read = seq.read, len(seq.tokens)
    return seq.text

  def _finish(self, seq, token, reason, delta, logprob=None) -> Event:
    self.allocator.release(seq.slot)
    self._committed -= self._pages_for(seq.req)
    self._slots[seq.slot] = None
    self._kv_lens[seq.slot] = 0
    self.times.setdefault(seq.rid, {})["finished"] = time.perf_counter()
    return Event(seq.rid, token, delta, True, reason, logprob)

  # ------------------------------------------- hand-off between engines (models/disagg.py)

  def hand_off(self, request_id: int) -> tuple[bytes, list[int]]:
    """Exports running request `request_id` right after the step that prefilled it (its first
    token is in that step's Events) as a hack_jax.handoff payload of its prompt's cache, then
    removes it from this engine (pages freed, no final Event). Returns (payload, the live page
    ids it had here). Raises ValueError if the request is not running or has decoded already."""
    seq = next((s for s in self._slots if s is not None and s.rid == request_id), None)
    if seq is None or len(seq.tokens) != 1:
      raise ValueError(f"request {request_id} is not running right after its prefill")
    kv_len, table = int(self._kv_lens[seq.slot]), self.allocator.page_indices
    payload = handoff.export_sequence(self.cache, slot=seq.slot, page_indices=table, kv_len=kv_len)
    self._finish(seq, None, "handed off", "")
    self.times.pop(seq.rid, None)
    return payload, self._live_pages(table, seq.slot, kv_len)

  def adopt(self, request: Request, payload: bytes, first_token: int,
            first_logprob: float) -> tuple[int, list[Event], list[int]]:
    """Admits a request prefilled by another engine (its `hand_off` payload and first token):
    the cache is imported into a free slot at the pages this engine's allocator assigns, and
    decoding continues from it as if it had been prefilled here. Returns (request id, the first
    token's Events, the live page ids). Raises ValueError, leaving the engine as it was, for a
    payload that is damaged or does not fit this cache (hack_jax.handoff), a cache length other
    than the prompt's, a first token outside the vocabulary, or no free slot / pages now."""
    self.check(request)
    kv_len = handoff.read_header(payload).kv_len
    if kv_len != len(request.prompt_ids):
      raise ValueError(f"hand-off holds {kv_len} tokens, the request's prompt {len(request.prompt_ids)}")
    if not 0 <= paging.require_int("first_token", first_token) < self.config.vocab_size:
      raise ValueError(f"first_token {first_token} outside [0, vocab_size={self.config.vocab_size})")
    with self._lock:
      need = self._pages_for(request)
      if None not in self._slots or self._committed + need > self.allocator.num_pages - 1:
        raise ValueError(f"no free slot or pages for the hand-off: {self.num_running} running, "
                         f"{self._committed} of {self.allocator.num_pages - 1} pages committed, needs {need}")
      slot = self._slots.index(None)
      self.allocator.admit(slot, kv_len)
      try:
        self.cache = self._placed(handoff.import_sequence(self.cache, payload, slot=slot,
                                                          page_indices=self.allocator.page_indices))
      except ValueError:
        self.allocator.release(slot)
        raise
      rid = next(self._ids)
      self.times[rid] = dict(submitted=time.perf_counter())
      seq = _Seq(rid, request, slot, np.asarray(jax.random.key_data(jax.random.key(request.seed))))
      self._slots[slot], self._kv_lens[slot] = seq, kv_len
      self._committed += need
    pages = self._live_pages(self.allocator.page_indices, slot, kv_len)
    return rid, self._on_token(seq, int(first_token), float(first_logprob)), pages

  def _placed(self, cache):
    """The cache sharded over the mesh (as the compiled steps expect it), or as it is."""
    return cache if self.mesh is None else sharding.shard_cache(cache, self.mesh)

  def _live_pages(self, table, slot, kv_len) -> list[int]:
    a = self.allocator
    n = paging.pages_needed(kv_len, page_size=a.page_size, num_sink_tokens=a.num_sink_tokens)
    return [int(p) for p in table[slot, :n]]
