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

Shared prefill (PrefillStore): under the exact prefill (hack_jax.prefill's default, one step, no
chunks) the prompt's hidden states and K/V do not depend on the cache format. A run given
keep_prefill=PrefillStore() keeps, per decode batch, each layer's K/V as its float32 cache holds
them after the prefill (the model's exact f32 K/V) and token 0's log-softmax; a later run given
prefill=that store skips the model's prefill: it writes those K/V into its own cache with
hack_jax.backend.write per layer (kv_cache.write_prefill: the format's quantizer, its V rotation,
per-layer formats, the prefill key folded with the layer index, as the model's prefill writes
them) and runs only the decode steps. Only a backend whose prefill is that exact one
(`shares_prefill`: a plain hack_jax.backend.Backend, not "homomorphic") may take or give a store.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hack_jax import handoff, kv_cache
from hack_jax.backend import Backend, write
from hack_jax.config import QuantConfig
from hack_jax.kv_cache import mixed
from hack_jax.paging import PageAllocator
from hack_jax.prefill import EXACT
from hack_jax.step import Step
from models.eval_stats import kl_divergence
from models.stepper import LogpHead

class LogpStore:
  """Host log-probs f32[W, n, V] of a reference run (positions as `forced`)."""

  def __init__(self, windows: int, positions: int, vocab: int):
    self.logp = np.empty((windows, positions, vocab), np.float32)


class PrefillStore:
  """The exact prefill of a reference run (module docstring), one entry per decode batch:
  (k, v f32[num_layers, max_seqs, T, num_kv_heads, head_dim], log p f32[n_live, V] of token 0).
  prompts: the prompts it was made from (a run given the store must score the same ones)."""

  def __init__(self):
    self.batches: list[tuple[jax.Array, jax.Array, np.ndarray]] = []
    self.prompts: list[list[int]] | None = None
    self.config = None


def shares_prefill(attention, prefill_chunk=None) -> bool:
  """Whether a Generator's prefill through `attention` is the exact, format-independent one: a
  hack_jax.backend.Backend itself (no evaluation wrapper: fake quantization, K/q rotation) with an
  exact prefill_attention, in one step (prefill_chunk None: a chunk would read its cached prefix)."""
  return (type(attention) is Backend and attention.prefill_attention in EXACT  # pylint: disable=unidiomatic-typecheck
          and prefill_chunk is None)


def score(gen, prompts: Sequence[Sequence[int]], forced: np.ndarray, *, ref: LogpStore | None = None,
          keep: bool = False, seed: int = 0, prefill_gen=None, keep_prefill: PrefillStore | None = None,
          prefill: PrefillStore | None = None):
  """Teacher-forced decode scoring of forced i32[W, n] after the W prompts through gen's cache.

  gen: a models.generate.Generator (its max_seqs windows run per decode batch). prefill_gen: None
  (prefill each batch at once) or a Generator of the same format and backend with fewer slots
  that prefills the batch in groups (module docstring). keep_prefill: an empty PrefillStore that
  this run fills (its exact prefill K/V); prefill: a filled one whose K/V this run writes into its
  cache instead of prefilling (module docstring; same prompts, model and max_seqs).
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
  _check_shared(gen, prefill_gen, prompts, keep_prefill, prefill)
  nll = np.empty((w, n))
  kl = None if ref is None else np.empty((w, n))
  store = LogpStore(w, n, vocab) if keep else None
  stats = dict(compile_s=0.0, prefill_s=0.0, decode_s=0.0, decode_steps=0, prefill_shared=prefill is not None)
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

    shared = None if prefill is None else prefill.batches[lo // gen.max_seqs]
    _batch(gen, prefill_gen or gen, prompts[rows], forced[rows], sub, take, stats, shared, keep_prefill)
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


def _batch(gen, pre, prompts, forced, key, take, stats, shared=None, keep_prefill=None):
  """One batch of <= gen.max_seqs windows: prefill (through `pre`, in groups of pre.max_seqs
  handed into gen's cache when pre is not gen; or the `shared` K/V of a PrefillStore written into
  gen's cache; take(0, logp)), then n - 1 decode steps."""
  n_live, s = len(prompts), gen.max_seqs
  n = forced.shape[1]
  keys = jax.random.split(key, n)
  t0, c0 = time.perf_counter(), stats["compile_s"]
  if shared is not None:
    stochastic = any(c.rounding == "stochastic" for c in mixed.formats_of(gen.quant))
    groups = [(0, n_live)] if pre is gen or not stochastic else [
        (g, min(n_live, g + pre.max_seqs)) for g in range(0, n_live, pre.max_seqs)]
    cache, alloc, logp0 = _write_shared(gen, prompts, shared, keys[0], groups, stats)
  elif pre is gen:
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
  if keep_prefill is not None:
    keep_prefill.batches.append(_capture(cache, alloc, prompts) + (logp0,))
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
    step = Step.decode(alloc.page_indices, kv_lens, active, keys[i], seal,
                       kv_cache.writes_sink(gen.quant, kv_lens, active))
    cache, logp = gen._run(targets[:, i - 1], step, cache, LogpHead(), None, stats)  # pylint: disable=protected-access
    take(i, logp)
    stats["decode_steps"] += 1
  stats["decode_s"] += time.perf_counter() - t0 - (stats["compile_s"] - c0)


def _check_shared(gen, prefill_gen, prompts, keep_prefill, prefill):
  """ValueError unless a PrefillStore may be kept from / used by this run (module docstring)."""
  if keep_prefill is None and prefill is None:
    return
  if keep_prefill is not None and prefill is not None:
    raise ValueError("a run either keeps its prefill (keep_prefill) or uses a stored one (prefill)")
  for g in (gen, prefill_gen):
    if g is not None and not shares_prefill(g.attention, g.prefill_chunk):
      raise ValueError(f"prefill not shareable: the Generator's prefill depends on its cache "
                       f"format (attention {g.attention!r}, prefill_chunk {g.prefill_chunk})")
  prompts = [list(map(int, p)) for p in prompts]
  if keep_prefill is not None:
    if not isinstance(gen.quant, QuantConfig) or gen.quant.kv_format != "float32" or gen.quant.v_rotation:
      raise ValueError(f"keep_prefill needs a float32 cache without V rotation (the exact K/V), "
                       f"got {gen.quant}")
    if keep_prefill.batches:
      raise ValueError("keep_prefill must be an empty PrefillStore")
    keep_prefill.prompts, keep_prefill.config = prompts, gen.config
    return
  if prefill.prompts != prompts or prefill.config != gen.config:
    raise ValueError("prefill: the PrefillStore was made from other prompts or another model")
  want = -(-len(prompts) // gen.max_seqs)
  if len(prefill.batches) != want or prefill.batches[0][0].shape[1] != gen.max_seqs:
    raise ValueError(f"prefill: the PrefillStore holds {len(prefill.batches)} batches of "
                     f"{prefill.batches[0][0].shape[1] if prefill.batches else 0} slots; this run has "
                     f"{want} of {gen.max_seqs}")


def _capture(cache, alloc, prompts):
  """The float32 cache's K/V after the prefill: f32[num_layers, max_seqs, T, H, D] each (T = the
  longest prompt; zero past each prompt and in unused slots)."""
  t = max(len(p) for p in prompts)
  kv_lens = np.zeros(alloc.page_indices.shape[0], np.int32)
  kv_lens[:len(prompts)] = [len(p) for p in prompts]
  ks, vs = zip(*(kv_cache.dequantize_cache(layer, alloc.page_indices, kv_lens)
                 for layer in mixed.layer_list(cache.layers)))
  return jnp.stack([k[:, :t] for k in ks]), jnp.stack([v[:, :t] for v in vs])


@functools.partial(jax.jit, donate_argnums=(0,))
def _write_layers(cache, ks, vs, step):
  """cache with layer i written from ks[i], vs[i] by hack_jax.backend.write (a stacked cache: one
  lax.scan per run of consecutive layers of one format, as models.llama scans them)."""
  if not cache.stacked:
    return dataclasses.replace(cache, layers=tuple(
        write(layer, ks[i], vs[i], step, layer_index=i) for i, layer in enumerate(cache.layers)))
  groups, layer_map = mixed.groups_of(cache.layers)
  for g, first, stop, offset in mixed.runs(layer_map):

    def body(group, xs, shift=first - offset):
      k, v, i = xs
      take = lambda a: jax.lax.dynamic_index_in_dim(a, i - shift, keepdims=False)
      layer = write(jax.tree.map(take, group), k, v, step, layer_index=i)
      return jax.tree.map(lambda a, b: jax.lax.dynamic_update_index_in_dim(a, b, i - shift, 0),
                          group, layer), None

    groups[g], _ = jax.lax.scan(body, groups[g], (ks[first:stop], vs[first:stop],
                                                  jnp.arange(first, stop, dtype=jnp.int32)))
  return dataclasses.replace(cache, layers=mixed.with_groups(cache.layers, groups))


def _write_shared(gen, prompts, shared, key, groups, stats):
  """A PrefillStore batch written into a new cache of gen (the slots admitted as _prefill admits
  them). groups: (lo, hi) slot ranges prefilled with fold_in(key, lo) (the hand-off path's keys;
  one group (0, n) = key itself), so stochastic rounding draws what the model's prefill draws.
  Returns (cache, allocator, log p of token 0)."""
  ks, vs, logp0 = shared
  s = gen.max_seqs
  alloc = PageAllocator(gen.num_pages, s, gen.pages_per_seq, gen.quant.page_size,
                        kv_cache.sink_tokens(gen.quant))
  for i, p in enumerate(prompts):
    alloc.admit(i, len(p))
  cache, compiled = gen.new_cache(), None
  for lo, hi in groups:
    lengths = np.zeros(s, np.int32)
    lengths[lo:hi] = [len(p) for p in prompts[lo:hi]]
    step = Step.prefill(alloc.page_indices, lengths, key if len(groups) == 1 else
                        jax.random.fold_in(key, lo))
    if compiled is None:
      c0 = time.perf_counter()
      compiled = _write_layers.lower(cache, ks, vs, step).compile()
      stats["compile_s"] += time.perf_counter() - c0
    cache = compiled(cache, ks, vs, step)
  return cache, alloc, logp0
