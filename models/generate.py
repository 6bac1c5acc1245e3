"""Batched generation and perplexity on the hack_jax paged KV cache.

One Generator owns a fixed-shape cache (max_seqs slots x capacity tokens), so its compiled steps
never change shape:
  prefill: a ragged batch, every prompt right-padded to one length bucket (stepper.length_bucket),
    or cut into chunks of prefill_chunk tokens, written into the cache and attended through
    hack_jax.prefill; returns the first sampled token.
  decode: one token per active slot; the cache is donated (updated in place).
Between steps the host PageAllocator reserves the page the next token needs, and the host builds
the step's record (hack_jax.step.Step: page table, kv_lens after the step, active slots, key), the
one place the lengths live; the only per-step device-to-host transfer is the i32[max_seqs] of
sampled tokens (needed for the stop test). The steps themselves (one jitted forward step, compiled
ahead of time so the reported tokens/s exclude compilation, reported separately as compile_s) are
models/stepper.py's, shared with the continuous-batching Engine (models/engine.py).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from tqdm import tqdm

from hack_jax import kv_cache
from hack_jax.config import QuantConfig
from hack_jax.layer_formats import LayerFormats, with_layer_formats
from hack_jax.step import Step
from models.llama import Llama
from models.stepper import (MIN_BUCKET, SampleHead, ScoreHead, Stepper, chunk_length,  # noqa: F401
                            decode_record, length_bucket, sample)
from models.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class Sampling:
  """temperature 0 = greedy (argmax); top_k 0 = off; top_p 1 = off (nucleus sampling otherwise).

  Raises ValueError for temperature < 0, top_k < 0, top_p outside (0, 1], or a non-finite value;
  TypeError for a value of the wrong type (top_k an int, temperature and top_p numbers).
  """
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    ints, numbers = (int, np.integer), (int, float, np.integer, np.floating)
    for name, kinds in (("temperature", numbers), ("top_k", ints), ("top_p", numbers)):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, kinds):
        raise TypeError(f"{name} must be {'an int' if kinds is ints else 'a number'}, got {value!r}")
      if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0 (0 = greedy): {self.temperature=}")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0 (0 = off): {self.top_k=}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1] (1 = off): {self.top_p=}")


def encode_prompt(tokenizer: Tokenizer, prompt: str, *, chat: bool | None = None) -> list[int]:
  """Prompt text -> ids, through the chat template when chat (None: when the model has one).

  Raises ValueError for an empty (or whitespace-only) prompt."""
  if not prompt.strip():
    raise ValueError(f"empty prompt: {prompt=}")
  if tokenizer.chat_template is not None if chat is None else chat:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
  return tokenizer.encode(prompt)


@dataclasses.dataclass
class GenerationResult:
  """Per prompt: texts (decoded continuations) and tokens (their ids, stop token excluded). With
  forced tokens: predictions (the model's sampled token at each step) and forced_logprobs
  (log p of each forced token given everything before it, natural log), else empty lists.
  stats: token counts (prompt_tokens; generated_tokens; decode_tokens, those sampled by decode
  steps, all sequences together), seconds (prefill_s incl. the first token, decode_s, compile_s,
  excluded from the others), prefill_tok_s, decode_tok_s, max_len (longest cached sequence) and
  cache_bytes (kv_cache.cache_bytes_report for max_len tokens per sequence)."""
  texts: list[str]
  tokens: list[list[int]]
  predictions: list[list[int]]
  forced_logprobs: list[list[float]]
  stats: dict[str, Any]


class Generator:
  """Prefill/decode driver for one model and one cache format.

  Args:
    model: a Llama. tokenizer: its Tokenizer. quant: the cache format (QuantConfig.kv_format
      picks "hack" | "bf16" | "int8" | "float32").
    layer_formats: None, or per-layer formats over `quant` (hack_jax.layer_formats: a spec such as
      "first2,last2:int8" or "0,-1:bf16", or a LayerFormats): those layers cached in that format.
    max_seqs: cache slots = prompts per batch (longer prompt lists are run in chunks).
    max_len: tokens per sequence (prompt + generated): the capacity enforced is min(max_len, the
      model's context length), and the cache's pages are allocated for that capacity (whole pages).
    prefill_chunk: None = one prefill step per batch, prompts padded to a length bucket; an int
      C = prompts longer than C are prefilled C tokens per step (one compiled step serves every
      chunk: each chunk attends to the cached prefix and to itself, hack_jax.prefill), shorter
      ones in one step of min(bucket, C) tokens. A multiple of 64 (the hack block) is cheapest.
    attention: the attention backend the steps run (None = model.config.attention): a
      hack_jax.backend.Backend or a hashable object with its prefill / decode methods
      (models/eval.py's evaluation variants).
    mesh: None (the model's, for a sharding.shard_model model, else one device) or a 1-D "tp" mesh (models.sharding.make_mesh(tp)): tensor
      parallelism over kv heads. The weights and the cache are placed sharded (models/sharding.py)
      and the backend runs per shard (sharding.ShardedBackend); the same compiled steps, one per
      step kind.

  Raises:
    ValueError: bad sizes (from here or QuantConfig / kv_cache); num_kv_heads or hidden_dim not
      divisible by the mesh's size.
  """

  def __init__(self, model: Llama, tokenizer: Tokenizer, quant: QuantConfig = QuantConfig(), *,
               max_seqs: int = 4, max_len: int = 2048, prefill_chunk: int | None = None,
               attention: Any = None, mesh: Mesh | None = None,
               layer_formats: str | LayerFormats | None = None):
    quant = with_layer_formats(quant, layer_formats)
    for name, value in (("max_seqs", max_seqs), ("max_len", max_len)):
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if max_seqs < 1 or max_len < 2:
      raise ValueError(f"need max_seqs >= 1 and max_len >= 2 (tokens per sequence: prompt + "
                       f"generated): {max_seqs=} {max_len=}")
    if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(
        prefill_chunk, (int, np.integer)) or prefill_chunk < 1):
      raise ValueError(f"prefill_chunk must be None or an int >= 1: {prefill_chunk=}")
    self.prefill_chunk = prefill_chunk
    c = model.config
    self.config, self.quant, self.tokenizer, self.max_seqs = c, quant, tokenizer, max_seqs
    self.capacity = min(max_len, c.max_seq_len)  # pages for what can be held, not for max_len
    self.stepper = Stepper(model, quant, max_seqs=max_seqs, max_len=self.capacity, attention=attention,
                           mesh=mesh)
    self.attention, self.mesh = self.stepper.attention, self.stepper.mesh
    self.graphdef, self.state = self.stepper.graphdef, self.stepper.state

  @property
  def pages_per_seq(self) -> int:
    """Pages each slot's table holds (for `capacity` tokens)."""
    return self.stepper.pages_per_seq

  @property
  def num_pages(self) -> int:
    """Pages of the cache, the null page included."""
    return self.stepper.num_pages

  # --------------------------------------------------------------------------------------- setup

  def new_cache(self) -> kv_cache.KVCache:
    return self.stepper.new_cache()

  def _run(self, tokens, step, cache, head, head_args, stats):
    """One forward step through the stepper's compiled executables (compile time -> stats)."""
    compile0 = self.stepper.compile_s
    out = self.stepper(tokens, step, cache, head, head_args)
    stats["compile_s"] += self.stepper.compile_s - compile0
    return out

  # ------------------------------------------------------------------------------------ generate

  def generate(self, prompts: Sequence[str], max_new_tokens: int, sampling: Sampling = Sampling(),
               *, chat: bool | None = None, seed: int = 0, stop_on_eos: bool = True,
               progress: bool = False) -> GenerationResult:
    """Generates up to max_new_tokens for each prompt (texts; see generate_ids)."""
    ids = [encode_prompt(self.tokenizer, p, chat=chat) for p in prompts]
    return self.generate_ids(ids, max_new_tokens, sampling, seed=seed, stop_on_eos=stop_on_eos,
                             progress=progress)

  def _check_ids(self, ids, what: str) -> None:
    """TypeError for non-integer token ids, ValueError naming the first id outside [0, vocab_size)
    (an embedding lookup would clamp it silently; a log-prob of it would be NaN)."""
    a = np.asarray(ids)
    if a.size and not np.issubdtype(a.dtype, np.integer):
      raise TypeError(f"{what}: token ids must be integers, got dtype {a.dtype}")
    bad = np.argwhere((a < 0) | (a >= self.config.vocab_size))
    if bad.size:
      where = tuple(bad[0].tolist())
      raise ValueError(f"{what}: token id {a[where]} at {list(where)} outside [0, vocab_size="
                       f"{self.config.vocab_size})")

  def generate_ids(self, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int,
                   sampling: Sampling = Sampling(), *, seed: int = 0, stop_on_eos: bool = True,
                   forced: np.ndarray | None = None, progress: bool = False) -> GenerationResult:
    """Generates from token-id prompts of different lengths, max_seqs of them per batch.

    Args:
      prompt_ids: one list of ids per prompt (non-empty).
      max_new_tokens: tokens to generate per prompt (>= 1); a sequence stops early at a stop id
        (tokenizer.stop_ids) when stop_on_eos.
      forced: optional i32[len(prompts), max_new_tokens]: teacher forcing. Step i feeds forced[:, i]
        instead of the sampled token (no early stop); the sampled tokens are the predictions.
      progress: tqdm bar on stderr.
    Returns GenerationResult.
    Raises ValueError: no prompts, an empty prompt, max_new_tokens < 1, prompt + max_new_tokens beyond
      the cache capacity, a forced array of the wrong shape, token ids outside [0, vocab_size);
      TypeError: a non-int max_new_tokens or non-integer ids.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)):
      raise TypeError(f"max_new_tokens must be an int, got {max_new_tokens!r}")
    if max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1: {max_new_tokens=}")
    if len(prompt_ids) == 0:
      raise ValueError("no prompts: prompt_ids is empty")
    for i, p in enumerate(prompt_ids):
      if len(p) == 0:
        raise ValueError(f"empty prompt (no tokens) at index {i}")
      self._check_ids(p, f"prompt {i}")
      if len(p) + max_new_tokens > self.capacity:
        raise ValueError(f"prompt {i} has {len(p)} tokens; with {max_new_tokens=} it needs "
                         f"{len(p) + max_new_tokens} > cache capacity {self.capacity}")
    if forced is not None:
      forced = np.asarray(forced)
      if forced.shape != (len(prompt_ids), max_new_tokens):
        raise ValueError(f"forced must be [{len(prompt_ids)}, {max_new_tokens}]: {forced.shape=}")
      self._check_ids(forced, "forced")  # before the cast: 1.5 must not run as 1
      forced = forced.astype(np.int32)
    stats = dict(prompt_tokens=0, generated_tokens=0, decode_tokens=0, prefill_s=0.0, decode_s=0.0,
                 compile_s=0.0, max_len=0)
    key = jax.random.key(seed)
    tokens, preds, logps = [], [], []
    bar = tqdm(total=len(prompt_ids) * max_new_tokens, file=sys.stderr, disable=not progress,
               desc="generating", unit="tok")
    for lo in range(0, len(prompt_ids), self.max_seqs):
      chunk = prompt_ids[lo:lo + self.max_seqs]
      key, sub = jax.random.split(key)
      out, pred, logp = self._generate_batch(
          chunk, max_new_tokens, sampling, sub, stop_on_eos and forced is None,
          None if forced is None else forced[lo:lo + self.max_seqs], stats, bar)
      tokens, preds, logps = tokens + out, preds + pred, logps + logp
    bar.close()
    stats["prefill_tok_s"] = stats["prompt_tokens"] / max(stats["prefill_s"], 1e-9)
    stats["decode_tok_s"] = stats["decode_tokens"] / max(stats["decode_s"], 1e-9)
    c = self.config
    stats["cache_bytes"] = kv_cache.cache_bytes_report(
        self.quant, num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
        seq_len=stats["max_len"], max_seqs=min(len(prompt_ids), self.max_seqs))
    texts = [self.tokenizer.decode(t) for t in tokens]
    if forced is None:
      preds, logps = [], []
    return GenerationResult(texts=texts, tokens=tokens, predictions=preds,
                            forced_logprobs=logps, stats=stats)

  def _generate_batch(self, prompts, max_new, sampling, key, stop_on_eos, forced, stats, bar):
    """One chunk of <= max_seqs prompts: prefill, then decode until max_new tokens or all stop.
    Returns (tokens, predictions, forced log-probs) per prompt."""
    n, s = len(prompts), self.max_seqs
    lengths = np.zeros(s, np.int32)
    lengths[:n] = [len(p) for p in prompts]
    tokens = np.zeros((s, int(lengths.max())), np.int32)
    for i, p in enumerate(prompts):
      tokens[i, :len(p)] = p
    targets = np.zeros((s, max_new), np.int32)
    if forced is not None:
      targets[:n] = forced
    alloc = self.stepper.new_allocator()
    for i in range(n):
      alloc.admit(i, int(lengths[i]))
    keys = jax.random.split(key, max_new)
    cache = self.new_cache()

    t0, compile0 = time.perf_counter(), stats["compile_s"]
    nxt = logp = None
    for i, (c0, tok, write, start) in enumerate(self._chunks(tokens, lengths)):
      key = keys[0] if i == 0 else jax.random.fold_in(keys[0], i)
      step = (Step.prefill(alloc.page_indices, write, key) if i == 0
              else Step.chunk(alloc.page_indices, start, write, key))
      cache, got, got_logp = self._run(tok, step, cache, SampleHead(sampling), targets[:, 0], stats)
      ends = (lengths > c0) & (lengths <= c0 + tok.shape[1])  # slots whose prompt ends here
      nxt = got if nxt is None else jnp.where(ends, got, nxt)
      logp = got_logp if logp is None else jnp.where(ends, got_logp, logp)
    sampled = np.asarray(nxt)  # waits for the device: prefill time includes the first token
    stats["prefill_s"] += time.perf_counter() - t0 - (stats["compile_s"] - compile0)
    stats["prompt_tokens"] += int(lengths.sum())

    out, preds, logps = ([[] for _ in range(n)] for _ in range(3))
    active = np.arange(s) < n
    kv_lens = lengths.copy()
    t0, compile0 = time.perf_counter(), stats["compile_s"]
    for i in range(max_new):
      feed = sampled if forced is None else targets[:, i]
      logp = np.asarray(logp)
      for j in np.nonzero(active)[0]:
        preds[j].append(int(sampled[j]))
        logps[j].append(float(logp[j]))
        if stop_on_eos and int(sampled[j]) in self.tokenizer.stop_ids:
          active[j] = False
        else:
          out[j].append(int(feed[j]))
      bar.update(int(active.sum()))
      if i == max_new - 1 or not active.any():
        break
      kv_lens += active
      step = decode_record(alloc, self.quant, kv_lens, active, keys[i + 1], deferred=self.stepper.deferred_seal)
      cache, nxt, logp = self._run(feed, step, cache, SampleHead(sampling), targets[:, i + 1], stats)
      stats["decode_tokens"] += int(active.sum())
      sampled = np.asarray(nxt)
    stats["decode_s"] += time.perf_counter() - t0 - (stats["compile_s"] - compile0)
    stats["generated_tokens"] += sum(len(o) for o in out)
    stats["max_len"] = max(stats["max_len"], int(kv_lens.max()))
    return out, preds, logps

  def _chunks(self, tokens, lengths):
    """Prefill steps for prompts tokens i32[S, L] of lengths i32[S]: yields (c0, tokens i32[S, T],
    write i32[S], start i32[S]): positions [c0, c0 + T) of every slot, T = the length bucket
    (prefill_chunk None or a longer chunk) or prefill_chunk."""
    longest = int(lengths.max())
    t = chunk_length(longest, self.prefill_chunk)
    for c0 in range(0, longest, t):
      tok = np.zeros((tokens.shape[0], t), np.int32)
      part = tokens[:, c0:c0 + t]
      tok[:, :part.shape[1]] = part
      yield (c0, tok, np.clip(lengths - c0, 0, t).astype(np.int32),
             np.minimum(lengths, c0).astype(np.int32))

  # ---------------------------------------------------------------------------------- perplexity

  def decode_perplexity(self, token_ids: Sequence[int], *, prefix: int = 1,
                        progress: bool = False) -> tuple[float, int]:
    """exp(mean NLL of tokens prefix+1..N), teacher-forced one decode step at a time.

    The first `prefix` tokens are prefilled; every later token is fed through the real decode step,
    so each prediction sees the cache exactly as generation does (for "hack": sealed 2-bit blocks,
    the 16-bit open block and sinks). Returns (perplexity, number of predictions = N - prefix).
    Raises ValueError unless 1 <= prefix < N <= cache capacity.
    """
    n = len(token_ids)
    if not 1 <= prefix < n <= self.capacity:
      raise ValueError(f"decode perplexity needs 1 <= prefix < tokens <= capacity "
                       f"{self.capacity}: got {prefix=}, tokens={n}")
    forced = np.asarray(token_ids[prefix:], np.int32)[None]
    result = self.generate_ids([list(token_ids[:prefix])], n - prefix, forced=forced,
                               progress=progress)
    logp = np.asarray(result.forced_logprobs[0], np.float64)
    return float(np.exp(-logp.mean())), n - prefix

  def perplexity(self, token_ids: Sequence[int], *, seed: int = 0) -> tuple[float, int]:
    """exp(mean NLL of tokens 2..N given their prefixes), prefilled through this cache format.

    The prefill logits are those of the model's prefill (ModelConfig.prefill): by default every
    prompt row attends exactly to the rows before it on their 16-bit K/V (in chunks of
    prefill_chunk over the cached prefix, which is then read as stored: 2-bit for "hack");
    "homomorphic" attends over the cache contents, where for "hack" a query also sees its own,
    still-filling block as 2-bit codes (not causal). decode_perplexity measures what generation
    sees. Returns (perplexity, number of predictions = N - 1).
    Raises ValueError for fewer than 2 tokens, more than the cache capacity, or ids outside
    [0, vocab_size).
    """
    n = len(token_ids)
    if n < 2 or n > self.capacity:
      raise ValueError(f"perplexity needs 2 <= tokens <= capacity {self.capacity}: got {n}")
    self._check_ids(token_ids, "token_ids")
    s = self.max_seqs
    tokens = np.zeros((s, n + 1), np.int32)  # + 1: the target after the last row (unused)
    tokens[0, :n] = token_ids
    lengths = np.zeros(s, np.int32)
    lengths[0] = n
    alloc = self.stepper.new_allocator()
    alloc.admit(0, n)
    stats = dict(compile_s=0.0)
    cache, key, nll = self.new_cache(), jax.random.key(seed), []
    for i, (c0, tok, write, start) in enumerate(self._chunks(tokens[:, :n], lengths)):
      targets = np.zeros_like(tok)
      part = tokens[:, c0 + 1:c0 + 1 + tok.shape[1]]
      targets[:, :part.shape[1]] = part
      key_i = jax.random.fold_in(key, i)
      step = (Step.prefill(alloc.page_indices, write, key_i) if i == 0
              else Step.chunk(alloc.page_indices, start, write, key_i))
      cache, got = self._run(tok, step, cache, ScoreHead(), targets, stats)
      nll.append(np.asarray(got[0, :int(write[0])], np.float64))
    nll = np.concatenate(nll)[:n - 1]
    return float(np.exp(nll.mean())), n - 1

