"""hack_jax.reference's steps, run through the paged reference (hack_jax.attention, impl="reference")
on caches from tests/twin.py: the softmax merge's edge cases, zero rows, constant V, hot keys, and
the quantization error against float attention (tier (c), printed with -s, bounded loosely). The
exact agreement with the float64 homomorphic twin, for every implementation, is in
test_attention_suite.py.
"""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

import twin
from hack_jax import attention
from hack_jax.config import QuantConfig
from hack_jax.reference import SoftmaxState, empty_softmax_state, online_softmax_merge, softmax_state_output

LAYOUTS = ("kivi", "seed")
TIGHT = 64 * float(np.finfo(np.float32).eps)  # relative to max|V|, as in test_attention_suite


def decode(q, cache):
    return np.asarray(attention.decode_attention(q, cache.layer, page_indices=cache.table,
                                                 kv_lens=cache.lengths))


def rel_fro(x, ref):
    return float(np.linalg.norm(np.asarray(x, np.float64) - ref) / np.linalg.norm(ref))


def test_online_softmax_merge_of_empty_states_is_finite():
    empty = empty_softmax_state((3,), 4)
    merged = online_softmax_merge(empty, empty)
    assert np.all(np.asarray(merged.m) == -np.inf)
    np.testing.assert_array_equal(softmax_state_output(merged), 0)
    one = SoftmaxState(jnp.ones((3, 4)) * 2, jnp.array([0.0, 1.0, -jnp.inf]), jnp.array([1.0, 2.0, 0.0]))
    out = softmax_state_output(online_softmax_merge(empty, one))
    np.testing.assert_allclose(out, [[2.0] * 4, [1.0] * 4, [0.0] * 4])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_zero_query_and_key_rows_are_finite(layout):
    """All-zero query rows and zero key rows in a sink, sealed blocks and the open block."""
    config = QuantConfig(layout=layout, partition_size=32, page_size=128)
    lengths = (140, 70, 3)
    k, v = twin.make_kv((3, 140, 1, 64), seed=3)
    k[:, [0, 10, 100, 131]] = 0
    cache = twin.build(config, lengths, kv=(k, v))
    q = np.random.default_rng(4).standard_normal((3, 2, 64)).astype(np.float32)
    q[0, 1] = 0
    q[2] = 0
    out = decode(q, cache)
    want = twin.np_cache_attention(q[:, None], cache, (cache.lengths - 1)[:, None])[:, 0]
    assert np.isfinite(out).all()
    assert np.abs(out - want).max() <= TIGHT * np.abs(v).max()


# ------------------------------------------------------------------------------------------------
# Tier (c): quantization error against float attention on the unquantized inputs
# ------------------------------------------------------------------------------------------------

TIER_C_LENGTHS = (300, 200)
OUTLIER_CHANNELS = (5, 40)


@pytest.fixture(scope="module")
def tier_c_errors():
    """{(inputs, layout, impl): ||out - float64 attention|| / ||float64 attention||} for decode at
    P = 64, 4 sinks: impl "hack" (the reference on the codes) or "dequant" (the float64 twin's plain
    dequantize-then-attend on the same pages)."""
    rng = np.random.default_rng(11)
    q = (1.5 * rng.standard_normal((2, 4, 64))).astype(np.float32)
    k, v = twin.make_kv((2, 300, 2, 64), seed=11, exact=False)
    outlier = np.isin(np.arange(64), OUTLIER_CHANNELS)
    # LLM keys have a few channels of consistently large magnitude (KIVI §3): "outlier" adds 20 to
    # two channels (|k| ~ 20x the others', spread unchanged); "outlier_x20" scales them by 20
    # (magnitude and spread), which also makes those channels coarse for the per-channel layout.
    inputs = {"random": k, "outlier": k + 20 * outlier, "outlier_x20": k * np.where(outlier, 20, 1)}
    errors = {}
    for name, kk in inputs.items():
        kk = kk.astype(np.float32)
        ref = np.stack([twin.np_attention(q[s][None], kk[s, :n], v[s, :n])[0]
                        for s, n in enumerate(TIER_C_LENGTHS)])
        for layout in LAYOUTS:
            cache = twin.build(QuantConfig(layout=layout), TIER_C_LENGTHS, kv=(kk, v))
            plain = twin.np_cache_attention(q[:, None], cache, (cache.lengths - 1)[:, None],
                                            transient_int8=False)[:, 0]
            errors[name, layout, "hack"] = rel_fro(decode(q, cache), ref)
            errors[name, layout, "dequant"] = rel_fro(plain, ref)
    print("\ntier (c), decode, P=64, 4 sinks, relative Frobenius error vs float64 attention:")
    for key, err in errors.items():
        print(f"  {key[0]:12s} {key[1]:5s} {key[2]:8s} {err:.4f}")
    return errors


def test_tier_c_kivi_beats_seed_on_outlier_channels(tier_c_errors):
    assert tier_c_errors["outlier", "kivi", "hack"] < 0.5 * tier_c_errors["outlier", "seed", "hack"]
    assert tier_c_errors["outlier_x20", "kivi", "hack"] < tier_c_errors["outlier_x20", "seed", "hack"]
    assert tier_c_errors["random", "kivi", "hack"] < tier_c_errors["random", "seed", "hack"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("inputs", ["random", "outlier", "outlier_x20"])
def test_tier_c_int8_transients_add_little(tier_c_errors, layout, inputs):
    """The 2-bit K/V dominate the error: INT8 transients add at most 25% on top of dequant."""
    hack, deq = tier_c_errors[inputs, layout, "hack"], tier_c_errors[inputs, layout, "dequant"]
    assert hack <= 1.25 * deq + 1e-3


# ------------------------------------------------------------------------------------------------
# Constant V, hot keys among cold ones (4096 keys, one kv head)
# ------------------------------------------------------------------------------------------------

LONG = 4096
HOT = np.array([1, 100, 101, 777, 2048, 3000, 4093, 4095])  # sink, sealed blocks, open block
CONSTANTS = np.array([0.375, -1.25], np.float32)  # exact in bfloat16 and float16


@functools.lru_cache(maxsize=None)
def long_qk():
    """Row 0: random q, k (logits of O(1)); row 1: 8 hot keys exactly 10 logits above 4088 cold
    (sm_scale 1/8 at head_dim 64: q = 80/3 on channel 0, k = 3 there)."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 2, 64)).astype(np.float32)
    k, _ = twin.make_kv((2, LONG, 1, 64), seed=5)
    q[1], k[1] = 0, 0
    q[1, :, 0] = 80 / 3
    k[1, HOT, :, 0] = 3  # 2-bit exact: per channel {0, 3} (kivi), per token {0, 3} (seed)
    return q, k


@pytest.mark.parametrize("layout", LAYOUTS)
def test_constant_v_is_returned(layout):
    q, k = long_qk()
    v = np.broadcast_to(CONSTANTS[:, None, None, None], k.shape).astype(np.float32)
    out = decode(q, twin.build(QuantConfig(layout=layout), (LONG, LONG), kv=(k, v)))
    err = np.max(np.abs(out - CONSTANTS[:, None, None]) / np.abs(CONSTANTS)[:, None, None])
    print(f"\n{layout}: constant V over {LONG} keys, max relative error {err:.1e}")
    assert err <= 1e-5  # the design normalizes with the weights of the numerator: exact up to rounding


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hot_keys_among_cold_keys(layout):
    q, k = long_qk()
    v = np.zeros_like(k)
    v[:, HOT] = 1  # output = attention mass on the hot keys
    out = decode(q, twin.build(QuantConfig(layout=layout), (LONG, LONG), kv=(k, v)))
    want = 8 * np.exp(10) / (8 * np.exp(10) + 4088)
    np.testing.assert_allclose(twin.np_attention(q[1][None], k[1], v[1])[0], want, rtol=1e-6)
    print(f"\n{layout}: hot-key mass {out[1].mean():.5f} (exact {want:.5f})")
    # Cold weights e^-10 inside a hot block round to INT8 code 0 (their share is lost from the
    # quantized sums: seed's denominator loses ~0.2% of the mass), V's 2-bit metadata is float16.
    np.testing.assert_allclose(out[1], want, atol=5e-3)
