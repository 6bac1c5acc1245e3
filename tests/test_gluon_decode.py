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
from test_decode_kernels import (CASE, FIELDS, KIVI_ARRAYS, ODD_CASE, TIGHT, Case, _f64, _residual_tokens, build,
                                 check_vs_dequantized, prefilled_kivi_layer, v_scale_of, within_2x_naive)

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
@pytest.mark.parametrize("case,splits,maxnreg,staging", [
    (ODD_CASE, 1, None, "operand"), (ODD_CASE, 5, 168, "direct"), (CASE["d128_P64_g4_s3"], 3, None, "operand"),
    (G7_CASE, 2, 200, "operand"), (dataclasses.replace(CASE["d128_P64_g4_s2"], num_splits=40), 40, None, "operand"),
    (G8_PAGE8P_CASE, 3, None, "operand"), (G1_CASE, 2, None, "operand"), (G2_CASE, 2, None, "direct"),
    (ODD_CASE, 3, None, "direct"), (G8_PAGE8P_CASE, 2, None, "direct"), (G8_PAGE8P_CASE, 17, None, "operand"),
    (dataclasses.replace(ODD_CASE, ns=0), 3, None, "operand"),
    (dataclasses.replace(G7_CASE, ns=16), 2, None, "operand"), (G1_CASE, 17, None, "operand"),
    (G2_CASE, 17, None, "operand")],
    ids=["odd_s1", "odd_s5_r168_direct", "g4_s3", "g7_s2_r200", "more_splits_than_groups", "g8_page8P_over_capacity",
         "g1", "g2_direct", "odd_s3_direct", "g8_page8P_direct", "g8_page8P_s17_merge_kernel", "odd_ns0", "g7_ns16",
         "g1_s17_merge_kernel", "g2_s17_merge_kernel"])
def test_gluon_kernel_within_2x_naive(case, splits, maxnreg, staging):
    """Sinks and the open region in the kernel (the default: a program of their own), every staging; 17 splits:
    18 programs' partials merged by common.combine_splits' kernel (32 rows, 14 never written; rows of 8, 1 and 2
    query heads); no sinks (their pointers stand in for nothing) and a full 16-row sink tile."""
    q, c = build(case, seed=3)
    out = run(case, q, c, num_splits=splits, maxnreg=maxnreg, staging=staging)
    assert np.isfinite(out).all() and (out[np.asarray(case.kv_lens) == 0] == 0).all()
    err, naive = within_2x_naive(out, q, c, case, "folded_f16")
    assert naive > 0
    assert err <= 2 * naive + TIGHT * v_scale_of(c), (err, naive)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [ODD_CASE, G8_PAGE8P_CASE], ids=["odd", "g8_page8P"])
def test_gluon_open_in_kernel_matches_jnp_open_state(case):
    """The kernel's bf16 hi / lo products over the sinks and the open region against the wrapper's float32 jnp
    attention over them (open_in_kernel=False): both within float32 order of each other, and bf16 / f16 q (the
    kernel's own loads) within the 2x rule."""
    q, c = build(case, seed=6)
    a = run(case, q, c, num_splits=2)
    b = run(case, q, c, num_splits=2, open_in_kernel=False)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * v_scale_of(c))
    for dt in (jnp.bfloat16, jnp.float16):  # q as the kernel loads it, in its own dtype
        qr = np.asarray(jnp.asarray(q).astype(dt).astype(jnp.float32))
        out = np.asarray(gd.hack_gluon_decode_attention(jnp.asarray(qr, dt), *[jnp.asarray(c[f]) for f in FIELDS],
                                                        partition_size=case.P, num_sink_tokens=case.ns, num_splits=2))
        err, naive = within_2x_naive(out, qr, c, case, "folded_f16")
        assert naive > 0
        assert err <= 2 * naive + TIGHT * v_scale_of(c), (dt, err, naive)


@pytest.mark.gpu
@pytest.mark.parametrize("case,splits", [(CASE["d128_P64_g4_s3"], 2), (ODD_CASE, 3)], ids=["g4_s2", "odd_s3"])
def test_gluon_kernel_stagings_same_output(case, splits):
    """The cp.async staging ("operand") gives the values of the direct loads, bit for bit."""
    q, c = build(case, seed=4)
    a = run(case, q, c, num_splits=splits, staging="direct")
    np.testing.assert_array_equal(a, run(case, q, c, num_splits=splits, staging="operand"))


@pytest.mark.gpu
def test_gluon_launches_agree():
    """jaxlib's typed-FFI Triton call and the legacy custom call launch the same kernel: the same values."""
    case = CASE["d128_P64_g4_s3"]
    q, c = build(case, seed=7)
    np.testing.assert_array_equal(run(case, q, c, num_splits=3, launch="ffi"),
                                  run(case, q, c, num_splits=3, launch="legacy"))


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
                                      (dict(staging="yes"), "staging"), (dict(staging=1), "staging"),
                                      (dict(open_in_kernel=1), "open_in_kernel"), (dict(launch="x"), "launch")])
def test_gluon_wrapper_refuses_bad_launch_options(kw, match):
    case = CASE["d128_P64_g4_s3"]
    q, c = build(case, seed=0)
    with pytest.raises(ValueError, match=match):
        run(case, q, c, **kw)


def test_gluon_wrapper_refuses_more_than_16_sinks_in_the_kernel():
    case = Case("ns32", 128, 64, 256, 2, 4, 2, (300, 40), ns=32)
    q, c = build(case, seed=0)
    with pytest.raises(ValueError, match="num_sink_tokens=32: pass open_in_kernel=False"):
        run(case, q, c)


def test_gluon_wrapper_refuses_a_window_in_the_kernel():
    case = CASE["d128_P64_g4_s3"]
    q, c = build(case, seed=0)
    for f in ("open_k", "open_v"):  # an open region of 128 tokens (window=128)
        c[f] = np.concatenate([c[f], c[f]], axis=2)
    with pytest.raises(ValueError, match="open region of 64 tokens itself, got window=128"):
        run(case, q, c, window=128)


def test_kernel_constexprs_refuse_what_the_kernel_cannot_hold():
    kw = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=256, pages_per_seq=4, num_pages=33,
              window=64, async_mode=21)
    consts = gd.kernel_constexprs(num_sink_tokens=16, num_splits=3, **kw)
    # 3 splits and the dense program; partial rows of 4 query heads (no padding to 8)
    assert (consts["ROWS"], consts["OPAD"], consts["DENSE"]) == (4, 4, 3)
    assert gd.kernel_constexprs(num_sink_tokens=16, num_splits=3, dense=2, **kw)["ROWS"] == 3
    assert gd.kernel_constexprs(num_sink_tokens=16, num_splits=3, **{**kw, "num_q_heads": 24})["OPAD"] == 4
    with pytest.raises(ValueError, match="at most 16 sink tokens"):
        gd.kernel_constexprs(num_sink_tokens=17, num_splits=3, **kw)
    assert gd.kernel_constexprs(num_sink_tokens=17, num_splits=3, dense=0, **kw)["DENSE"] == 0
    with pytest.raises(ValueError, match="one row per program"):
        gd.kernel_constexprs(num_sink_tokens=4, num_splits=16, rows=8, **kw)
    with pytest.raises(ValueError, match=r"one row per program \(4\)"):
        gd.kernel_constexprs(num_sink_tokens=4, num_splits=3, rows=3, **kw)
    for dense in (1, 4):  # 3: a program of its own, 2: before the groups, 0: none
        with pytest.raises(ValueError, match="dense must be"):
            gd.kernel_constexprs(num_sink_tokens=4, num_splits=3, dense=dense, **kw)


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
    assert acc.shape == (S, H, max(1, 1 << (G - 1).bit_length()), D)  # query heads rounded up to a power of two
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


def _kivi_layer(**kw):
    from hack_jax import kv_cache
    from hack_jax.config import QuantConfig
    cfg = QuantConfig(kv_format="hack", layout="kivi", partition_size=64, page_size=256, num_sink_tokens=4, **kw)
    return cfg, kv_cache.init_layer(cfg, num_kv_heads=2, head_dim=128, num_pages=6, max_seqs=2)


def test_dispatch_knows_impl_gluon_and_refuses_a_v_group():
    from hack_jax import attention
    assert "gluon" in attention.IMPLS
    assert attention._pallas("gluon", "decode", _kivi_layer()[1]) is gd.hack_gluon_decode_attention
    with pytest.raises(NotImplementedError, match="v_group=32"):
        attention._pallas("gluon", "decode", _kivi_layer(v_group=32)[1])
    with pytest.raises(NotImplementedError, match="prefill"):
        attention._pallas("gluon", "prefill", _kivi_layer()[1])


@pytest.mark.gpu
def test_gluon_via_dispatch_on_a_real_cache():
    """impl="gluon" through hack_jax.attention on a cache written by write_prefill (sinks, sealed blocks, open
    tokens): the wrapper's own output, and float attention over hack_jax's dequantized cache within f16
    roundings."""
    from hack_jax import attention
    layer, page_indices, lengths, q = prefilled_kivi_layer()
    out = np.asarray(attention.decode_attention(jnp.asarray(q), layer, page_indices=page_indices, kv_lens=lengths,
                                                impl="gluon"))
    direct = gd.hack_gluon_decode_attention(jnp.asarray(q), *(getattr(layer, f) for f in KIVI_ARRAYS),
                                            jnp.asarray(page_indices), jnp.asarray(lengths), partition_size=64,
                                            num_sink_tokens=4)
    np.testing.assert_array_equal(out, np.asarray(direct))
    check_vs_dequantized(out, layer, page_indices, lengths, q, atol=2e-3)


@pytest.mark.parametrize("batch,heads,groups", [(1, 8, 128), (1, 8, 512), (8, 8, 128), (2, 8, 4), (64, 8, 512),
                                                (200, 8, 64)])
def test_default_splits_fill_one_wave_of_groups(batch, heads, groups):
    """The splits over the sealed groups fill at most one wave of one-warp programs (the dense program comes on
    top), never more splits than groups, at least one."""
    splits = gd.default_num_splits(batch, heads, groups)
    assert 1 <= splits <= groups
    assert splits * batch * heads <= gd.NUM_SMS * gd.PROGRAMS_PER_SM or splits == 1
    # a full wave where the groups allow it: one more split would not fit
    assert splits == groups or (splits + 1) * batch * heads > gd.NUM_SMS * gd.PROGRAMS_PER_SM
