"""Continuous batching on the hack_jax paged KV cache: requests join and leave between decode steps.

An Engine owns one fixed-shape cache (max_seqs slots x max_len tokens) and a host PageAllocator.
Each `step()`:
  1. finishes cancelled requests (their pages go back to the pool);
  2. admits waiting requests (first come, first served) into free slots while the pool can hold
     their prompt + max_tokens;
  3. advances every prefilling request by one chunk: its whole prompt, or with prefill_chunk C
     its next C tokens (a long prompt is prefilled over several steps, interleaved with the
     decode steps of the others), prefill_rows prompts per call: tokens [R, T] with T the length
     bucket (stepper.length_bucket) capped at C for a first chunk, C for a later one, written into
     those R slots of the cache (the call sees only their open blocks, sinks and table rows, plus
     the shared page pool), so a prefill costs R prompts, not max_seqs, and running sequences
     keep their cache; a request whose prompt is now cached gets its first token;
  4. runs one decode step for every request that was decoding (one token each, all max_seqs rows).
Shapes never depend on which slots are busy, so the compiled steps are reused: one prefill
executable per (length bucket <= C, greedy), one chunk executable per greedy, and for decode one
per (seal, sinks, greedy) triple (kv_cache.seals_block; sinks: kv_cache.writes_sink, True only while a
request shorter than num_sink_tokens decodes; greedy = every request of the step has temperature
0). Nothing recompiles when a request is admitted. The steps are models/stepper.py's, shared with
the fixed-batch Generator.

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
import itertools
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from hack_jax import handoff, kv_cache, paging
from hack_jax.config import QuantConfig
from hack_jax.kv_cache import mixed
from hack_jax.layer_formats import LayerFormats, with_layer_formats
from hack_jax.step import Step
from models.generate import Sampling
from models.llama import Llama
from models.stepper import (RowSampleHead, Stepper, chunk_length, decode_record,  # noqa: F401
                            sample_rows)
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
  done: int = 0  # prompt tokens in the cache (prefilling while < len(req.prompt_ids))
  tokens: list[int] = dataclasses.field(default_factory=list)
  text: str = ""  # decoded so far (complete characters)
  prefix: int = 0  # incremental detokenization window: tokens[prefix:read] decoded last time
  read: int = 0
  sent: int = 0  # characters of text already emitted


def _round_key(count):  # stochastic rounding of the cache (QuantConfig.rounding): a key per step
  return jax.random.fold_in(jax.random.key(0), count)


class Engine:
  """Continuous-batching driver for one model and one cache format (module docstring).

  Args:
    model: a Llama. tokenizer: its Tokenizer. quant: the cache format.
    layer_formats: None, or per-layer formats over `quant` (hack_jax.layer_formats: a spec such as
      "first2,last2:int8" or a LayerFormats), e.g. the first and last layers in int8.
    max_seqs: slots (requests decoded together). max_len: tokens per request (prompt + generated),
      at most the model's context length.
    num_pages: page pool incl. the null page; None = room for every slot at max_len. With fewer,
      a request waits until the pool can hold its prompt + max_tokens (no preemption).
    prefill_rows: prompts per prefill call (R): a call computes R rows, not max_seqs, so admitting
      one request costs one prompt's prefill; more requests admitted at once take several calls.
    prefill_chunk: None = a prompt is prefilled in one call (padded to its length bucket); an int
      C = at most C tokens of a prompt per step: a longer prompt is prefilled over several steps,
      C tokens each (each chunk attends to its cached prefix and to itself, hack_jax.prefill),
      interleaved with the decode steps of the running requests, so a long prompt neither stalls
      them for its whole prefill nor needs a compile beyond the C-token chunk step. A multiple of
      64 (the hack block) is cheapest.
    attention: the attention backend the steps run (None = model.config.attention).
    on_stage: optional callback(stage, info dict), e.g. for a progress display: "compiling"
      (what) and "compiled" (what, seconds) around each compile; "prefilling" (requests, tokens)
      and "prefilled" (requests, tokens, seconds incl. the first tokens, compile excluded) around
      the prefill work of each step (with prefill_chunk: this step's chunks).
    mesh: None (the model's, for a models.sharding.shard_model model, else one device) or a 1-D
      "tp" mesh: tensor parallelism over kv heads (models/sharding.py), weights and cache sharded.
  Thread safety: submit() and cancel() may be called from any thread; step() / stream() from one.
  Raises ValueError for bad sizes, or num_kv_heads / hidden_dim not divisible by the mesh's size.
  """

  def __init__(self, model: Llama, tokenizer: Tokenizer, quant: QuantConfig = QuantConfig(), *,
               max_seqs: int = 8, max_len: int = 2048, num_pages: int | None = None,
               prefill_rows: int = 1, prefill_chunk: int | None = None, attention: Any = None,
               on_stage: Callable[[str, dict], None] | None = None, mesh: Mesh | None = None,
               layer_formats: str | LayerFormats | None = None):
    c = model.config
    quant = with_layer_formats(quant, layer_formats)
    if max_seqs < 1 or not 2 <= max_len <= c.max_seq_len or not 1 <= prefill_rows <= max_seqs:
      raise ValueError(f"need max_seqs >= 1, 2 <= max_len <= context length {c.max_seq_len} and "
                       f"1 <= prefill_rows <= max_seqs: {max_seqs=} {max_len=} {prefill_rows=}")
    if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(
        prefill_chunk, (int, np.integer)) or prefill_chunk < 1):
      raise ValueError(f"prefill_chunk must be None or an int >= 1: {prefill_chunk=}")
    self.prefill_rows, self.prefill_chunk = prefill_rows, prefill_chunk
    self.config, self.quant, self.tokenizer = c, quant, tokenizer
    self.max_seqs, self.capacity = max_seqs, max_len
    self.stepper = Stepper(model, quant, max_seqs=max_seqs, max_len=max_len, num_pages=num_pages,
                           attention=attention, mesh=mesh, on_stage=on_stage)
    self.mesh = self.stepper.mesh
    self.allocator = self.stepper.new_allocator()
    self.cache = self.stepper.new_cache()
    self.on_stage = on_stage
    self.stats = dict(compile_s=0.0, prefill_s=0.0, decode_s=0.0, prompt_tokens=0,
                      decode_tokens=0, decode_steps=0, prefill_calls=0, cancelled=0)
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
    self._admit()
    seqs = sorted((s for s in self._slots if s is not None), key=lambda s: s.rid)
    decoding = [s for s in seqs if s.done == len(s.req.prompt_ids)]
    prefilling = [s for s in seqs if s.done < len(s.req.prompt_ids)]
    if prefilling:
      events += self._prefill(prefilling)
    if decoding:
      events += self._decode(decoding)
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

  def _run(self, tokens, step, samp, greedy, rows, what):
    """One step through the stepper (the cache donated and replaced) -> (tokens, log-probs) on
    the host; the seconds it took, compile excluded, are returned too."""
    compile0, t0 = self.stepper.compile_s, time.perf_counter()
    self.cache, tok, logp = self.stepper(tokens, step, self.cache, RowSampleHead(greedy), samp,
                                         rows, what=what)
    tok, logp = np.asarray(tok), np.asarray(logp)
    self.stats["compile_s"] = self.stepper.compile_s
    return tok, logp, time.perf_counter() - t0 - (self.stepper.compile_s - compile0)

  def warmup(self, prompt_lengths: Iterable[int], *, greedy: bool = True) -> None:
    """Compiles ahead of time every step that requests with these prompt lengths can use (one
    prefill per length bucket up to prefill_chunk, the chunk step if a prompt is longer; decode
    with and without block sealing, and with the sink writes only if a prompt is shorter than the
    sinks), so that no compile falls inside the run; they compile in
    parallel (Stepper.compile_many). greedy: compile the greedy variants (all temperatures 0) or
    the sampling ones."""
    s, r, pages = self.max_seqs, self.prefill_rows, self.allocator.page_indices
    zeros, rows, head = np.zeros(s, np.int32), np.arange(r, dtype=np.int32), RowSampleHead(greedy)
    state, calls = self.stepper.state, []
    samp, _ = self._sampling_arrays([None] * r, greedy)
    lengths, chunk = [int(n) for n in prompt_lengths], self.prefill_chunk
    for t in sorted({chunk_length(n, chunk) for n in lengths}):
      step = Step.prefill(pages[:r], zeros[:r], _round_key(0))
      calls.append(((state, np.zeros((r, t), np.int32), step, self.cache, rows, samp), head,
                    f"prefill, {t}-token bucket"))
    if chunk is not None and any(n > chunk for n in lengths):
      step = Step.chunk(pages[:r], zeros[:r], zeros[:r], _round_key(0))
      calls.append(((state, np.zeros((r, chunk), np.int32), step, self.cache, rows, samp), head,
                    f"prefill, {chunk}-token chunk"))
    samp, _ = self._sampling_arrays([None] * s, greedy)
    blocked = any(c.kv_format == "hack" for c in mixed.formats_of(self.quant))
    seals = (("after",) if self.stepper.deferred_seal else ("never", "always")) if blocked else ("never",)
    # a prompt shorter than the sinks: its first decode step writes one (per-layer formats: some layer's)
    short = any(kv_cache.writes_sink(self.quant, np.array([n + 1]), np.array([True])) for n in lengths)
    for seal, sinks in itertools.product(seals, (False, True) if short else (False,)):
      step = Step.decode(pages, zeros, np.zeros(s, bool), _round_key(0), seal, sinks)
      calls.append(((state, zeros, step, self.cache, None, samp), head,
                    f"decode step ({seal} seals{', sinks' if sinks else ''})"))
    self.stepper.compile_many(calls)
    self.stats["compile_s"] = self.stepper.compile_s

  def _stage(self, stage, **info):
    if self.on_stage is not None:
      self.on_stage(stage, info)

  def _round_key(self) -> jax.Array:
    self._steps += 1
    return _round_key(self._steps)

  def _prefill(self, seqs: list[_Seq]) -> list[Event]:
    """Advances each prefilling seq by one chunk (all of its prompt without prefill_chunk), in
    calls of prefill_rows seqs of one kind: continuing ones (chunk steps) first, then fresh ones
    (prefill steps); returns the first-token Events of the seqs whose prompt is now cached."""
    chunk = self.prefill_chunk or max(len(q.req.prompt_ids) for q in seqs)
    tokens_in = sum(min(len(q.req.prompt_ids) - q.done, chunk) for q in seqs)
    self._stage("prefilling", requests=len(seqs), tokens=tokens_in)
    r, events, seconds = self.prefill_rows, [], 0.0
    for group in ([q for q in seqs if q.done > 0], [q for q in seqs if q.done == 0]):
      for lo in range(0, len(group), r):
        got, dt = self._prefill_call(group[lo:lo + r])
        events, seconds = events + got, seconds + dt
    self.stats["prefill_s"] += seconds
    self.stats["prompt_tokens"] += tokens_in
    self._stage("prefilled", requests=len(seqs), tokens=tokens_in, seconds=seconds)
    return events

  def _prefill_call(self, part: list[_Seq]) -> tuple[list[Event], float]:
    """One prefill (all part fresh) or chunk (all part continuing) call over prefill_rows rows:
    part's slots, then idle rows padded with other slots (written 0 tokens)."""
    r, n, fresh = self.prefill_rows, len(part), part[0].done == 0
    remaining = [len(q.req.prompt_ids) - q.done for q in part]
    t = chunk_length(max(remaining), self.prefill_chunk) if fresh else self.prefill_chunk
    taken = {q.slot for q in part}
    rows = np.asarray([q.slot for q in part] + [i for i in range(self.max_seqs)
                                                if i not in taken][:r - n], np.int32)
    lengths, start = np.zeros(r, np.int32), self._kv_lens[rows].copy()
    tokens = np.zeros((r, t), np.int32)
    for i, q in enumerate(part):
      lengths[i], start[i] = min(remaining[i], t), q.done
      tokens[i, :lengths[i]] = q.req.prompt_ids[q.done:q.done + lengths[i]]
    samp, greedy = self._sampling_arrays(part + [None] * (r - n))
    table = self.allocator.page_indices[rows]
    step = (Step.prefill(table, lengths, self._round_key()) if fresh
            else Step.chunk(table, start, lengths, self._round_key()))
    what = f"prefill, {t}-token bucket" if fresh else f"prefill, {t}-token chunk"
    tok, logp, seconds = self._run(tokens, step, samp, greedy, rows, what)
    self.stats["prefill_calls"] += 1
    events = []
    for i, q in enumerate(part):
      q.done += int(lengths[i])
      self._kv_lens[q.slot] = q.done
      if q.done == len(q.req.prompt_ids):
        events += self._on_token(q, int(tok[i]), float(logp[i]))
    return events, seconds

  def _decode(self, seqs: list[_Seq]) -> list[Event]:
    active = np.zeros(self.max_seqs, bool)
    rows: list[_Seq | None] = [None] * self.max_seqs
    for q in seqs:
      active[q.slot], rows[q.slot] = True, q
    samp, greedy = self._sampling_arrays(rows)
    kv_lens = self._kv_lens + active
    step = decode_record(self.allocator, self.quant, kv_lens, active, self._round_key(),
                         deferred=self.stepper.deferred_seal)
    tok, logp, seconds = self._run(self._pending.copy(), step, samp, greedy, None, "decode step")
    self.stats["decode_s"] += seconds
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

  def hand_off(self, request_id: int):
    """Exports running request `request_id` right after the step that prefilled it (its first
    token is in that step's Events) as a hack_jax.handoff payload of its prompt's cache, then
    removes it from this engine (pages freed, no final Event). Returns (payload, a bytes-like
    buffer; the live page ids it had here). Raises ValueError if the request is not running or has decoded already."""
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
    kv_len = handoff.read_header(payload, check_digest=False).kv_len  # import_sequence checks it
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
        self.cache = self.stepper.placed(handoff.import_sequence(
            self.cache, payload, slot=slot, page_indices=self.allocator.page_indices, donate=True))
      except ValueError:
        self.allocator.release(slot)
        raise
      rid = next(self._ids)
      self.times[rid] = dict(submitted=time.perf_counter())
      seq = _Seq(rid, request, slot, np.asarray(jax.random.key_data(jax.random.key(request.seed))))
      seq.done = kv_len
      self._slots[slot], self._kv_lens[slot] = seq, kv_len
      self._committed += need
    pages = self._live_pages(self.allocator.page_indices, slot, kv_len)
    return rid, self._on_token(seq, int(first_token), float(first_logprob)), pages

  def _live_pages(self, table, slot, kv_len) -> list[int]:
    a = self.allocator
    n = paging.pages_needed(kv_len, page_size=a.page_size, num_sink_tokens=a.num_sink_tokens)
    return [int(p) for p in table[slot, :n]]
