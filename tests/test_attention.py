"""hack_jax.attention (the dispatch) over paged caches: invariances, compiles and errors.

Outputs against the float64 twin, for every implementation, are in test_attention_suite.py; here:
shuffled page tables and reused (NaN-poisoned) pages do not change outputs, one compile serves a
decode loop, and bad inputs raise naming the value. Caches come from test_kv_cache's shared
geometry (same compiled writers, memoized).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import twin
from hack_jax import attention, kv_cache, paging
from hack_jax.config import QuantConfig
from test_kv_cache import (FORMATS, LENGTHS, append_jit, empty_layer, make_kv, prefill_jit,
                           shuffled_table, written)

NUM_Q_HEADS = 4  # GQA group of 2 over the 2 kv heads

decode_jit = jax.jit(attention.decode_attention, static_argnames="impl")


def make_q(q_len=None, seed=5):
    rng = np.random.default_rng(seed)
    shape = (len(LENGTHS),) + ((q_len,) if q_len else ()) + (NUM_Q_HEADS, 128)
    return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("fmt", FORMATS)
def test_shuffled_page_indices_do_not_change_outputs(fmt):
    """The same sequences written through two different shuffles of the pool decode identically."""
    q = make_q()
    outs = []
    for seed in (0, 1):
        table, num_pages = shuffled_table(FORMATS[fmt], seed=seed)
        k, v = make_kv()
        lengths = np.asarray(LENGTHS, np.int32)
        layer = prefill_jit(empty_layer(FORMATS[fmt], num_pages), k, v, lengths=lengths,
                            page_indices=table)
        outs.append(np.asarray(decode_jit(q, layer, page_indices=table, kv_lens=lengths)))
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize("fmt", FORMATS)
def test_reused_pages_with_nan_leave_decode_finite_and_correct(fmt):
    """Slot 10's sequence ends and its pages are reused (shuffled) by a new sequence in slot 9;
    before that they get NaN metadata/values and all-ones codes, as does the null page and every
    stale open-block / sink row. Decode over all sequences stays finite and equals decode over a
    cache that holds the same sequences in fresh pages."""
    config = FORMATS[fmt]
    layer, k, v, lengths, table = written(fmt, "prefill", exact=True)
    freed = table[10][table[10] > 0]
    new_table, new_lengths = table.copy(), lengths.copy()
    new_table[10], new_lengths[10], new_lengths[9] = 0, 0, 600
    new_table[9, :len(freed)] = np.random.default_rng(1).permutation(freed)

    def poison(name, a):
        floating = jnp.issubdtype(a.dtype, jnp.floating)
        a = np.array(a)
        if name.startswith(("open", "sink")):  # per-slot rows the sequences do not hold
            ns = config.num_sink_tokens
            held = (np.clip(new_lengths - ns, 0, None) % config.partition_size if name.startswith("open")
                    else np.minimum(new_lengths, ns))
            stale = np.arange(a.shape[2])[None, :] >= held[:, None]  # [S, rows]
            a[np.nonzero(stale)[0], :, np.nonzero(stale)[1]] = np.nan
        else:
            a[np.append(freed, paging.NULL_PAGE)] = np.nan if floating else -1 if a.dtype == np.int8 else 0xFF
        return jnp.asarray(a)

    k2, v2 = make_kv(seed=2, exact=True)
    only_9 = np.where(np.arange(len(lengths)) == 9, 600, 0).astype(np.int32)
    cur = np.where(only_9 > 0, 560, 0).astype(np.int32)
    fields = [f.name for f in dataclasses.fields(layer) if f.name != "config"]
    pages = [f for f in fields if not f.startswith(("open", "sink"))]
    reused = dataclasses.replace(layer, **{f: poison(f, getattr(layer, f)) for f in pages})
    reused = prefill_jit(reused, k2, v2, lengths=cur, page_indices=new_table)  # slot 9 restarts
    while cur[9] < 600:
        reused = append_jit(reused, k2[:, cur[9]], v2[:, cur[9]], kv_lens=cur + (only_9 > cur),
                            active=only_9 > cur, page_indices=new_table)
        cur = cur + (only_9 > cur)
    reused = dataclasses.replace(reused, **{f: poison(f, getattr(reused, f)) for f in fields
                                            if f not in pages})

    k_all, v_all = k.copy(), v.copy()
    k_all[9], v_all[9] = k2[9], v2[9]
    fresh_table, _ = shuffled_table(config, new_lengths, seed=3)
    fresh_table = np.pad(fresh_table, ((0, 0), (0, table.shape[1] - fresh_table.shape[1])))
    fresh = prefill_jit(empty_layer(config, layer.num_pages), k_all, v_all, lengths=new_lengths,
                        page_indices=fresh_table)
    q = make_q()
    got = np.asarray(decode_jit(q, reused, page_indices=new_table, kv_lens=new_lengths))
    want = np.asarray(decode_jit(q, fresh, page_indices=fresh_table, kv_lens=new_lengths))
    assert np.isfinite(got).all()
    assert (got[10] == 0).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())


def test_decode_compiles_once_for_a_decode_loop():
    """Changing lengths, membership (kv_lens 0) and page tables reuse one compiled decode."""
    layer, _, _, lengths, table = written("kivi", "prefill")
    q = make_q()
    rng = np.random.default_rng(0)
    decode_jit(q, layer, page_indices=table, kv_lens=lengths)
    compiled = decode_jit._cache_size()
    for i in range(4):
        lens = np.where(rng.random(len(lengths)) < 0.3, 0, rng.integers(1, lengths + 1)).astype(np.int32)
        tbl = table if i % 2 else np.ascontiguousarray(table[::-1])  # any table, same compile
        out = decode_jit(q, layer, page_indices=tbl, kv_lens=lens)
        assert (np.asarray(out)[lens == 0] == 0).all()
    assert decode_jit._cache_size() == compiled


def test_dispatch_errors():
    layer, _, _, lengths, table = written("kivi", "prefill")
    q = make_q()
    with pytest.raises(ValueError, match="impl"):
        attention.decode_attention(q, layer, page_indices=table, kv_lens=lengths, impl="cuda")
    with pytest.raises(ValueError, match="kernel options"):
        attention.decode_attention(q, layer, page_indices=table, kv_lens=lengths, interpret=True)
    with pytest.raises(ValueError, match="q does not match"):
        attention.decode_attention(q[..., :64], layer, page_indices=table, kv_lens=lengths)
    with pytest.raises(ValueError, match="num_q_heads, head_dim"):
        attention.decode_attention(q[:, None], layer, page_indices=table, kv_lens=lengths)
    with pytest.raises(ValueError, match="batch mismatch"):
        attention.decode_attention(q, layer, page_indices=table, kv_lens=lengths[:3])
    with pytest.raises(ValueError, match="LayerCache"):
        attention.decode_attention(q, object(), page_indices=table, kv_lens=lengths)
    seed_layer, _, _, _, seed_table = written("seed", "prefill")
    with pytest.raises(NotImplementedError, match="seed"):
        attention.decode_attention(q, seed_layer, page_indices=seed_table, kv_lens=lengths, impl="pallas")
    int8_layer, _, _, _, int8_table = written("int8", "prefill")
    with pytest.raises(NotImplementedError, match="int8"):
        attention.decode_attention(q, int8_layer, page_indices=int8_table, kv_lens=lengths,
                                   impl="pallas_dequant")
    f32_layer, _, _, _, f32_table = written("float32", "prefill")
    with pytest.raises(NotImplementedError, match="float32"):
        attention.prefill_attention(q[:, None], f32_layer, page_indices=f32_table, kv_lens=lengths,
                                    impl="pallas")


def test_concrete_kv_lens_beyond_capacity_raise():
    config = QuantConfig(kv_format="bf16")
    layer = kv_cache.init_layer(config, num_kv_heads=1, head_dim=64, num_pages=3, max_seqs=2)
    q = jnp.zeros((2, 2, 64), jnp.float32)
    page_indices = np.array([[1], [2]], np.int32)  # capacity = 1 page of 256 tokens
    for kv_lens in ([257, 1], [-1, 1]):
        with pytest.raises(ValueError, match="capacity=256"):
            attention.decode_attention(q, layer, page_indices=page_indices, kv_lens=np.array(kv_lens))


def test_concrete_table_and_length_errors():
    """Eager (concrete) inputs are checked like the write path's: ids outside the pool, a live
    column at the null page, non-integer lengths / ids and a negative q_start each raise, naming
    the value (inside jit these cannot raise: docstrings)."""
    layer, _, _, lengths, table = written("kivi", "prefill")
    q = make_q()
    i = int(np.argmax(lengths))  # the longest sequence: its column 0 is live
    bad = np.array(table)
    bad[i, 0] = layer.num_pages  # one past the pool
    with pytest.raises(ValueError, match=rf"page_indices\[{i}, 0\]={layer.num_pages}"):
        attention.decode_attention(q, layer, page_indices=bad, kv_lens=lengths)
    dead = int(np.argmin(lengths))  # 1 token: held by the sinks, its columns are never read
    assert lengths[dead] <= kv_cache.sink_tokens(layer.config)
    junk = np.array(table)
    junk[dead, :] = 10 ** 6  # garbage in dead columns is allowed (never read)
    np.testing.assert_array_equal(
        np.asarray(attention.decode_attention(q, layer, page_indices=junk, kv_lens=lengths)),
        np.asarray(attention.decode_attention(q, layer, page_indices=table, kv_lens=lengths)))
    null = np.array(table)
    null[i, 0] = 0
    with pytest.raises(ValueError, match="null page"):
        attention.decode_attention(q, layer, page_indices=null, kv_lens=lengths)
    with pytest.raises(TypeError, match="kv_lens must be integers"):
        attention.decode_attention(q, layer, page_indices=table, kv_lens=np.asarray(lengths) + 0.5)
    with pytest.raises(TypeError, match="page_indices must be integers"):
        attention.decode_attention(q, layer, page_indices=np.asarray(table) + 0.5, kv_lens=lengths)
    start = np.zeros(len(lengths), np.int32)
    start[1] = -5
    with pytest.raises(ValueError, match="q_start must be >= 0"):
        attention.prefill_attention(q[:, None], layer, page_indices=table, kv_lens=lengths, q_start=start)
    with pytest.raises(TypeError, match="q_start must be integers"):
        attention.prefill_attention(q[:, None], layer, page_indices=table, kv_lens=lengths,
                                    q_start=start + 0.5)


# ----------------------------------------------------------------------------- issue 17


def _small_kivi(lengths=(8, 70)):
    """A kivi layer (2 kv heads, head_dim 128) holding two sequences written by prefill, its table."""
    config = QuantConfig()
    k, v = make_kv(num_seqs=2, t_len=max(lengths), exact=True)
    table = np.array([[1], [2]], np.int32)
    layer = prefill_jit(empty_layer(config, 4, 2), k, v, lengths=np.array(lengths, np.int32), page_indices=table)
    return layer, k, v, table


def test_int64_lengths_and_page_ids_that_would_wrap_are_rejected():
    """issue 17.4: kv_lens 2**32 + 8 ran as 8; a page id 2**32 + 1 ran as page 1."""
    layer, _, _, table = _small_kivi()
    q = make_q()[:2]
    with pytest.raises(ValueError, match="int32 range"):
        attention.decode_attention(q, layer, page_indices=table, kv_lens=np.array([2**32 + 8, 70]))
    with pytest.raises(ValueError, match="int32 range"):
        attention.decode_attention(q, layer, page_indices=np.array([[2**32 + 1], [2]]),
                                   kv_lens=np.array([8, 70]))
    with pytest.raises(ValueError, match="int32 range"):
        attention.prefill_attention(q[:, None], layer, page_indices=table, kv_lens=np.array([8, 70]),
                                    q_start=np.array([2**33, 0]))


def test_nan_query_or_key_gives_nan_not_zero():
    """issue 17.5: a NaN query row came out as 0 (softmax_state_output's l > 0 test), and a NaN K
    appended under jit too. Now NaN propagates to that sequence's output only; the other sequence
    still matches the float64 reference."""
    layer, k, v, table = _small_kivi()
    lens = np.array([8, 70], np.int32)
    q = make_q()[:2]
    q_nan = q.copy()
    q_nan[0, 1, 5] = np.nan
    for impl_layer in (layer,):
        out = np.asarray(attention.decode_attention(q_nan, impl_layer, page_indices=table, kv_lens=lens))
        assert np.isnan(out[0, 1]).all() and np.isfinite(out[1]).all()
    append = jax.jit(kv_cache.append)  # traced: nothing can raise, the NaN is stored
    k_new = np.ones((2, 2, 128), np.float32)
    k_new[0, 0, 7] = np.nan
    after = append(layer, k_new, k_new, kv_lens=lens + 1, active=np.array([True, True]), page_indices=table)
    out = np.asarray(jax.jit(attention.decode_attention)(q, after, page_indices=table, kv_lens=lens + 1))
    assert np.isnan(out[0, :2]).all()  # q heads 0, 1 use kv head 0, which holds the NaN key
    assert np.isfinite(out[1]).all()
    kk, vv = (np.concatenate([x, np.zeros_like(x[:, :1])], axis=1) for x in (k, v))
    kk[0, 8], vv[0, 8] = k_new[0], k_new[0]
    kk[1, 70], vv[1, 70] = k_new[1], k_new[1]
    want = twin.np_cache_attention(q[:, None], twin.Cache(after, kk, vv, lens + 1, table), lens[:, None])
    np.testing.assert_allclose(out[1], want[1, 0], atol=1e-4)  # float64 homomorphic twin of the codes


def test_pallas_off_gpu_without_interpret_names_the_fix():
    """issue 17 unclear errors: impl='pallas' on a CPU without interpret raised jax's 'Only interpret
    mode is supported on CPU backend.' from inside the kernel call."""
    if jax.default_backend() == "gpu":
        pytest.skip("the check applies off the GPU")
    layer, _, _, table = _small_kivi()
    q = make_q()[:2]
    with pytest.raises(ValueError, match="interpret=True"):
        attention.decode_attention(q, layer, page_indices=table, kv_lens=np.array([8, 70], np.int32),
                                   impl="pallas")
    with pytest.raises(ValueError, match="interpret=True"):
        attention.prefill_attention(q[:, None], layer, page_indices=table,
                                    kv_lens=np.array([8, 70], np.int32), impl="pallas")
