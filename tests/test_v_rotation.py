"""QuantConfig.v_rotation as a real cache format: V stored rotated by a block-diagonal Hadamard
matrix, every attention path rotating its output back (hack_jax.rotation, hack_jax.attention).

The float64 twin (tests/twin.py) sees the cache as it is stored: its K/V inputs are the rotated V,
W = V R with R built here from scipy's Hadamard matrix in float64, and its output is rotated back
by R in float64. The written V is V = W R with W rounded to bf16 first, so the rotation the library
computes in float32 lands within 1e-7 of W and the 16-bit parts (sinks, open block) store exactly
bf16(W), what the twin reads: the comparison is at the attention suite's tolerances.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg

import twin
from hack_jax import attention, kv_cache, prefill
from hack_jax.config import QuantConfig
from test_attention_suite import HEAD_DIM, LENGTHS, NUM_KV_HEADS, NUM_Q_HEADS, PREFILL_T, Q_START, check, make_q

P, PAGE = 32, 128


def rot(block, d=HEAD_DIM):
    """R f64[d, d]: block-diagonal normalized Hadamard(block), independent of hack_jax.rotation."""
    return np.kron(np.eye(d // block), scipy.linalg.hadamard(block) / math.sqrt(block))


def rotated_cache(config, how="both", lengths=LENGTHS, seed=0):
    """(cache as written with V, the twin's view of it: v replaced by the stored W = V R)."""
    lengths = np.asarray(lengths, np.int32)
    k, w = twin.make_kv((len(lengths), int(lengths.max()), NUM_KV_HEADS, HEAD_DIM), seed)
    v = (w.astype(np.float64) @ rot(config.v_rotation)).astype(np.float32)  # R is its own inverse
    cache = twin.build(config, lengths, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, how=how, kv=(k, v),
                       seed=seed)
    return cache, dataclasses.replace(cache, v=w)


CONFIGS = {
    "kivi-r32": QuantConfig(partition_size=P, page_size=PAGE, v_rotation=32),
    "kivi-r64": QuantConfig(partition_size=P, page_size=PAGE, v_rotation=64),
    "int8-r64": QuantConfig(kv_format="int8", partition_size=P, page_size=PAGE, v_rotation=64),
}
CASES = [("kivi-r32", "reference"), ("kivi-r64", "reference"), ("kivi-r64", "interpret"),
         ("int8-r64", "reference"), pytest.param("kivi-r64", "gpu", marks=pytest.mark.gpu)]


def _impl(impl):
    return dict(impl="reference") if impl == "reference" else dict(impl="pallas", interpret=impl == "interpret")


def _fmt(name):
    return "int8" if name.startswith("int8") else "kivi"


@pytest.mark.parametrize("name, impl", CASES)
def test_decode_unrotates_output(name, impl):
    cfg = CONFIGS[name]
    cache, stored = rotated_cache(cfg, how="both" if _fmt(name) == "kivi" else "prefill")
    q = make_q((len(LENGTHS), NUM_Q_HEADS, HEAD_DIM))
    out = np.asarray(attention.decode_attention(q, cache.layer, page_indices=cache.table,
                                                kv_lens=cache.lengths, **_impl(impl)))
    want = twin.np_cache_attention(q[:, None], stored, (cache.lengths - 1)[:, None])[:, 0] @ rot(cfg.v_rotation)
    check(out, want, stored, impl, _fmt(name))
    assert (out[cache.lengths == 0] == 0).all()


@pytest.mark.parametrize("name, impl", [("kivi-r32", "reference"), ("kivi-r64", "interpret")])
def test_prefill_attention_unrotates_output(name, impl):
    cfg = CONFIGS[name]
    cache, stored = rotated_cache(cfg)
    q = make_q((len(LENGTHS), PREFILL_T, NUM_Q_HEADS, HEAD_DIM), seed=6)
    q_start = np.asarray(Q_START, np.int32)
    out = np.asarray(attention.prefill_attention(q, cache.layer, page_indices=cache.table,
                                                 kv_lens=cache.lengths, q_start=q_start, **_impl(impl)))
    q_pos = q_start[:, None] + np.arange(PREFILL_T)[None, :]
    check(out, twin.np_cache_attention(q, stored, q_pos) @ rot(cfg.v_rotation), stored, impl, "kivi")
    assert (out[q_pos >= cache.lengths[:, None]] == 0).all()


def test_cached_prefix_state_unrotates_accumulator():
    """acc / l of the prefix state is the attention over every cached token, in V's own basis."""
    cfg = CONFIGS["kivi-r64"]
    cache, stored = rotated_cache(cfg)
    q = make_q((len(LENGTHS), 3, NUM_Q_HEADS, HEAD_DIM), seed=7)
    st = attention.cached_prefix_state(q, cache.layer, page_indices=cache.table, kv_lens=cache.lengths)
    acc, l = np.asarray(st.acc, np.float64), np.asarray(st.l, np.float64)
    out = np.where(l[..., None] > 0, acc / np.where(l > 0, l, 1)[..., None], 0)
    q_pos = np.repeat((cache.lengths - 1)[:, None], 3, axis=1)
    check(out, twin.np_cache_attention(q, stored, q_pos) @ rot(cfg.v_rotation), stored, "reference", "kivi")


def test_chunked_prefill_over_a_rotated_float32_cache_is_exact_attention():
    """hack_jax.prefill over a float32 cache with V rotation, in two chunks: the second chunk's rows
    (cached prefix through cached_prefix_state, merged with the fresh tokens) equal float64 causal
    attention over the raw K/V (the rotation is invisible to the caller), and the cache holds V R."""
    cfg = QuantConfig(kv_format="float32", partition_size=P, page_size=PAGE, v_rotation=16)
    lengths = np.array([50, 37], np.int32)
    table, num_pages = twin.shuffled_table(cfg, lengths)
    k, v = twin.make_kv((2, 50, NUM_KV_HEADS, HEAD_DIM), 3, exact=False)
    q = make_q((2, 50, NUM_Q_HEADS, HEAD_DIM), seed=8)
    layer = kv_cache.init_layer(cfg, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, num_pages=num_pages,
                                max_seqs=2)
    layer, _ = prefill.prefill(q[:, :20], k[:, :20], v[:, :20], layer, page_indices=table,
                               lengths=np.array([20, 20], np.int32), attention="reference")
    layer, out = prefill.prefill(q[:, 20:], k[:, 20:], v[:, 20:], layer, page_indices=table,
                                 lengths=lengths - 20, q_start=np.array([20, 20], np.int32),
                                 attention="reference")
    out = np.asarray(out)
    for s, n in enumerate(lengths):
        want = twin.np_attention(q[s, 20:n], k[s, :n], v[s, :n], q_pos=np.arange(20, n))
        assert np.abs(out[s, :n - 20] - want).max() <= 1e-5 * np.abs(v).max()
    got_k, got_v = twin.gather(layer, 0, 50, table)
    np.testing.assert_allclose(got_k, k[0], atol=1e-6)
    np.testing.assert_allclose(got_v, v[0].astype(np.float64) @ rot(16), atol=1e-5)


def test_head_dim_must_be_a_multiple_of_the_rotation():
    with pytest.raises(ValueError, match="v_rotation=64"):
        kv_cache.init_layer(QuantConfig(v_rotation=64), num_kv_heads=1, head_dim=32, num_pages=2, max_seqs=1)


def test_fused_decode_step_stores_rotated_v_and_unrotates():
    """The fused Pallas step (interpret mode) on a rotated cache: the same bytes as kv_cache.append
    and the twin's attention rotated back."""
    cfg = CONFIGS["kivi-r64"]
    before = np.array([2, 4, 40, 133], np.int32)  # sink, first open row, open rows: no block fills
    active, after = np.ones(4, bool), before + 1
    k, w = twin.make_kv((4, int(after.max()), NUM_KV_HEADS, HEAD_DIM), 4)
    v = (w.astype(np.float64) @ rot(64)).astype(np.float32)
    table, num_pages = twin.shuffled_table(cfg, after)
    layer = kv_cache.init_layer(cfg, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, num_pages=num_pages, max_seqs=4)
    layer = twin.write(layer, k, v, before, table)
    new = lambda x: jnp.asarray(x[np.arange(4), before])
    q = jnp.asarray(make_q((4, NUM_Q_HEADS, HEAD_DIM), seed=9))
    got, out = attention.decode_step(q, new(k), new(v), layer, page_indices=table, kv_lens=after, active=active,
                                     impl="pallas", seal="never", fuse=True, interpret=True)
    want = kv_cache.append(layer, new(k), new(v), kv_lens=after, active=active, page_indices=table, seal="never")
    for name in ("open_k", "open_v", "sink_k", "sink_v"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), err_msg=name)
    stored = twin.Cache(want, k, w, after, table)
    oracle = twin.np_cache_attention(np.asarray(q)[:, None], stored, (after - 1)[:, None])[:, 0] @ rot(64)
    check(np.asarray(out), oracle, stored, "interpret", "kivi")
