"""QuantConfig.clip / quantize(clip=n): the least-squares search over shrunk [min, max] ranges.

The float64 NumPy search below (np_clip_quantize) is written from the contract (quantization.py's
module docstring), not from the code: candidates [lo + a w, hi - b w] for a, b in {0, 0.05, ...,
0.05 (n - 1)} (w = hi - lo), each rounded outward to float16 (minimum down, scale up, scale >= f16
tiny unless the range is empty), nearest (half-even) codes clamped to [0, L], the least sum of
squared errors, ties to the earliest with min-max first. The library sums errors in float32, so
where two candidates' float64 errors are within float32 noise it may pick the other one: there
the test asks only that its error equal the optimum to 1e-5 relative.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import twin
from hack_jax import attention
from hack_jax.config import QuantConfig
from hack_jax.quantization import dequantize, quantize
from test_attention_suite import check, make_q
from test_v_rotation import rot

F16 = np.float16
TINY = float(np.finfo(F16).tiny)


def _f16_toward(v, direction):
    """float64 v -> the nearest float16 at or below (direction < 0) / above (> 0), as float64."""
    y = v.astype(F16)
    over = (y < v) if direction > 0 else (y > v)
    return np.where(over, np.nextafter(y, F16(direction * np.inf)), y).astype(np.float64)


def np_clip_quantize(x, bits, n):
    """x f64[..., G, P] (partitions on the last axis) -> (codes, scale, minimum, err, errs): the
    chosen candidate's codes [..., G, P], scale / minimum / squared error [..., G], and every
    candidate's error [C, ..., G] (min-max first)."""
    levels = 2**bits - 1
    lo, hi = x.min(-1), x.max(-1)
    w = hi - lo
    grid = [(0.05 * a, 0.05 * b) for a in range(max(n, 1)) for b in range(max(n, 1))]  # (0, 0) first
    cands = []
    for a, b in grid:
        m = _f16_toward(lo + a * w, -1)
        top = hi - b * w
        s = np.where(top > m, np.maximum(_f16_toward((top - m) / levels, 1), TINY), 0.0)
        q = np.clip(np.rint((x - m[..., None]) / np.where(s > 0, s, 1.0)[..., None]), 0, levels)
        err = ((s[..., None] * q + m[..., None] - x) ** 2).sum(-1)
        cands.append((q, s, m, err))
    errs = np.stack([c[3] for c in cands])
    best = np.argmin(errs, axis=0)  # first of equal minima
    pick = lambda i: np.take_along_axis(np.stack([c[i] for c in cands]), best[None, ..., None] if i == 0
                                        else best[None], axis=0)[0]
    return pick(0), pick(1), pick(2), errs.min(0), errs


def make_data(seed=0):
    """f32[3, 8, 64]: normal rows, outliers, constant and zero partitions, a tiny-range one."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((3, 8, 64)).astype(np.float32)
    x[0, 1, 5] = 25.0  # one high outlier
    x[0, 2, [3, 40]] = [-30.0, 18.0]  # outliers at both ends
    x[1, 0] = 1.5  # constant (exactly in f16)
    x[1, 1] = 0.0
    x[1, 2] = 0.1  # constant not representable in f16
    x[1, 3] = 1e-3 * rng.standard_normal(64)
    x[2] = rng.exponential(size=(8, 64)) * 3.0  # skewed
    return x


def _sq_err(qt, x):
    return ((np.asarray(dequantize(qt), np.float64) - x) ** 2)


def _partitions(qt, axis, shape):
    """codes [3, 8, 4, 16], scale / minimum [3, 8, 4] of a quantize over test_data (axis -1) or its
    transpose (axis 1), partitions of 16 on the last axis, as float64."""
    codes, scale, minimum = (np.asarray(a, np.float64) for a in (qt.codes, qt.scale, qt.minimum))
    if axis == 1:
        codes, scale, minimum = (np.swapaxes(a, 1, 2) for a in (codes, scale, minimum))
    return codes.reshape(shape), scale.reshape(shape[:-1]), minimum.reshape(shape[:-1])


@pytest.mark.parametrize("bits, n, axis", [(2, 5, -1), (2, 3, 1), (4, 5, -1), (2, 6, -1)])
def test_search_matches_float64_reference(bits, n, axis):
    x = make_data()
    parts = x.reshape(3, 8, 4, 16).astype(np.float64)
    xin = jnp.asarray(np.swapaxes(x, 1, 2) if axis == 1 else x)  # axis 1: [3, 64, 8]
    qt = quantize(xin, bits=bits, axis=axis, partition_size=16, clip=n)
    got_codes, got_scale, got_min = _partitions(qt, axis, parts.shape)
    codes, scale, minimum, best, errs = np_clip_quantize(parts, bits, n)

    # Where every candidate with another error is clearly worse than the best (beyond float32
    # noise in the library's sums), the library picks what the float64 search picks.
    runner_up = np.where(errs > best, errs, np.inf).min(0)
    clear = runner_up - best > 1e-5 * best + 1e-12
    assert clear.mean() > 0.9, clear.mean()
    np.testing.assert_array_equal(got_scale[clear], scale[clear])
    np.testing.assert_array_equal(got_min[clear], minimum[clear])
    np.testing.assert_array_equal(got_codes[clear], codes[clear])
    got_err = ((got_scale[..., None] * got_codes + got_min[..., None] - parts) ** 2).sum(-1)
    np.testing.assert_allclose(got_err, best, rtol=1e-5, atol=1e-12)
    np.testing.assert_array_equal(np.asarray(qt.code_sums, np.int64).sum(), got_codes.sum())
    # the search did move ranges: some partitions clipped, below min-max's scale
    _, plain_scale, _ = _partitions(quantize(xin, bits=bits, axis=axis, partition_size=16), axis, parts.shape)
    assert (got_scale < plain_scale).mean() > 0.1


@pytest.mark.parametrize("bits", [2, 4])
def test_never_worse_than_min_max(bits):
    x = make_data(1)
    plain = quantize(jnp.asarray(x), bits=bits, axis=-1, partition_size=32)
    clipped = quantize(jnp.asarray(x), bits=bits, axis=-1, partition_size=32, clip=5)
    e0 = _sq_err(plain, x).reshape(3, 8, 2, 32).sum(-1)
    e1 = _sq_err(clipped, x).reshape(3, 8, 2, 32).sum(-1)
    assert (e1 <= e0 * (1 + 1e-5) + 1e-12).all()
    assert (e1 < 0.9 * e0).mean() > (0.3 if bits == 2 else 0.15)  # clipping pays on Gaussian-like data
    # constant partitions stay exact with scale 0 where f16 holds the constant
    np.testing.assert_array_equal(np.asarray(clipped.scale)[1, :2], 0)
    np.testing.assert_array_equal(np.asarray(dequantize(clipped))[1, :2], x[1, :2])


@pytest.mark.parametrize("bad", [dict(clip=1), dict(clip=9), dict(clip=-1), dict(clip=True), dict(clip=2.0),
                                 dict(clip=5, kv_format="int8"), dict(clip=5, rounding="stochastic")])
def test_config_rejects(bad):
    with pytest.raises(ValueError, match="clip"):
        QuantConfig(**bad)


def test_quantize_rejects():
    x = jnp.ones((4, 16))
    with pytest.raises(ValueError, match="clip=1"):
        quantize(x, bits=2, axis=-1, partition_size=16, clip=1)
    with pytest.raises(ValueError, match="bits=8"):
        quantize(x, bits=8, axis=-1, partition_size=16, clip=5)
    with pytest.raises(ValueError, match="stochastic"):
        quantize(x, bits=2, axis=-1, partition_size=16, clip=5, rounding="stochastic", key=None,
                 noise=jnp.zeros((4, 16)))


# ------------------------------------------------------------------------------ the cache

P, PAGE, HEADS, HQ, D = 32, 128, 2, 4, 64
LENGTHS = (5, 37, 140, 150)  # sealed: by the prefill of half, and by appends
CLIPPED = QuantConfig(partition_size=P, page_size=PAGE, v_group=32, v_rotation=64, window=64, clip=5)


def _cache(config, seed=0):
    """(cache written prefill half + appends, the twin's view with V as stored: W = V R)."""
    lengths = np.asarray(LENGTHS, np.int32)
    k, w = twin.make_kv((len(lengths), int(lengths.max()), HEADS, D), seed)
    w[3, :, :, 7] += 4.0  # an outlier channel of rotated V
    k[2, 40:, 1, 3] *= 12.0  # outlier K channel
    w, k = twin.bf16(w).astype(np.float32), twin.bf16(k).astype(np.float32)
    v = (w.astype(np.float64) @ rot(64)).astype(np.float32)
    cache = twin.build(config, lengths, num_kv_heads=HEADS, head_dim=D, how="both", kv=(k, v), seed=seed)
    return cache, dataclasses.replace(cache, v=w)


def test_cache_stores_the_search_and_reads_back():
    cache, stored = _cache(CLIPPED)
    ns, n_sealed, err_clip, err_plain = CLIPPED.num_sink_tokens, 0, 0.0, 0.0
    for s, seg in enumerate(twin.read(cache)):
        for b, blk in enumerate(seg.blocks):
            rows = slice(ns + b * P, ns + (b + 1) * P)
            kt = np.swapaxes(cache.k[s, rows], 0, 1).astype(np.float64)  # [H, P, D]
            # K per (block, channel): partitions over the block's tokens
            _, _, _, kbest, kerrs = np_clip_quantize(np.swapaxes(kt, 1, 2), CLIPPED.bits, 5)
            kerr = ((blk["k_codes"] * blk["k_scale"][:, None] + blk["k_min"][:, None] - kt) ** 2).sum(1)
            np.testing.assert_allclose(kerr, kbest, rtol=1e-5, atol=1e-12)
            # V per (token, 32-channel group) of the stored rotated V: the cache rotates V in float32,
            # within 1e-7 of W, which can move a candidate's f16 minimum by an ulp (error ~0.2%)
            wt = np.swapaxes(stored.v[s, rows], 0, 1).astype(np.float64).reshape(HEADS, P, 2, 32)
            _, _, _, vbest, verrs = np_clip_quantize(wt, CLIPPED.bits, 5)
            vhat = blk["v_codes"].reshape(HEADS, P, 2, 32) * blk["v_scale"][..., None] + blk["v_min"][..., None]
            verr = ((vhat - wt) ** 2).sum(-1)
            np.testing.assert_allclose(verr, vbest, rtol=5e-3, atol=1e-9)
            err_clip += kerr.sum() + verr.sum()
            err_plain += kerrs[0].sum() + verrs[0].sum()  # min-max, the first candidate
            n_sealed += 1
    assert n_sealed == 8 and err_clip < 0.8 * err_plain, (n_sealed, err_clip, err_plain)

    q = make_q((len(LENGTHS), HQ, D))
    out = np.asarray(attention.decode_attention(q, cache.layer, page_indices=cache.table,
                                                kv_lens=cache.lengths, impl="reference"))
    want = twin.np_cache_attention(q[:, None], stored, (cache.lengths - 1)[:, None])[:, 0] @ rot(64)
    check(out, want, stored, "reference", "kivi")
    # and close to float attention over the dequantized contents (the INT8 transients aside)
    deq = [np_attn for np_attn in twin.dequantized(stored)]
    dense = np.stack([twin.np_attention(q[s][None], k_hat, v_hat)[0] for s, (k_hat, v_hat) in enumerate(deq)])
    assert np.abs(out - dense @ rot(64)).max() <= 0.05 * np.abs(stored.v).max()


@pytest.mark.parametrize("value", [0.0, 2.5])
def test_constant_inputs_stay_finite(value):
    lengths = np.asarray(LENGTHS, np.int32)
    k = np.full((len(lengths), int(lengths.max()), HEADS, D), value, np.float32)
    cache = twin.build(CLIPPED, lengths, num_kv_heads=HEADS, head_dim=D, how="both", kv=(k, k.copy()))
    q = make_q((len(LENGTHS), HQ, D))
    out = np.asarray(attention.decode_attention(q, cache.layer, page_indices=cache.table,
                                                kv_lens=cache.lengths, impl="reference"))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, value, atol=1e-2 * max(value, 1.0))


def test_eval_spec_and_cli_flag():
    from models.cli import _parser
    from models.cli_generate import quant_config
    from models.eval import parse_format
    args = _parser().parse_args(["generate", "--prompt", "hi", "--clip", "5", "--v-rotation", "64"])
    assert (quant_config(args).clip, quant_config(args).v_rotation) == (5, 64)
    fmt = parse_format("hack:partition_size=32,v_group=64,v_rotation=64,window=128,clip=5")
    assert (fmt.quant.clip, fmt.quant.partition_size, fmt.quant.window) == (5, 32, 128)
    with pytest.raises(ValueError, match="clip"):
        parse_format("hack:clip=1")
