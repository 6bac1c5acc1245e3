"""Tests for hack_jax.reference against independent float64 NumPy oracles (tests/reference_oracles.py).

Tiers (STYLE.md): (b) homomorphic attention == the same semantics computed in float64 on the
dequantized codes, tight; (c) error against float attention on the unquantized inputs, printed
(`pytest -s`) and bounded loosely. Shapes are shared between tests where possible so that the
jitted references compile once per shape (compilation dominates the runtime on CPU).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hack_jax.reference import (
    SoftmaxState, dense_attention_reference, dequantize_kv_reference, dequantized_attention_reference,
    empty_softmax_state, homomorphic_attention_reference, online_softmax_merge,
    quantize_kv_reference, quantized_kv_attention_reference, softmax_state_output)
from reference_oracles import bf16, np_dense_attention, np_hack_attention

LAYOUTS = ("kivi", "seed")

# Tier (b) tolerance, relative to max|V| (outputs are convex combinations of V rows). Both sides
# compute the same values: the code in float32 with the four-term identity, the oracle in float64 on
# dequantized operands. Float32 rounding of logits and sums gives ~1e-6 (measured <= 1e-6); the
# remaining budget covers a transient INT8 code that rounds the other way in float32 than in
# float64 at a tie (one code step of one weight, <= max|V| / 255 / visible tokens).
TIER_B_RTOL = 1e-4
# Loose bound on the INT8 quantization of the transient operands alone (homomorphic vs plain
# dequantize-then-dense on the same codes), relative to max|V|. A Q code step moves a logit by
# ~ sqrt(Pc) * step / sqrt(12) * |k| ~ 1% of the Qt range; measured 1.3e-2 (kivi, which folds the
# K channel scales into Q first) and 7.7e-3 (seed) in the worst element, printed by the test.
TRANSIENT_INT8_RTOL = 3e-2


@dataclasses.dataclass(frozen=True)
class Case:
    q_len: int
    group: int  # num_q_heads // num_kv_heads
    num_kv_heads: int
    head_dim: int
    partition_size: int
    num_sink_tokens: int
    causal: bool
    kv_lens: tuple
    rounding: str = "nearest"
    sm_scale: float | None = None

    @property
    def kv_len(self):
        return max(self.kv_lens)


# Lengths off block boundaries: with P = 64 and ns = 4 a block ends at 68, 132; with ns = 0 at 64, 128.
CASES = {
    "prefill_g3_sinks": Case(5, 3, 2, 64, 64, 4, True, (1, 63, 64, 65, 130, 68, 132, 0)),
    "prefill_g7_nosinks": Case(3, 7, 1, 64, 64, 0, True, (1, 63, 64, 65, 130, 128, 0)),
    "decode_groups_stochastic": Case(1, 4, 2, 64, 32, 4, False, (100, 36, 37, 3), "stochastic", 0.3),
    "head_dim_below_p": Case(2, 1, 3, 32, 64, 2, False, (140, 66, 65)),
}


def make_inputs(case, seed=0):
    rng = np.random.default_rng(seed)
    batch, num_q_heads = len(case.kv_lens), case.group * case.num_kv_heads
    q = 1.5 * rng.normal(size=(batch, case.q_len, num_q_heads, case.head_dim))
    # Per-channel offsets and spreads, as real keys have, so per-channel and per-token scales differ.
    k = (rng.normal(size=(batch, case.kv_len, case.num_kv_heads, case.head_dim))
         * rng.uniform(0.5, 2, size=case.head_dim) + rng.normal(size=case.head_dim))
    v = rng.normal(size=(batch, case.kv_len, case.num_kv_heads, case.head_dim))
    return q.astype(np.float32), k.astype(np.float32), v.astype(np.float32)


def rbg_key(seed):
    # "rbg" keys: jitted threefry sampling takes ~10 s to compile on CPU per quantize call site.
    return jax.random.key(seed, impl="rbg")


def quant_kwargs(case, key=None):
    return dict(partition_size=case.partition_size, num_sink_tokens=case.num_sink_tokens,
                rounding=case.rounding, key=rbg_key(7) if key is None else key)


def max_rel(x, y, v):
    return float(np.max(np.abs(np.asarray(x, np.float64) - y)) / np.max(np.abs(v)))


def rel_fro(x, ref):
    return float(np.linalg.norm(np.asarray(x, np.float64) - ref) / np.linalg.norm(ref))


# ------------------------------------------------------------------------------------------------
# Dense reference
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("group", [1, 3, 4, 7])
@pytest.mark.parametrize("causal", [False, True])
def test_dense_matches_float64(group, causal):
    rng = np.random.default_rng(group)
    batch, q_len, kv_heads, head_dim, kv_len = 4, 3, 2, 16, 37
    q = rng.normal(size=(batch, q_len, group * kv_heads, head_dim)).astype(np.float32)
    k, v = rng.normal(size=(2, batch, kv_len, kv_heads, head_dim)).astype(np.float32)
    kv_lens = np.array([37, 20, 1, 0], np.int32)
    v[1, 20:] = np.nan  # padding beyond kv_lens must not leak

    out = np.asarray(dense_attention_reference(q, k, v, causal=causal, kv_lens=kv_lens))
    want = np_dense_attention(q, k, v, causal=causal, kv_lens=kv_lens)
    assert out.dtype == np.float32 and out.shape == q.shape
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    assert np.all(out[3] == 0), "a sequence of length 0 returns 0"
    if causal:
        assert np.all(out[2, :2] == 0), "queries before position 0 see no key"


def test_dense_default_lengths_and_sm_scale():
    rng = np.random.default_rng(1)
    q = rng.normal(size=(2, 4, 6, 8)).astype(np.float32)
    k, v = rng.normal(size=(2, 2, 9, 3, 8)).astype(np.float32)
    out = dense_attention_reference(q, k, v, causal=True, sm_scale=0.7)
    np.testing.assert_allclose(out, np_dense_attention(q, k, v, causal=True, sm_scale=0.7),
                               rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# The quantized K/V container
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_quantized_kv_holds_the_right_tokens(layout):
    """Sealed blocks reconstruct their own tokens within scale / 2, sums are the code sums of the
    right axes, the residual holds exactly the 16-bit tokens, dequantize_kv matches (float64)."""
    case = CASES["prefill_g3_sinks"]
    _, k, v = make_inputs(case)
    kv_lens = np.array(case.kv_lens, np.int32)
    qkv = quantize_kv_reference(k, v, kv_lens=kv_lens, layout=layout, **quant_kwargs(case))
    P, ns, D = case.partition_size, case.num_sink_tokens, case.head_dim
    Pc = min(P, D)
    kc, vc = np.asarray(qkv.k_codes, np.int64), np.asarray(qkv.v_codes, np.int64)
    assert kc.max() <= 3 and vc.max() <= 3
    np.testing.assert_array_equal(qkv.k_sums, kc.reshape(*kc.shape[:-1], D // Pc, Pc).sum(-1))
    np.testing.assert_array_equal(qkv.v_sums, vc.sum(3))
    k_hat, v_hat = (np.asarray(x, np.float64) for x in dequantize_kv_reference(qkv))
    rep = lambda m: np.repeat(np.asarray(m, np.float64), Pc, axis=-1)

    for b, n in enumerate(case.kv_lens):
        num_sealed = max(n - ns, 0) // P
        for h in range(case.num_kv_heads):
            for blk in range(num_sealed):
                toks = slice(ns + blk * P, ns + (blk + 1) * P)
                kx, vx = k[b, toks, h], v[b, toks, h]
                if layout == "kivi":
                    ks, km = qkv.k_scale[b, h, blk][None], qkv.k_min[b, h, blk][None]
                    vs, vm = rep(qkv.v_scale[b, h, blk]), rep(qkv.v_min[b, h, blk])
                else:
                    ks, km = rep(qkv.k_scale[b, h, blk]), rep(qkv.k_min[b, h, blk])
                    vs, vm = qkv.v_scale[b, h, blk][None], qkv.v_min[b, h, blk][None]
                for x, codes, s, m, x_hat in ((kx, kc, ks, km, k_hat), (vx, vc, vs, vm, v_hat)):
                    s, m = np.asarray(s, np.float64), np.asarray(m, np.float64)
                    recon = s * codes[b, h, blk] + m
                    assert np.all(np.abs(recon - x) <= s / 2 + 1e-5 * (1 + np.abs(x)))
                    np.testing.assert_allclose(x_hat[b, toks, h], recon, rtol=1e-6, atol=1e-6)
            k_16 = np.arange(case.kv_len) < (min(ns, n) if layout == "seed" else n)
            v_16 = np.arange(case.kv_len) < n
            sealed = (np.arange(case.kv_len) >= ns) & (np.arange(case.kv_len) < ns + num_sealed * P)
            for x, res, keep in ((k, qkv.k_residual, k_16 & ~sealed), (v, qkv.v_residual, v_16 & ~sealed)):
                np.testing.assert_array_equal(np.asarray(res[b, h], np.float64),
                                              np.where(keep[:, None], bf16(x[b, :, h]), 0))
            np.testing.assert_array_equal(v_hat[b, n:], 0)
            np.testing.assert_array_equal(k_hat[b, n:], 0)


# ------------------------------------------------------------------------------------------------
# Tier (b): attention on codes == the same semantics on dequantized operands (float64)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(CASES))
def test_tier_b_homomorphic_matches_float64_oracle(name, layout):
    case = CASES[name]
    q, k, v = make_inputs(case)
    kv_lens = np.array(case.kv_lens, np.int32)
    qkv = quantize_kv_reference(k, v, kv_lens=kv_lens, layout=layout, **quant_kwargs(case))
    out = np.asarray(quantized_kv_attention_reference(q, qkv, causal=case.causal, sm_scale=case.sm_scale))
    want = np_hack_attention(q, k, v, qkv, causal=case.causal, sm_scale=case.sm_scale)
    assert out.shape == q.shape and np.all(np.isfinite(out))
    err = max_rel(out, want, v)
    print(f"\ntier (b) {name} {layout}: max |hack - float64 oracle| / max|V| = {err:.2e}")
    assert err <= TIER_B_RTOL
    assert np.all(out[kv_lens == 0] == 0)
    if name == "decode_groups_stochastic":  # once: every call shape compiles anew (seconds on CPU)
        # The one-call entry point computes the same (compiled as one program: equal up to rounding).
        same = homomorphic_attention_reference(q, k, v, causal=case.causal, kv_lens=kv_lens,
                                               layout=layout, sm_scale=case.sm_scale, **quant_kwargs(case))
        assert max_rel(same, want, v) <= TIER_B_RTOL


@pytest.mark.parametrize("layout", LAYOUTS)
def test_transient_int8_error_vs_plain_dequantized_attention(layout):
    """Homomorphic vs plain dequantize-then-dense on the same codes: the INT8 transients' error."""
    case = CASES["prefill_g3_sinks"]
    q, k, v = make_inputs(case)
    kv_lens = np.array(case.kv_lens, np.int32)
    qkv = quantize_kv_reference(k, v, kv_lens=kv_lens, layout=layout, **quant_kwargs(case))
    plain = np_hack_attention(q, k, v, qkv, causal=case.causal, transient_int8=False)
    k_hat, v_hat = dequantize_kv_reference(qkv)
    np.testing.assert_allclose(plain, np_dense_attention(q, k_hat, v_hat, causal=True, kv_lens=kv_lens),
                               rtol=1e-9, atol=1e-9)  # merging per block is the same float64 math
    deq = dequantized_attention_reference(q, k, v, causal=True, kv_lens=kv_lens, layout=layout,
                                          **quant_kwargs(case))
    assert max_rel(deq, plain, v) <= 1e-5
    hack = quantized_kv_attention_reference(q, qkv, causal=True)
    err = max_rel(hack, plain, v)
    print(f"\n{layout}: INT8 transient error vs dequantized float attention: max / max|V| = {err:.2e}, "
          f"relative Frobenius = {rel_fro(hack, plain):.2e}")
    assert err <= TRANSIENT_INT8_RTOL


@pytest.mark.parametrize("layout", LAYOUTS)
def test_zero_query_and_key_rows_are_finite(layout):
    case = CASES["prefill_g3_sinks"]
    q, k, v = make_inputs(case, seed=3)
    q[4, 2, 1] = 0  # one all-zero query row
    q[6] = 0  # a whole sequence of zero queries
    k[:, [0, 10, 100, 131], 0] = 0  # zero key rows in a sink, sealed blocks and open blocks
    kv_lens = np.array(case.kv_lens, np.int32)
    qkv = quantize_kv_reference(k, v, kv_lens=kv_lens, layout=layout, **quant_kwargs(case))
    out = np.asarray(quantized_kv_attention_reference(q, qkv, causal=True))
    assert np.all(np.isfinite(out))
    assert max_rel(out, np_hack_attention(q, k, v, qkv, causal=True), v) <= TIER_B_RTOL


# ------------------------------------------------------------------------------------------------
# Tier (c): quantization error against float attention on the unquantized inputs
# ------------------------------------------------------------------------------------------------

TIER_C = Case(1, 2, 2, 64, 64, 4, True, (300, 200))
OUTLIER_CHANNELS = (5, 40)  # in different channel groups when P = 32


@pytest.fixture(scope="module")
def tier_c_errors():
    """{(inputs, layout, impl): ||out - float64 dense|| / ||float64 dense||} for decode at P = 64."""
    case = TIER_C
    q, k, v = make_inputs(case, seed=11)
    outlier = np.isin(np.arange(case.head_dim), OUTLIER_CHANNELS)
    # LLM keys have a few channels of consistently large magnitude (KIVI §3): "outlier" adds 20 to
    # two channels (|k| ~ 20x the others' ~1, spread unchanged); "outlier_x20" scales them by 20
    # (magnitude and spread), which also makes those channels coarse for the per-channel layout.
    inputs = {"random": k, "outlier": k + 20 * outlier, "outlier_x20": k * np.where(outlier, 20, 1)}
    kv_lens = np.array(case.kv_lens, np.int32)
    errors = {}
    for name, kk in inputs.items():
        kk = kk.astype(np.float32)
        ref = np_dense_attention(q, kk, v, causal=True, kv_lens=kv_lens)
        for layout in LAYOUTS:
            for impl, fn in (("hack", homomorphic_attention_reference),
                             ("dequant", dequantized_attention_reference)):
                out = fn(q, kk, v, causal=True, kv_lens=kv_lens, layout=layout, **quant_kwargs(case))
                errors[name, layout, impl] = rel_fro(out, ref)
    print("\ntier (c), decode, P=64, 4 sinks, relative Frobenius error vs float64 dense attention:")
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
# Constant V, hot keys among cold ones
# ------------------------------------------------------------------------------------------------

LONG = Case(1, 2, 1, 64, 64, 4, False, (4096, 4096), sm_scale=1.0)
HOT = np.array([1, 100, 101, 777, 2048, 3000, 4093, 4095])  # sink, sealed blocks, open block
CONSTANTS = np.array([0.375, -1.25], np.float32)  # exact in bfloat16 and float16


def long_inputs():
    """Row 0: random q, k (logits of O(1)); row 1: 8 hot keys exactly 10 logits above 4088 cold."""
    case = LONG
    q, k, _ = make_inputs(case, seed=5)
    q[0] *= 0.125
    q[1], k[1] = 0, 0
    q[1, :, :, 0] = 10 / 3  # sm_scale = 1: logit = 10/3 * k[..., 0]
    k[1, HOT, :, 0] = 3  # 2-bit exact: per channel {0, 3} (kivi), per token {0, 3} (seed)
    return q, k


@pytest.mark.parametrize("layout", LAYOUTS)
def test_constant_v_is_returned(layout):
    q, k = long_inputs()
    v = np.broadcast_to(CONSTANTS[:, None, None, None], k.shape).astype(np.float32)
    out = np.asarray(homomorphic_attention_reference(q, k, v, causal=False, layout=layout,
                                                     sm_scale=1.0, **quant_kwargs(LONG)))
    err = np.max(np.abs(out - CONSTANTS[:, None, None, None]) / np.abs(CONSTANTS)[:, None, None, None])
    print(f"\n{layout}: constant V over 4096 keys, max relative error {err:.1e}")
    assert err <= 1e-5  # the design normalizes with the weights of the numerator: exact up to rounding


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hot_keys_among_cold_keys(layout):
    q, k = long_inputs()
    v = np.zeros_like(k)
    v[:, HOT] = 1  # output = attention mass on the hot keys
    out = np.asarray(homomorphic_attention_reference(q, k, v, causal=False, layout=layout,
                                                     sm_scale=1.0, **quant_kwargs(LONG)))
    want = 8 * np.exp(10) / (8 * np.exp(10) + 4088)
    np.testing.assert_allclose(np_dense_attention(q, k, v, causal=False, sm_scale=1.0)[1], want, rtol=1e-7)
    print(f"\n{layout}: hot-key mass {out[1].mean():.5f} (exact {want:.5f})")
    # Cold weights e^-10 inside a hot block round to INT8 code 0 (their share is lost from the
    # quantized sums: seed's denominator loses ~0.2% of the mass), V's 2-bit metadata is float16.
    np.testing.assert_allclose(out[1], want, atol=5e-3)


# ------------------------------------------------------------------------------------------------
# Determinism, merge, validation
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_deterministic(layout):
    case = CASES["decode_groups_stochastic"]
    q, k, v = make_inputs(case)
    kv_lens = np.array(case.kv_lens, np.int32)
    run = lambda key: homomorphic_attention_reference(
        q, k, v, causal=False, kv_lens=kv_lens, layout=layout, sm_scale=case.sm_scale,
        **quant_kwargs(case, key))
    np.testing.assert_array_equal(run(rbg_key(1)), run(rbg_key(1)))
    codes = lambda key: quantize_kv_reference(k, v, kv_lens=kv_lens, layout=layout,
                                              **quant_kwargs(case, key)).k_codes
    np.testing.assert_array_equal(codes(rbg_key(1)), codes(rbg_key(1)))
    assert np.any(codes(rbg_key(1)) != codes(rbg_key(2))), "stochastic rounding uses the key"


def test_online_softmax_merge_of_empty_states_is_finite():
    empty = empty_softmax_state((3,), 4)
    merged = online_softmax_merge(empty, empty)
    assert np.all(np.asarray(merged.m) == -np.inf)
    np.testing.assert_array_equal(softmax_state_output(merged), 0)
    one = SoftmaxState(jnp.ones((3, 4)) * 2, jnp.array([0.0, 1.0, -jnp.inf]), jnp.array([1.0, 2.0, 0.0]))
    out = softmax_state_output(online_softmax_merge(empty, one))
    np.testing.assert_allclose(out, [[2.0] * 4, [1.0] * 4, [0.0] * 4])


def _shapes(q=(1, 2, 4, 64), k=(1, 70, 2, 64)):
    return jnp.zeros(q, jnp.float32), jnp.zeros(k, jnp.float32), jnp.zeros(k, jnp.float32)


@pytest.mark.parametrize("kwargs, match", [
    (dict(q_shape=(1, 2, 3, 64)), "num_q_heads"),
    (dict(q_shape=(1, 2, 4, 32)), "head_dim"),
    (dict(q_shape=(2, 2, 4, 64)), "batch"),
    (dict(q_shape=(2, 4, 64)), "q must be 4-D"),
    (dict(kv_lens=jnp.zeros(3, jnp.int32)), "kv_lens"),
    (dict(kv_lens=jnp.zeros(1, jnp.float32)), "kv_lens"),
    (dict(layout="rows"), "layout='rows'"),
    (dict(partition_size=48), "partition_size=48"),
    (dict(partition_size=0), "partition_size=0"),
    (dict(num_sink_tokens=-1), "num_sink_tokens=-1"),
    (dict(rounding="up"), "rounding='up'"),
    (dict(rounding="stochastic"), "key=None"),
    (dict(sm_scale=float("nan")), "sm_scale"),
])
def test_validation(kwargs, match):
    kwargs = dict(kwargs)
    q, k, v = _shapes(q=kwargs.pop("q_shape", (1, 2, 4, 64)))
    with pytest.raises(ValueError, match=match):
        homomorphic_attention_reference(q, k, v, causal=True, **kwargs)


def test_validation_dense_and_v_shape():
    q, k, v = _shapes()
    with pytest.raises(ValueError, match="k and v shapes differ"):
        dense_attention_reference(q, k, v[:, :10], causal=False)
    with pytest.raises(ValueError, match="num_q_heads"):
        dense_attention_reference(q[:, :, :3], k, v, causal=False)
    with pytest.raises(ValueError, match="floating"):
        dense_attention_reference(q.astype(jnp.int32), k, v, causal=False)
