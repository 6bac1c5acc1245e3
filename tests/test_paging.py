"""hack_jax.paging: the host-side free list and page table (no device work)."""

import numpy as np
import pytest

from hack_jax import kv_cache, paging
from hack_jax.config import QuantConfig


def make(num_pages=9, max_seqs=3, pages_per_seq=3, page_size=256, num_sink_tokens=4):
    return paging.PageAllocator(num_pages, max_seqs, pages_per_seq, page_size, num_sink_tokens)


def test_pages_needed_counts_tokens_past_the_sinks():
    need = lambda n: paging.pages_needed(n, page_size=256, num_sink_tokens=4)
    assert [need(n) for n in (0, 1, 4, 5, 260, 261, 516, 517)] == [0, 0, 0, 1, 1, 2, 2, 3]
    assert paging.pages_needed(256, page_size=256, num_sink_tokens=0) == 1
    assert paging.pages_needed(257, page_size=256, num_sink_tokens=0) == 2


def test_admit_grow_release_reuse():
    alloc = make()
    assert alloc.capacity == 4 + 3 * 256 and alloc.num_free_pages == 8
    table = alloc.admit(0, 300)  # 296 tokens past the sinks: 2 pages
    assert table.shape == (3, 3) and table.dtype == np.int32
    assert (table[0, :2] > 0).all() and table[0, 2] == paging.NULL_PAGE and (table[1:] == 0).all()
    alloc.admit(1, 3)  # only sinks: no page yet
    assert (alloc.page_indices[1] == 0).all()
    alloc.reserve(1, 5)
    assert alloc.page_indices[1, 0] > 0 and alloc.page_indices[1, 1] == 0
    alloc.reserve(1, 5)  # already enough: no-op
    alloc.reserve(0, 100)  # never shrinks
    assert (alloc.page_indices[0, :2] == table[0, :2]).all()
    assert alloc.num_free_pages == 8 - 3
    live = alloc.page_indices[alloc.page_indices > 0]
    assert len(set(live.tolist())) == len(live), "no page is handed out twice"
    freed = set(alloc.page_indices[0, :2].tolist())
    alloc.release(0)
    assert (alloc.page_indices[0] == 0).all() and not alloc.is_admitted(0)
    alloc.admit(2, 400)  # LIFO: the pages just freed are reused first
    assert set(alloc.page_indices[2, :2].tolist()) == freed
    alloc.admit(0, 1)  # a released slot takes a new sequence
    assert alloc.is_admitted(0)


def test_page_indices_is_a_copy():
    alloc = make()
    alloc.admit(0, 100)
    table = alloc.page_indices
    table[0, 0] = 99
    assert alloc.page_indices[0, 0] != 99


def test_errors_name_the_value_and_change_nothing():
    alloc = make(num_pages=4)
    alloc.admit(0, 4 + 2 * 256)  # 2 of the 3 usable pages
    before = alloc.page_indices
    with pytest.raises(ValueError, match=r"pool exhausted: slot 1 needs 2 more pages.*1 free of 3"):
        alloc.admit(1, 4 + 257)
    assert not alloc.is_admitted(1) and alloc.num_free_pages == 1
    assert (alloc.page_indices == before).all()
    with pytest.raises(ValueError, match=r"capacity 772.*num_tokens=773"):
        alloc.reserve(0, 773)
    with pytest.raises(ValueError, match="num_tokens=-1"):
        alloc.admit(2, -1)
    with pytest.raises(ValueError, match="slot=3"):
        alloc.admit(3, 1)
    with pytest.raises(ValueError, match="slot=-1"):
        alloc.release(-1)
    with pytest.raises(ValueError, match="already holds"):
        alloc.admit(0, 1)
    with pytest.raises(ValueError, match="holds no sequence"):
        alloc.reserve(2, 1)
    with pytest.raises(ValueError, match="holds no sequence"):
        alloc.release(2)
    with pytest.raises(ValueError, match="null page"):
        paging.PageAllocator(1, 1, 1, 256)


def test_validate_page_indices():
    kw = dict(num_pages=6, page_size=256, num_sink_tokens=4)
    table = np.array([[1, 2, 0], [3, 0, 0]], np.int32)
    paging.validate_page_indices(table, [300, 100], **kw)
    paging.validate_page_indices(table, [0, 4], **kw)  # no live page columns at all
    with pytest.raises(ValueError, match=r"page_indices\[0, 1\]=6"):
        paging.validate_page_indices(np.array([[1, 6, 0], [3, 0, 0]]), [300, 100], **kw)
    with pytest.raises(ValueError, match=r"page_indices\[1, 0\]=-2"):
        paging.validate_page_indices(np.array([[1, 2, 0], [-2, 0, 0]]), [300, 100], **kw)
    with pytest.raises(ValueError, match=r"null page: page_indices\[0, 2\]=0 with kv_lens\[0\]=600"):
        paging.validate_page_indices(table, [600, 100], **kw)
    with pytest.raises(ValueError, match="page=3"):
        paging.validate_page_indices(np.array([[1, 3, 0], [3, 0, 0]]), [300, 100], **kw)
    paging.validate_page_indices(np.array([[1, 3, 0], [3, 0, 0]]), [100, 100], **kw)  # 3 unused in row 0
    with pytest.raises(ValueError, match=r"kv_lens\[1\]=773"):
        paging.validate_page_indices(table, [1, 773], **kw)
    with pytest.raises(ValueError, match="shape mismatch"):
        paging.validate_page_indices(table, [1, 2, 3], **kw)


def test_for_cache_uses_the_format_sinks():
    for fmt, sinks in (("hack", 4), ("bf16", 0), ("int8", 0)):
        cache = kv_cache.init_cache(QuantConfig(kv_format=fmt), num_layers=1, num_kv_heads=1,
                                    head_dim=64, num_pages=3, max_seqs=2, pages_per_seq=2)
        alloc = paging.PageAllocator.for_cache(cache)
        assert (alloc.num_pages, alloc.max_seqs, alloc.pages_per_seq, alloc.page_size) == (3, 2, 2, 256)
        assert alloc.num_sink_tokens == sinks and alloc.capacity == cache.capacity


def test_random_churn_keeps_the_invariants():
    """Random admissions, growth and releases: pages are unique, never the null page, the free
    list and the table together always hold every usable page exactly once, and each sequence
    has exactly the pages its length needs."""
    rng = np.random.default_rng(0)
    alloc = make(num_pages=20, max_seqs=5, pages_per_seq=4)
    lengths = np.zeros(5, int)
    for _ in range(2000):
        s = int(rng.integers(5))
        try:
            if not alloc.is_admitted(s):
                n = int(rng.integers(0, 300))
                alloc.admit(s, n)
                lengths[s] = n
            elif rng.random() < 0.2:
                alloc.release(s)
                lengths[s] = 0
            else:
                n = min(lengths[s] + int(rng.integers(1, 200)), alloc.capacity)
                alloc.reserve(s, n)
                lengths[s] = n
        except ValueError as e:
            assert "exhausted" in str(e)
        table = alloc.page_indices
        live = table[table > 0]
        assert len(set(live.tolist())) == len(live)
        assert len(live) + alloc.num_free_pages == 19
        need = [paging.pages_needed(n, page_size=256, num_sink_tokens=4) for n in lengths]
        assert ((table > 0).sum(1) == need).all()
        paging.validate_page_indices(table, lengths, num_pages=20, page_size=256, num_sink_tokens=4)


def test_non_int_sizes_and_lengths_are_type_errors():
    """Floats would be truncated (3.5 pages, 70.5 tokens): TypeError naming the argument."""
    with pytest.raises(TypeError, match="num_pages must be an int, got 3.5"):
        paging.PageAllocator(3.5, 2, 2, 64, 4)
    alloc = paging.PageAllocator(5, 2, 2, 64, 4)
    with pytest.raises(TypeError, match="num_tokens must be an int, got 70.5"):
        alloc.admit(0, 70.5)
    assert not alloc.is_admitted(0) and alloc.num_free_pages == 4  # nothing changed
    with pytest.raises(TypeError, match="lengths must be integers"):
        paging.check_index_dtype("here", lengths=[1.0, 2.0])
    paging.check_index_dtype("here", lengths=np.array([1, 2], np.int64), ids=[], start=None)


def test_bool_slot_is_a_type_error():
    """issue 17.6: admit(True, 10) used slot 1."""
    alloc = make()
    for call in (lambda: alloc.admit(True, 10), lambda: alloc.reserve(np.bool_(False), 10),
                 lambda: alloc.release(1.0)):
        with pytest.raises(TypeError, match="slot must be an int"):
            call()
    assert alloc.num_free_pages == 8 and not alloc.page_indices.any()
