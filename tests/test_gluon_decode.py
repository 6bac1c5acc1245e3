"""pallas_kernels.gluon_decode_attention: the Gluon decode kernel (one warp per program, explicit mma_v2 layouts).

Tier (a), gpu marker (Gluon compiles and runs only on a CUDA GPU): random paged kivi caches of tests/
test_decode_kernels.py (NaN metadata in unsealed slots, garbage page ids past a sequence's pages, lengths off
block and packing-group boundaries, 0, beyond the capacity), against float64 attention over the dequantized
cache with the folded path's rule (error <= 2x the same math done naively in f16, test_decode_kernels'
`within_2x_naive`). On the CPU: the wrapper's refusals of what the prototype does not cover.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gluon_decode_attention as gd
from test_decode_kernels import (CASE, FIELDS, ODD_CASE, TIGHT, Case, _f64, _residual_tokens, build, v_scale_of,
                                 within_2x_naive)

G7_CASE = Case("d128_P64_g7_s3", 128, 64, 256, 2, 7, 3, (700, 129, 4 + 256, 0), num_splits=3)
# page 8P (2 packing groups per page), 8 query heads per kv head, one length beyond the capacity (4 + 2 * 512)
G8_PAGE8P_CASE = Case("d128_P64_g8_page8P_s3", 128, 64, 512, 2, 8, 2, (4 + 1024 + 100, 700, 4 + 256 + 64 * 3),
                      num_splits=3)
G1_CASE = Case("d128_P64_g1_s2", 128, 64, 256, 2, 1, 3, (500, 4 + 64 * 8, 1), num_splits=2)
G2_CASE = Case("d128_P64_g2_s2", 128, 64, 256, 4, 2, 2, (300, 520, 0, 5), num_splits=2)


def run(case, q, c, **kw):
    args = [jnp.asarray(c[f]) for f in FIELDS]
    return np.asarray(gd.hack_gluon_decode_attention(jnp.asarray(q), *args, partition_size=case.P,
                                                     num_sink_tokens=case.ns, **kw))


@pytest.mark.gpu
@pytest.mark.parametrize("case,splits,maxnreg,async_copy", [
    (ODD_CASE, 1, None, False), (ODD_CASE, 5, 168, False), (CASE["d128_P64_g4_s3"], 3, None, False),
    (G7_CASE, 2, 200, False), (dataclasses.replace(CASE["d128_P64_g4_s2"], num_splits=40), 40, None, False),
    (G8_PAGE8P_CASE, 3, None, False), (G1_CASE, 2, None, False), (G2_CASE, 2, None, False),
    (ODD_CASE, 3, None, True), (G8_PAGE8P_CASE, 2, None, True)],
    ids=["odd_s1", "odd_s5_r168", "g4_s3", "g7_s2_r200", "more_splits_than_groups", "g8_page8P_over_capacity",
         "g1", "g2", "odd_s3_async", "g8_page8P_async"])
def test_gluon_kernel_within_2x_naive(case, splits, maxnreg, async_copy):
    q, c = build(case, seed=3)
    out = run(case, q, c, num_splits=splits, maxnreg=maxnreg, async_copy=async_copy)
    assert np.isfinite(out).all() and (out[np.asarray(case.kv_lens) == 0] == 0).all()
    err, naive = within_2x_naive(out, q, c, case, "folded_f16")
    assert naive > 0
    assert err <= 2 * naive + TIGHT * v_scale_of(c), (err, naive)


@pytest.mark.gpu
@pytest.mark.parametrize("case,splits,maxnreg", [(ODD_CASE, 3, None), (G8_PAGE8P_CASE, 2, 168), (G2_CASE, 1, None),
                                                 (dataclasses.replace(CASE["d128_P64_g4_s2"], num_splits=40), 40, 184)],
                         ids=["odd_s3", "g8_page8P_over_capacity_r168", "g2_s1", "more_splits_than_groups_r184"])
def test_gluon_kernel_plane_pairs_within_2x_naive(case, splits, maxnreg):
    """plane_pairs=2 (two programs per split, planes 0-1 and 2-3 of every group, run-time plane masks): the same
    rule against float64, masked tail groups (odd lengths) included."""
    q, c = build(case, seed=5)
    out = run(case, q, c, num_splits=splits, maxnreg=maxnreg, plane_pairs=2)
    assert np.isfinite(out).all() and (out[np.asarray(case.kv_lens) == 0] == 0).all()
    err, naive = within_2x_naive(out, q, c, case, "folded_f16")
    assert naive > 0
    assert err <= 2 * naive + TIGHT * v_scale_of(c), (err, naive)


@pytest.mark.gpu
@pytest.mark.parametrize("case,splits", [(CASE["d128_P64_g4_s3"], 2), (ODD_CASE, 3)], ids=["g4_s2", "odd_s3"])
def test_gluon_kernel_async_copy_same_output(case, splits):
    """The cp.async double-buffered tiles (async_copy=True) give the values of the direct loads, bit for bit."""
    q, c = build(case, seed=4)
    a = run(case, q, c, num_splits=splits)
    b = run(case, q, c, num_splits=splits, async_copy=True)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("case,match", [(CASE["d64_P32_g4_s1"], "partition_size=64"),
                                        (CASE["d64_P64_g3_page8P_s4"], "head_dim 128"),
                                        (CASE["d128_P128_g8_s2"], "partition_size=64"),
                                        (Case("g16", 128, 64, 256, 1, 16, 2, (300,)), "16 query heads per kv")])
def test_gluon_wrapper_refuses_uncovered_shapes(case, match):
    q, c = build(case, seed=0)
    with pytest.raises(ValueError, match=match):
        run(case, q, c)


@pytest.mark.parametrize("kw,match", [(dict(num_splits=0), "num_splits"), (dict(num_splits=2.0), "num_splits"),
                                      (dict(maxnreg=300), "maxnreg"), (dict(maxnreg=True), "maxnreg"),
                                      (dict(async_copy="yes"), "async_copy"), (dict(plane_pairs=3), "plane_pairs"),
                                      (dict(plane_pairs=True), "plane_pairs"),
                                      (dict(plane_pairs=2, async_copy=True), "plane_pairs=2")])
def test_gluon_wrapper_refuses_bad_launch_options(kw, match):
    case = CASE["d128_P64_g4_s3"]
    q, c = build(case, seed=0)
    with pytest.raises(ValueError, match=match):
        run(case, q, c, **kw)


def test_gluon_wrapper_refuses_non_float16_metadata():
    case = CASE["d128_P64_g4_s3"]
    q, c = build(case, seed=0)
    c["k_min"] = c["k_min"].astype(np.float32)
    with pytest.raises(ValueError, match="k_min=float32"):
        run(case, q, c)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the refusal off a GPU")
def test_gluon_wrapper_needs_a_gpu():
    case = CASE["d128_P64_g4_s3"]
    q, c = build(case, seed=0)
    with pytest.raises(RuntimeError, match="CUDA GPU"):
        run(case, q, c)


@pytest.mark.parametrize("case", [CASE["d128_P64_g4_s3"], ODD_CASE, G8_PAGE8P_CASE], ids=["g4", "odd", "g8_page8P"])
def test_gluon_open_region_state_vs_numpy(case):
    """The wrapper's jnp attention over the sinks and the open region (merged with the kernel's partials) against
    float64 NumPy over test_decode_kernels' residual tokens: NaN rows past a sequence's tokens are never read,
    and sequences with none give l = 0."""
    q, c = build(case, seed=5)
    S, Hq, D = q.shape
    H = case.num_kv_heads
    G = Hq // H
    acc, m, l = map(np.asarray, gd._open_state(
        jnp.asarray(q), *(jnp.asarray(c[f]) for f in ("open_k", "open_v", "sink_k", "sink_v", "kv_lens")),
        num_sink_tokens=case.ns, window=case.P, pages_per_seq=case.pages_per_seq, page_size=case.page_size))
    assert np.isfinite(acc).all()
    for b in range(S):
        for h in range(H):
            kr, vr = _residual_tokens(c, b, h, case.P, case.ns)
            if not len(kr):
                assert (l[b, h, :G] == 0).all()
                continue
            lg = _f64(q[b, h * G:(h + 1) * G]) @ kr.T / np.sqrt(D)
            w = np.exp(lg - lg.max(1, keepdims=True))
            want = (w @ vr) / w.sum(1, keepdims=True)
            np.testing.assert_allclose(acc[b, h, :G] / l[b, h, :G, None], want, rtol=0, atol=1e-5 * np.abs(vr).max())
            np.testing.assert_allclose(m[b, h, :G], np.log2(np.e) * lg.max(1), rtol=1e-5, atol=1e-5)
