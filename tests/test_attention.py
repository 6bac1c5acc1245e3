"""hack_jax.attention (the dispatch) over paged caches, impl="reference".

Tiers (STYLE.md): for hack the paged reference must equal hack_jax.reference's unpaged
homomorphic_attention_reference on the same raw K/V, tight (a prefill of bf16-exact K/V stores the
codes quantize_kv_reference computes, and the open block/sinks hold the same bf16 values); for
bf16/float32/int8 it must equal an independent float64 NumPy attention over the dequantized cache,
tight. The quantization error itself (hack vs dequantized dense attention, and vs float attention on
the raw K/V) is measured and bounded loosely, and printed (run with -s to see the numbers).
Caches come from test_kv_cache's shared geometry (same compiled writers, memoized).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hack_jax import attention, kv_cache, paging, reference
from hack_jax.config import QuantConfig
from test_kv_cache import (FORMATS, HOWS, LENGTHS, append_jit, empty_layer, make_kv,
                           prefill_jit, shuffled_table, written)

NUM_Q_HEADS = 4  # GQA group of 2 over the 2 kv heads
HACK = ["kivi", "seed"]
DENSE = ["bf16", "float32", "int8"]

decode_jit = jax.jit(attention.decode_attention, static_argnames="impl")
prefill_jit_attn = jax.jit(attention.prefill_attention, static_argnames="impl")


def make_q(q_len=None, seed=5):
    rng = np.random.default_rng(seed)
    shape = (len(LENGTHS),) + ((q_len,) if q_len else ()) + (NUM_Q_HEADS, 128)
    return rng.standard_normal(shape).astype(np.float32)


def np_attention(q, k, v, causal_offset=None):
    """float64 softmax attention of one sequence: q [T, Hq, D], k/v [n, H, D] -> [T, Hq, D].
    causal_offset: query t sits at position causal_offset + t (None: sees all keys)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # [n, Hq, D]
    logits = np.einsum("thd,nhd->htn", q, k) / np.sqrt(q.shape[-1])
    if causal_offset is not None:
        pos = causal_offset + np.arange(q.shape[0])
        logits = np.where(np.arange(k.shape[0])[None, None, :] <= pos[None, :, None], logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    return np.einsum("htn,nhd->thd", w / w.sum(-1, keepdims=True), v)


def np_decode_on_cache(q, layer, lengths, table):
    """The float64 oracle on the cache's own dequantized contents (kv_cache.gather)."""
    out = np.zeros(q.shape)
    for s, n in enumerate(lengths):
        if n:
            k_hat, v_hat = kv_cache.gather(layer, s, int(n), table)
            out[s] = np_attention(q[s][None], k_hat, v_hat)[0]
    return out


def hack_reference(fmt, q, k, v, lengths, causal=True):
    config = FORMATS[fmt]
    return np.asarray(reference.homomorphic_attention_reference(
        q, k, v, causal=causal, kv_lens=jnp.asarray(lengths), layout=config.layout,
        partition_size=config.partition_size, num_sink_tokens=config.num_sink_tokens))


def rel_err(a, b):
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(b).max())


@pytest.mark.parametrize("fmt", DENSE)
def test_decode_dense_formats_match_float64_numpy(fmt):
    layer, _, _, lengths, table = written(fmt, "both")
    q = make_q()
    out = decode_jit(q, layer, page_indices=table, kv_lens=lengths)
    np.testing.assert_allclose(out, np_decode_on_cache(q, layer, lengths, table), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cap", [None, 300])
@pytest.mark.parametrize("fmt", HACK)
def test_decode_hack_matches_homomorphic_reference(fmt, cap):
    """Paged reference == unpaged reference on the raw K/V, for caches written by prefill, by
    appends and by both (cap 300: the memoized caches of the identical-bytes test)."""
    q = make_q()
    for how in HOWS if cap else ("prefill",):
        layer, k, v, lengths, table = written(fmt, how, exact=True, cap=cap)
        out = decode_jit(q, layer, page_indices=table, kv_lens=lengths)
        want = hack_reference(fmt, q[:, None], k, v, lengths)[:, 0]
        np.testing.assert_allclose(out, want, rtol=0, atol=2e-6 * np.abs(want).max())


@pytest.mark.parametrize("fmt", HACK + ["float32"])
def test_prefill_attention_is_causal_over_the_cache(fmt):
    """Left-aligned queries (row t at position t) over a ragged prefill; rows past a prompt are 0.
    hack: == the unpaged reference (right-aligned there: its row T - n + t is our row t). Lengths
    capped at 300 (the memoized caches) and T = 320 query rows keep the int32 einsums cheap on CPU."""
    layer, k, v, lengths, table = written(fmt, "prefill", exact=True, cap=300)
    t_len = 320
    q = make_q(t_len)
    out = np.asarray(prefill_jit_attn(q, layer, page_indices=table, kv_lens=lengths))
    if fmt in HACK:
        shifted = np.stack([np.roll(q[s], t_len - n, axis=0) for s, n in enumerate(lengths)])
        want = hack_reference(fmt, shifted, k[:, :t_len], v[:, :t_len], lengths)
    for s, n in enumerate(lengths):
        assert (out[s, n:] == 0).all()
        if fmt in HACK:
            np.testing.assert_allclose(out[s, :n], want[s, t_len - n:], rtol=0,
                                       atol=2e-6 * np.abs(want).max())
        else:
            np.testing.assert_allclose(out[s, :n], np_attention(q[s, :n], k[s, :n], v[s, :n], 0),
                                       rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["kivi", "float32"])
def test_prefill_attention_q_start_shifts_the_queries(fmt):
    """q_start (chunked prefill): row t of a chunk is the query at position q_start + t; it equals
    row q_start + t of the left-aligned prefill over the same cache, and rows at or past kv_lens
    are 0. q_start 0 is the default."""
    layer, _, _, lengths, table = written(fmt, "prefill", exact=True, cap=300)
    t_len = 320
    q = make_q(t_len)
    starts = np.minimum([0, 2, 4, 5, 68, 67, 100, 132, 200, 256, 299], lengths).astype(np.int32)
    shifted = np.zeros_like(q)
    for s, a in enumerate(starts):
        shifted[s, :t_len - a] = q[s, a:]
    full = np.asarray(prefill_jit_attn(q, layer, page_indices=table, kv_lens=lengths))
    chunk = np.asarray(prefill_jit_attn(shifted, layer, page_indices=table, kv_lens=lengths,
                                        q_start=starts))
    zero = np.asarray(prefill_jit_attn(q, layer, page_indices=table, kv_lens=lengths,
                                       q_start=0 * starts))
    np.testing.assert_array_equal(zero, full)
    for s, (a, n) in enumerate(zip(starts, lengths)):
        np.testing.assert_allclose(chunk[s, :n - a], full[s, a:n], rtol=0,
                                   atol=1e-6 * np.abs(full).max())
        assert (chunk[s, n - a:] == 0).all()
    with pytest.raises(ValueError, match="q_start"):
        attention.prefill_attention(q, layer, page_indices=table, kv_lens=lengths, q_start=starts[:2])


@pytest.mark.parametrize("fmt", HACK)
def test_quantization_error_tiers(fmt):
    """Tier (b): hack on the codes vs float64 attention over the same dequantized cache differs
    only by the INT8 quantization of Q and of the softmax weights. Tier (c): vs float attention on
    the unquantized K/V, the 2-bit quantization error (HACK.md §4: seed is the inaccurate layout).
    Bounds are loose ceilings over the measured values printed here."""
    layer, k, v, lengths, table = written(fmt, "both")
    q = make_q()
    out = np.asarray(decode_jit(q, layer, page_indices=table, kv_lens=lengths))
    tier_b = rel_err(out, np_decode_on_cache(q, layer, lengths, table))
    exact = np.stack([np_attention(q[s][None], k[s, :n], v[s, :n])[0] for s, n in enumerate(lengths)])
    tier_c = rel_err(out, exact)
    print(f"\n{fmt}: tier (b) vs dequantized {tier_b:.2e}, tier (c) vs float K/V {tier_c:.2e}")
    assert tier_b < 2e-2
    assert tier_c < (0.5 if fmt == "kivi" else 1.0)


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
