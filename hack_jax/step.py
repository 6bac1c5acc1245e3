"""Step: the record of one cached forward step (prefill or decode), built once on the host.

The host (a generation loop with its PageAllocator) knows every length before a step runs, so it
builds one Step per step and passes it through the jit boundary; the model hands it unchanged to
every layer's attention backend (hack_jax.attention.Backend), which writes the fresh K/V
(kv_cache.write_prefill / kv_cache.append) and attends (decode_attention / prefill_attention).

kv_lens has ONE meaning everywhere: the tokens each slot holds AFTER this step's writes; `start` the
tokens it held before. A decode step writes the token at position kv_lens[s] - 1 of every active slot
and that token's query attends over kv_lens[s] tokens; a prefill writes tokens [0, kv_lens[s]) of an
empty sequence; a chunk of a chunked prefill writes tokens [start[s], kv_lens[s]).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import numpy as np

Mode = Literal["prefill", "chunk", "decode"]
Seal = Literal["always", "never", "after"]


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["page_indices", "kv_lens", "active", "key", "start"],
                   meta_fields=["mode", "seal", "sinks"])
@dataclasses.dataclass(frozen=True)
class Step:
    """What one cached forward step writes into the cache and attends over.

    Attributes:
      mode: "prefill" (tokens [max_seqs, T], slot s writes its first kv_lens[s] tokens into an empty
        sequence), "chunk" (tokens [max_seqs, T]: the next kv_lens[s] - start[s] tokens of a
        sequence holding start[s]) or "decode" (tokens [max_seqs, 1], one token per active slot). Static.
      page_indices: i32[max_seqs, pages_per_seq], the host PageAllocator's table (0 = null page).
      kv_lens: i32[max_seqs] tokens each slot holds after this step's writes (module docstring).
      active: bool[max_seqs] slots this step writes (an inactive slot is left untouched; its
        attention output is not used).
      key: a jax PRNG key for the step. Layer i rounds with fold_in(key, i) (stochastic rounding);
        a sampler uses fold_in(key, num_layers).
      seal: decode only, kv_cache.append's `seal`: "never" when the host knows that no active slot
        fills its open block this step (kv_cache.seals_block), else "always" (each layer seals in its
        append, before it attends) or "after" (each layer writes its rows and attends over the filled
        region's 16-bit rows; the backend seals every layer at once after the last one:
        hack_jax.backend.Backend.finish, docs/DESIGN.md "Deferred sealing"). Static.
      start: i32[max_seqs] tokens each slot held before this step (0 for a prefill, kv_lens - active
        for a decode).
      sinks: decode only, kv_cache.append's `sinks`: False when the host knows that no active slot's
        new token is a sink (kv_cache.writes_sink is False: every slot holds num_sink_tokens or more
        before the step), so the step writes no sink rows at all; True (default) writes them where
        a token is one. Static.
    """
    mode: Mode
    page_indices: jax.Array
    kv_lens: jax.Array
    active: jax.Array
    key: jax.Array
    seal: Seal = "always"
    start: jax.Array | None = None
    sinks: bool = True

    def __post_init__(self):
        if self.start is None:  # prefill: empty slots; decode: one token per active slot
            start = (self.kv_lens * 0 if self.mode == "prefill"
                     else self.kv_lens - self.active.astype(self.kv_lens.dtype))
            object.__setattr__(self, "start", start)

    @property
    def write_lens(self):
        """i32[max_seqs] tokens each slot writes in this step (0 for inactive slots)."""
        return (self.kv_lens - self.start) * self.active.astype(self.kv_lens.dtype)

    @classmethod
    def prefill(cls, page_indices, lengths, key) -> "Step":
        """The step that prefills lengths[s] tokens (0 = slot unused) into empty sequences."""
        lengths = np.array(lengths, np.int32)  # copies: the host may reuse its arrays
        return cls("prefill", np.array(page_indices, np.int32), lengths, lengths > 0, key)

    @classmethod
    def chunk(cls, page_indices, start, lengths, key) -> "Step":
        """The step that writes lengths[s] more tokens after the start[s] a slot already holds."""
        start, lengths = np.array(start, np.int32), np.array(lengths, np.int32)
        return cls("chunk", np.array(page_indices, np.int32), start + lengths, lengths > 0, key,
                   start=start)

    @classmethod
    def decode(cls, page_indices, kv_lens, active, key, seal: Seal = "always", sinks: bool = True) -> "Step":
        """The decode step after which slot s holds kv_lens[s] tokens (its new one included when
        active[s])."""
        return cls("decode", np.array(page_indices, np.int32), np.array(kv_lens, np.int32),
                   np.array(active, bool), key, seal, sinks=bool(sinks))
