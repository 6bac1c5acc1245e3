"""Host-side page allocator for the paged KV cache (NumPy, never traced).

The device cache (`hack_jax.kv_cache`) never allocates: it reads and writes pages through a
fixed-shape table `page_indices` i32[max_seqs, pages_per_seq] that this allocator maintains on the
host. Sequences join and leave between steps by editing table rows, so the shapes the jitted steps
see never change and nothing recompiles.

Token -> page mapping (DESIGN.md "Paged cache layout"): a sequence's first `num_sink_tokens` tokens
live in per-sequence 16-bit sink buffers, token t >= num_sink_tokens in page column
(t - num_sink_tokens) // page_size. A sequence of n tokens therefore needs
ceil(max(n - num_sink_tokens, 0) / page_size) pages, and holds at most
num_sink_tokens + pages_per_seq * page_size tokens. Pages are reserved for every token a sequence
holds, including those still in the 16-bit open block, so sealing a block never needs a new page and
the seed layout can write per-token K codes straight into the page.

Unassigned entries: page 0 is reserved as the *null page*. It is never handed out, and every table
entry that no page is assigned to holds 0. A kernel or reference that reads a whole table row
therefore only ever reads valid memory; what it reads from the null page (or from a stale reused page
beyond a sequence's length) is masked by kv_lens. The usable pool is pages 1..num_pages-1.

Errors (ValueError naming the value): slot out of range or in the wrong state, a length beyond the
per-sequence capacity, an exhausted pool (nothing is allocated then), and, in
`validate_page_indices`, page ids out of range, the null page inside a live range, or one page
shared by two live sequences.
"""

from __future__ import annotations

import numpy as np

NULL_PAGE = 0


def require_int(name: str, value) -> int:
    """value as a Python int; TypeError naming it for anything else (a float would be truncated)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    return int(value)


INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def check_index_dtype(what: str, **arrays) -> None:
    """TypeError naming the array when a length / page-id / position array is not of an integer
    dtype (float lengths would be truncated silently); ValueError when a concrete array of a wider
    integer dtype (int64, uint32, ...) holds a value outside int32, which the cast to i32 would wrap
    (2**32 + 100 -> 100) past every later check. Accepts lists, NumPy and jax arrays and tracers
    (their dtype is static; a traced array is i32 already under jax's default 32-bit mode); None
    entries are skipped."""
    for name, x in arrays.items():
        if x is None:
            continue
        if not hasattr(x, "dtype"):
            x = np.asarray(x)
        if x.size and not np.issubdtype(x.dtype, np.integer):
            raise TypeError(f"{what}: {name} must be integers, got dtype {x.dtype}")
        if x.size and np.dtype(x.dtype).itemsize >= 4 and np.dtype(x.dtype) != np.int32 and not _traced(x):
            a = np.asarray(x)
            if int(a.min()) < INT32_MIN or int(a.max()) > INT32_MAX:
                raise ValueError(f"{what}: {name} holds values outside the int32 range (they would "
                                 f"wrap): min={int(a.min())} max={int(a.max())}")


def _traced(x) -> bool:
    """A jax tracer (its values unknown), recognised without importing jax: paging is NumPy only."""
    return any(c.__name__ == "Tracer" for c in type(x).__mro__)


def pages_needed(num_tokens: int, *, page_size: int, num_sink_tokens: int) -> int:
    """Pages that hold a sequence of `num_tokens` tokens (sinks live outside pages)."""
    return -(-max(int(num_tokens) - num_sink_tokens, 0) // page_size)


class PageAllocator:
    """Free list of cache pages and the `page_indices` table, one row per sequence slot.

    Args:
      num_pages: pages in the device pool, including the reserved null page 0.
      max_seqs: sequence slots (rows of the table).
      pages_per_seq: table columns; bounds a sequence's length.
      page_size: tokens per page.
      num_sink_tokens: tokens per sequence kept outside pages (use
        `hack_jax.kv_cache.sink_tokens(config)`, which is 0 for the unquantized/int8 formats).

    The table is `page_indices` (np.int32[max_seqs, pages_per_seq], a copy); pass it to the device
    steps as a jnp array each step.
    """

    def __init__(self, num_pages: int, max_seqs: int, pages_per_seq: int, page_size: int,
                 num_sink_tokens: int = 0):
        num_pages, max_seqs, pages_per_seq, page_size, num_sink_tokens = (
            require_int(n, v) for n, v in (("num_pages", num_pages), ("max_seqs", max_seqs),
                                            ("pages_per_seq", pages_per_seq), ("page_size", page_size),
                                            ("num_sink_tokens", num_sink_tokens)))
        if num_pages < 2:
            raise ValueError(f"need the null page plus at least one usable page: {num_pages=}")
        if max_seqs < 1 or pages_per_seq < 1 or page_size < 1 or num_sink_tokens < 0:
            raise ValueError(
                f"bad allocator sizes: {max_seqs=} {pages_per_seq=} {page_size=} {num_sink_tokens=}")
        self.num_pages = num_pages
        self.max_seqs = max_seqs
        self.pages_per_seq = pages_per_seq
        self.page_size = page_size
        self.num_sink_tokens = num_sink_tokens
        self._table = np.full((max_seqs, pages_per_seq), NULL_PAGE, np.int32)
        self._num_assigned = np.zeros(max_seqs, np.int64)
        self._admitted = np.zeros(max_seqs, bool)
        # LIFO: a page freed last is handed out first, so reuse happens early (and is tested).
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))

    @classmethod
    def for_cache(cls, cache) -> "PageAllocator":
        """An allocator matching a `hack_jax.kv_cache.KVCache`'s sizes and format (read from its
        properties, so paging imports nothing of the cache)."""
        return cls(cache.num_pages, cache.max_seqs, cache.pages_per_seq, cache.config.page_size,
                   cache.num_sink_tokens)

    @property
    def capacity(self) -> int:
        """Most tokens one sequence can hold."""
        return self.num_sink_tokens + self.pages_per_seq * self.page_size

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def page_indices(self) -> np.ndarray:
        """np.int32[max_seqs, pages_per_seq]; unassigned entries hold NULL_PAGE (0)."""
        return self._table.copy()

    def is_admitted(self, slot: int) -> bool:
        return bool(self._admitted[self._check_slot(slot)])

    def admit(self, slot: int, num_tokens: int) -> np.ndarray:
        """Start a sequence in a free slot with room for `num_tokens` tokens; returns the table."""
        slot = self._check_slot(slot)
        if self._admitted[slot]:
            raise ValueError(f"slot already holds a sequence: {slot=}")
        self._grow(slot, num_tokens)
        self._admitted[slot] = True
        return self.page_indices

    def reserve(self, slot: int, num_tokens: int) -> np.ndarray:
        """Grow an admitted sequence so it can hold `num_tokens` tokens (no-op if it already can)."""
        slot = self._check_slot(slot)
        if not self._admitted[slot]:
            raise ValueError(f"slot holds no sequence: {slot=}")
        self._grow(slot, num_tokens)
        return self.page_indices

    def release(self, slot: int) -> np.ndarray:
        """End the sequence in `slot`: its pages return to the pool, its row to the null page."""
        slot = self._check_slot(slot)
        if not self._admitted[slot]:
            raise ValueError(f"slot holds no sequence: {slot=}")
        n = int(self._num_assigned[slot])
        self._free.extend(int(p) for p in self._table[slot, :n][::-1])
        self._table[slot] = NULL_PAGE
        self._num_assigned[slot] = 0
        self._admitted[slot] = False
        return self.page_indices

    def _check_slot(self, slot) -> int:
        if isinstance(slot, (bool, np.bool_)) or not isinstance(slot, (int, np.integer)):
            raise TypeError(f"slot must be an int, got {slot!r} ({type(slot).__name__})")
        if not 0 <= slot < self.max_seqs:
            raise ValueError(f"slot out of range [0, {self.max_seqs}): {slot=}")
        return int(slot)

    def _grow(self, slot: int, num_tokens: int) -> None:
        num_tokens = require_int("num_tokens", num_tokens)
        if num_tokens < 0 or num_tokens > self.capacity:
            raise ValueError(
                f"length beyond capacity {self.capacity} (num_sink_tokens={self.num_sink_tokens}, "
                f"pages_per_seq={self.pages_per_seq}, page_size={self.page_size}): {num_tokens=}")
        need = pages_needed(num_tokens, page_size=self.page_size,
                            num_sink_tokens=self.num_sink_tokens)
        have = int(self._num_assigned[slot])
        extra = need - have
        if extra <= 0:
            return
        if extra > len(self._free):
            raise ValueError(
                f"page pool exhausted: slot {slot} needs {extra} more pages for {num_tokens=}, "
                f"{len(self._free)} free of {self.num_pages - 1}")
        for col in range(have, need):
            self._table[slot, col] = self._free.pop()
        self._num_assigned[slot] = need


def validate_page_indices(page_indices, kv_lens, *, num_pages: int, page_size: int,
                          num_sink_tokens: int, live_only: bool = False) -> None:
    """Host-side check of a page table against the lengths it must serve.

    Args:
      page_indices: int[batch, pages_per_seq] (NumPy or concrete jax array).
      kv_lens: int[batch] tokens per sequence.
      live_only: check page ids only in live columns (the readers' contract: columns past a
        sequence's length are never read, whatever they hold); else every entry (the writers').
    Raises ValueError naming the value if a length is negative or beyond capacity, a page id is
    outside [0, num_pages), a live column (one holding tokens < kv_len) points at the null page, or
    one page is live in two places.
    """
    table = np.asarray(page_indices)
    lens = np.asarray(kv_lens).reshape(-1)
    if table.ndim != 2 or lens.shape[0] != table.shape[0]:
        raise ValueError(f"page table / lengths shape mismatch: {table.shape=} {lens.shape=}")
    capacity = num_sink_tokens + table.shape[1] * page_size
    for seq, n in enumerate(lens):
        if n < 0 or n > capacity:
            raise ValueError(f"length beyond capacity {capacity}: kv_lens[{seq}]={n}")
    live = np.arange(table.shape[1])[None, :] < np.array(
        [pages_needed(n, page_size=page_size, num_sink_tokens=num_sink_tokens) for n in lens]
    )[:, None]
    bad = ((table < 0) | (table >= num_pages)) & (live if live_only else True)
    if bad.any():
        seq, col = np.argwhere(bad)[0]
        raise ValueError(
            f"page id out of range [0, {num_pages}): page_indices[{seq}, {col}]={table[seq, col]}")
    null_live = live & (table == NULL_PAGE)
    if null_live.any():
        seq, col = np.argwhere(null_live)[0]
        raise ValueError(f"live column points at the null page: page_indices[{seq}, {col}]=0 "
                         f"with kv_lens[{seq}]={lens[seq]}")
    ids, counts = np.unique(table[live], return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"page id live in two places: page={int(ids[counts > 1][0])}")
