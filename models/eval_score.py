"""Decode-mode scoring with whole next-token distributions: the NLL of teacher-forced tokens and
the KL divergence of each prediction from a reference cache's, on the same positions.

score(gen, prompts, forced, ref=None) runs the windows as the sequences of one Generator batch
(gen.max_seqs of them per batch; more are run in several batches): the prompts are prefilled as
Generator.generate_ids prefills them (one step, or its prefill_chunk steps), in groups of
prefill_gen.max_seqs sequences when a second, smaller Generator of the same format is given (the
CPU's exact prefill attention materializes [heads, T, T] logits per sequence: 16 windows of 2K
are 10 GB), each group's sequences then moved into the decode batch's cache by
hack_jax.handoff (export_sequence / import_sequence: the cache's bytes, nothing re-quantized);
forced[:, 0] is scored by the prefill's last logits, and forced[:, i] (i >= 1) by the decode step that appended
forced[:, i - 1] and attended over the cache, exactly the steps generation runs (same Step, same
seal rule, same compiled steps: Generator._run through models.stepper, with stepper.LogpHead). Each step brings the log-softmax of all
V logits back to the host (f32[S, V]); it is scored there:
  nll[w, i] = -log p(forced[w, i]);
  kl[w, i]  = KL(p_ref || p) (eval_stats.kl_divergence) when `ref` holds the reference's
              log-probs of the same positions (a LogpStore of the reference run);
and, with keep=True, stored in a LogpStore (float32, W x n x V: 1024 positions of a 49k vocab are
0.2 GB, of Qwen's 152k 0.62 GB) to be the reference of the formats that follow.
"""

from __future__ import annotations

import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hack_jax import handoff, kv_cache
from hack_jax.paging import PageAllocator
from hack_jax.step import Step
from models.eval_stats import kl_divergence
from models.stepper import LogpHead

class LogpStore:
  """Host log-probs f32[W, n, V] of a reference run (positions as `forced`)."""

  def __init__(self, windows: int, positions: int, vocab: int):
    self.logp = np.empty((windows, positions, vocab), np.float32)


def score(gen, prompts: Sequence[Sequence[int]], forced: np.ndarray, *, ref: LogpStore | None = None,
          keep: bool = False, seed: int = 0, prefill_gen=None):
  """Teacher-forced decode scoring of forced i32[W, n] after the W prompts through gen's cache.

  gen: a models.generate.Generator (its max_seqs windows run per decode batch). prefill_gen: None
  (prefill each batch at once) or a Generator of the same format and backend with fewer slots
  that prefills the batch in groups (module docstring).
  Returns (nll f64[W, n], kl f64[W, n] or None without ref, store LogpStore or None without
  keep, timings dict: wall_s, cpu_s (process CPU time, all threads), compile_s, prefill_s, decode_s, decode_steps).
  Raises ValueError for a forced array that is not [len(prompts), n >= 1], ids outside the vocab,
  prompts that do not fit gen's capacity, or a ref of another shape."""
  forced = np.asarray(forced)
  if forced.ndim != 2 or forced.shape[0] != len(prompts) or forced.shape[1] < 1:
    raise ValueError(f"forced must be [len(prompts)={len(prompts)}, n >= 1], got {forced.shape}")
  forced = forced.astype(np.int32)
  w, n = forced.shape
  vocab = gen.config.vocab_size
  gen._check_ids(forced, "forced")  # pylint: disable=protected-access
  for i, p in enumerate(prompts):
    if len(p) == 0 or len(p) + n > gen.capacity:
      raise ValueError(f"prompt {i}: {len(p)} tokens + {n} scored must be in 1..{gen.capacity}")
    gen._check_ids(p, f"prompt {i}")  # pylint: disable=protected-access
  if ref is not None and ref.logp.shape != (w, n, vocab):
    raise ValueError(f"ref holds {ref.logp.shape}, this cell scores {(w, n, vocab)}")
  if prefill_gen is not None and prefill_gen.quant != gen.quant:
    raise ValueError(f"prefill_gen caches {prefill_gen.quant}, gen {gen.quant}")
  nll = np.empty((w, n))
  kl = None if ref is None else np.empty((w, n))
  store = LogpStore(w, n, vocab) if keep else None
  stats = dict(compile_s=0.0, prefill_s=0.0, decode_s=0.0, decode_steps=0)
  t0, cpu0 = time.perf_counter(), time.process_time()
  key = jax.random.key(seed)
  for lo in range(0, w, gen.max_seqs):
    rows = slice(lo, min(w, lo + gen.max_seqs))
    key, sub = jax.random.split(key)

    def take(i, logp, rows=rows):
      logp = np.asarray(logp)[:rows.stop - rows.start]
      nll[rows, i] = -np.take_along_axis(logp, forced[rows, i, None], axis=1)[:, 0]
      if kl is not None:
        kl[rows, i] = kl_divergence(ref.logp[rows, i], logp)
      if store is not None:
        store.logp[rows, i] = logp

    _batch(gen, prefill_gen or gen, prompts[rows], forced[rows], sub, take, stats)
  stats["wall_s"] = time.perf_counter() - t0
  stats["cpu_s"] = time.process_time() - cpu0  # all threads of this process
  return nll, kl, store, stats


def _prefill(gen, prompts, key, stats):
  """Prefills <= gen.max_seqs prompts into a new cache of gen. Returns (cache, allocator, log p
  f32[len(prompts), V] after each prompt)."""
  s = gen.max_seqs
  lengths = np.zeros(s, np.int32)
  lengths[:len(prompts)] = [len(p) for p in prompts]
  tokens = np.zeros((s, int(lengths.max())), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  alloc = PageAllocator(gen.num_pages, s, gen.pages_per_seq, gen.quant.page_size,
                        kv_cache.sink_tokens(gen.quant))
  for i, p in enumerate(prompts):
    alloc.admit(i, len(p))
  cache, logp = gen.new_cache(), None
  for i, (start0, tok, write, start) in enumerate(gen._chunks(tokens, lengths)):  # pylint: disable=protected-access
    k = key if i == 0 else jax.random.fold_in(key, i)
    step = Step.prefill(alloc.page_indices, write, k) if i == 0 else Step.chunk(
        alloc.page_indices, start, write, k)
    cache, got = gen._run(tok, step, cache, LogpHead(), None, stats)  # pylint: disable=protected-access
    ends = (lengths > start0) & (lengths <= start0 + tok.shape[1])
    logp = got if logp is None else jnp.where(ends[:, None], got, logp)
  return cache, alloc, np.asarray(logp)[:len(prompts)]


def _batch(gen, pre, prompts, forced, key, take, stats):
  """One batch of <= gen.max_seqs windows: prefill (through `pre`, in groups of pre.max_seqs
  handed into gen's cache when pre is not gen; take(0, logp)), then n - 1 decode steps."""
  n_live, s = len(prompts), gen.max_seqs
  n = forced.shape[1]
  keys = jax.random.split(key, n)
  t0, c0 = time.perf_counter(), stats["compile_s"]
  if pre is gen:
    cache, alloc, logp0 = _prefill(gen, prompts, keys[0], stats)
  else:
    alloc = PageAllocator(gen.num_pages, s, gen.pages_per_seq, gen.quant.page_size,
                          kv_cache.sink_tokens(gen.quant))
    cache, parts = gen.new_cache(), []
    for g in range(0, n_live, pre.max_seqs):
      group = prompts[g:g + pre.max_seqs]
      gcache, galloc, glogp = _prefill(pre, group, jax.random.fold_in(keys[0], g), stats)
      parts.append(glogp)
      for j, p in enumerate(group):
        payload = handoff.export_sequence(gcache, slot=j, page_indices=galloc.page_indices,
                                          kv_len=len(p))
        alloc.admit(g + j, len(p))
        cache = handoff.import_sequence(cache, payload, slot=g + j, page_indices=alloc.page_indices)
      del gcache
    logp0 = np.concatenate(parts)
  take(0, logp0)
  stats["prefill_s"] += time.perf_counter() - t0 - (stats["compile_s"] - c0)
  targets = np.zeros((s, n), np.int32)
  targets[:n_live] = forced
  active = np.arange(s) < n_live
  kv_lens = np.zeros(s, np.int32)
  kv_lens[:n_live] = [len(p) for p in prompts]
  t0, c0 = time.perf_counter(), stats["compile_s"]
  for i in range(1, n):
    for j in range(n_live):
      alloc.reserve(j, int(kv_lens[j]) + 1)
    kv_lens += active
    seal = "after" if gen.stepper.deferred_seal else "always" if kv_cache.seals_block(gen.quant, kv_lens, active) \
        else "never"
    step = Step.decode(alloc.page_indices, kv_lens, active, keys[i], seal)
    cache, logp = gen._run(targets[:, i - 1], step, cache, LogpHead(), None, stats)  # pylint: disable=protected-access
    take(i, logp)
    stats["decode_steps"] += 1
  stats["decode_s"] += time.perf_counter() - t0 - (stats["compile_s"] - c0)
