"""Tests of pallas_kernels.triton_decode_attention (the scale-folded jax-triton decode kernel).

Tier (a), gpu marker (jax-triton runs only on a CUDA GPU): the kernel on random paged kivi caches
(tests/test_decode_kernels.make_cache: shuffled page tables, garbage ids in unused entries, NaN in
every unsealed block's metadata and in unused open-block / sink rows) against an independent float64
NumPy twin, dequantize-then-attend (`numpy_folded_decode`). Lengths 0, 1, P - 1, P + 1 past the sinks,
block and page boundaries, beyond the capacity; GQA groups 1 / 4 / 7; 1 / 3 / more splits than groups;
head_dim 64 / 128 with P 32 / 64 / 128; pages of 4P and 8P; ns 0 and 4; both unpack paths and
pipelining depths.

Tolerance (the flash-attention rule): the kernel rounds exactly two transients to f16, q_s * sigma_b
and W * tau, so its error against the float64 twin must be <= 2x the error of the same math done
naively (`numpy_folded_decode(..., f16=True)`: those two roundings with block-local W, float64
otherwise) plus 64 eps32 max|V| of float32 order. A wrong code, plane, page, mask or merge is off by
O(max|V|) and fails it.

CPU tests: the host side (config heuristic, constants, the split combine, validation, the dispatch),
and, where `triton` is importable (not jax-triton), the kernel itself in Triton's interpreter
(tests/triton_interpret.py: Triton integer unpack instead of the inline PTX) against the same twin.
"""
from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys

import numpy as np
import pytest

import jax.numpy as jnp

from pallas_kernels import triton_decode_attention as td
from test_decode_kernels import (FIELDS, KIVI_ARRAYS, _f64, _finish, _residual_tokens, _sealed_blocks,
                                 check_vs_dequantized, make_cache, prefilled_kivi_layer, v_scale_of)

EPS32 = float(np.finfo(np.float32).eps)


def numpy_folded_decode(q, c, *, P, ns, f16=False):
    """Float64 decode attention over the dequantized kivi cache: f64[S, Hq, d]. f16=True rounds
    q_s * sigma_b and W * tau (W relative to the block's max) to float16 first (the naive version of
    the kernel's two roundings)."""
    rnd = (lambda x: _f64(np.asarray(x, np.float64).astype(np.float16))) if f16 else _f64
    q = np.asarray(q, np.float32)
    S, Hq, d = q.shape
    H = c["k_codes"].shape[1]
    G, NP = Hq // H, c["k_sums"].shape[3]
    Pc = d // NP
    out = np.zeros((S, Hq, d))
    for b in range(S):
        for h in range(H):
            qs = _f64(q[b, h * G:(h + 1) * G] * np.float32(1.0 / math.sqrt(d)))
            parts = []
            kr, vr = _residual_tokens(c, b, h, P, ns)
            if len(kr):
                lg = qs @ kr.T
                m = lg.max(1)
                w = np.exp(lg - m[:, None])
                parts.append((m, w.sum(1), w @ vr))
            for kc, vc, sigma, mu, _, tau, nu, _ in _sealed_blocks(c, b, h, P, ns):
                lg = rnd(qs * _f64(sigma)[None]) @ _f64(kc).T + (qs @ _f64(mu))[:, None]  # [G, P]
                m = lg.max(1)
                w = np.exp(lg - m[:, None])
                o = np.zeros((G, d))
                for p in range(NP):
                    ch = slice(p * Pc, (p + 1) * Pc)
                    o[:, ch] = rnd(w * _f64(tau)[None, :, p]) @ _f64(vc[:, ch]) + (w @ _f64(nu)[:, p])[:, None]
                parts.append((m, w.sum(1), o))
            out[b, h * G:(h + 1) * G] = _finish(parts, G, d)
    return out


def build(*, head_dim, P, page_size, num_kv_heads, group, pages_per_seq, kv_lens, ns=4, seed=0):
    rng = np.random.default_rng(seed)
    c = make_cache(rng, batch=len(kv_lens), num_kv_heads=num_kv_heads, head_dim=head_dim, P=P,
                   page_size=page_size, pages_per_seq=pages_per_seq, ns=ns, kv_lens=list(kv_lens))
    q = rng.normal(0, 1, (len(kv_lens), num_kv_heads * group, head_dim)).astype(np.float32)
    return q, c


def run(q, c, *, P, ns, **kw):
    out = td.hack_triton_decode_attention(jnp.asarray(q), *[jnp.asarray(c[f]) for f in FIELDS],
                                          partition_size=P, num_sink_tokens=ns, **kw)
    return np.asarray(out)


def check(out, q, c, *, P, ns):
    exact = numpy_folded_decode(q, c, P=P, ns=ns)
    naive = np.abs(numpy_folded_decode(q, c, P=P, ns=ns, f16=True) - exact).max()
    err = np.abs(out - exact).max()
    bound = 2 * naive + 64 * EPS32 * v_scale_of(c)
    assert np.isfinite(out).all()
    assert err <= bound, f"max error {err:.3g} > {bound:.3g} (naive f16 error {naive:.3g})"
    return err


# (head_dim, P, page_size, num_kv_heads, group, pages_per_seq, kv_lens, ns)
SHAPES = {
    # Llama-3 heads (NP 2), lengths 0, 1, P - 1 / P + 1 past the sinks, block / page boundaries, long
    "d128_P64_g4": (128, 64, 256, 2, 4, 5, (0, 1, 4 + 63, 4 + 65, 4 + 256, 4 + 64 * 7 + 5, 1000, 1300)),
    # G 7 (padded to 8), one channel group (d 64 = P), pages of 8P (2 packing groups per page)
    "d64_P64_g7_page8P": (64, 64, 512, 1, 7, 2, (1, 4 + 63, 4 + 65, 4 + 64 * 5, 1000), 4),
    # G 1, no sinks, P 32 (NP 2, head_dim 64)
    "d64_P32_g1_ns0": (64, 32, 128, 2, 1, 4, (0, 31, 33, 128, 300, 600), 0),
    # P 128 = head_dim (NP 1), G 4
    "d128_P128_g4": (128, 128, 512, 1, 4, 2, (1000, 129, 4 + 127)),
}


def _shape(name):
    d, P, ps, H, G, pps, lens, *ns = SHAPES[name]
    return dict(head_dim=d, P=P, page_size=ps, num_kv_heads=H, group=G, pages_per_seq=pps, kv_lens=lens,
                ns=ns[0] if ns else 4)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 3, 40])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_triton_kernel_matches_float64_twin(name, splits):
    s = _shape(name)
    q, c = build(**s)
    out = run(q, c, P=s["P"], ns=s["ns"], num_splits=splits)
    check(out, q, c, P=s["P"], ns=s["ns"])


@pytest.mark.gpu
@pytest.mark.parametrize("config", [td.KernelConfig(num_splits=2, num_stages=1),
                                    td.KernelConfig(num_splits=2, unpack_asm=False)], ids=["stages1", "no_asm"])
def test_triton_kernel_configs(config):
    s = _shape("d128_P64_g4")
    q, c = build(**s, seed=1)
    check(run(q, c, P=s["P"], ns=s["ns"], config=config), q, c, P=s["P"], ns=s["ns"])


@pytest.mark.gpu
def test_triton_kernel_deterministic_split_invariant_and_bf16_q():
    s = _shape("d128_P64_g4")
    q, c = build(**s, seed=2)
    a, b = run(q, c, P=s["P"], ns=s["ns"], num_splits=3), run(q, c, P=s["P"], ns=s["ns"], num_splits=3)
    np.testing.assert_array_equal(a, b)
    one = run(q, c, P=s["P"], ns=s["ns"], num_splits=1)
    np.testing.assert_allclose(one, a, atol=64 * EPS32 * v_scale_of(c))
    qb = np.asarray(jnp.asarray(q, jnp.bfloat16).astype(jnp.float32))  # the values a bf16 q holds
    out = np.asarray(td.hack_triton_decode_attention(jnp.asarray(q, jnp.bfloat16), *[jnp.asarray(c[f]) for f in FIELDS],
                                                     partition_size=s["P"], num_sink_tokens=s["ns"]))
    check(out, qb, c, P=s["P"], ns=s["ns"])


@pytest.mark.gpu
def test_triton_kernel_constant_v_returns_the_constant():
    s = _shape("d64_P32_g1_ns0")
    q, c = build(**s, seed=3)
    c["v_scale"] = np.where(np.isnan(c["v_scale"]), c["v_scale"], 0).astype(np.float16)
    c["v_min"] = np.where(np.isnan(c["v_min"]), c["v_min"], 0.75).astype(np.float16)
    c["open_v"] = np.where(np.isnan(np.asarray(c["open_v"], np.float32)), c["open_v"], 0.75).astype(c["open_v"].dtype)
    out = run(q, c, P=s["P"], ns=s["ns"], num_splits=2)
    live = np.asarray(c["kv_lens"]) > 0
    np.testing.assert_allclose(out[live], 0.75, rtol=1e-5)
    np.testing.assert_array_equal(out[~live], 0)


@pytest.mark.gpu
def test_triton_via_dispatch_on_a_real_cache():
    from hack_jax import attention
    layer, page_indices, lengths, q = prefilled_kivi_layer()
    out = attention.decode_attention(jnp.asarray(q), layer, page_indices=page_indices, kv_lens=lengths,
                                     impl="triton")
    direct = td.hack_triton_decode_attention(
        jnp.asarray(q), *(getattr(layer, f) for f in KIVI_ARRAYS), jnp.asarray(page_indices), jnp.asarray(lengths),
        partition_size=layer.config.partition_size, num_sink_tokens=layer.config.num_sink_tokens)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(direct))
    # against float attention over the dequantized cache (hack_jax's own dequantizer): f16 roundings only
    check_vs_dequantized(out, layer, page_indices, lengths, q, atol=2e-3)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton's interpreter needs `triton`")
def test_triton_kernel_in_the_interpreter_matches_float64_twin():
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, os.path.join(here, "triton_interpret.py"), "d128_P64_g4", "d64_P32_g1_ns0"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert r.stdout.count(": ok") == 4, r.stdout


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the offline sm_90 compile needs `triton`")
@pytest.mark.parametrize("heads", [(32, 8, 128), (28, 4, 128), (8, 8, 64)], ids=["g4_d128", "g7_d128", "g1_d64"])
def test_unpack_asm_layout_assumption_holds(heads, tmp_path):
    """The inline-PTX unpack takes the plane from the warp index: every mma layout of the compiled kernel
    must put the 4 warps on the batch (plane) axis. Compiled offline for sm_90, as on the H200."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import triton_decode_offline
    hq, hkv, d = heads
    triton_decode_offline.compile_report(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, num_stages=2,
                                         pages_per_seq=4, num_splits=2, out_dir=str(tmp_path))
    ttgir = (tmp_path / "kernel.ttgir").read_text()
    mmas = [line for line in ttgir.splitlines() if "nvidia_mma<" in line and line.startswith("#")]
    assert mmas and all("warpsPerCTA = [4, 1, 1]" in m for m in mmas), mmas


# ----------------------------------------------------------------------------------------------
# CPU: the host side
# ----------------------------------------------------------------------------------------------


def test_default_config_fills_a_wave_and_never_exceeds_the_groups():
    slots = td.RESIDENT_PROGRAMS_PER_SM * td.H200_NUM_SMS
    for batch, tokens in [(1, 1024), (1, 32768), (8, 32768), (1, 131072), (8, 131072), (32, 32768)]:
        pages = tokens // 256
        cfg = td.default_config(batch=batch, num_kv_heads=8, pages_per_seq=pages, page_size=256, partition_size=64)
        groups = pages
        assert 1 <= cfg.num_splits <= groups
        cost = lambda s: -(-batch * 8 * s // slots) * (-(-groups // s) + 1)  # noqa: E731
        assert cost(cfg.num_splits) == min(cost(s) for s in range(1, groups + 1))
    def split(b, pages):
        return td.default_config(batch=b, num_kv_heads=8, pages_per_seq=pages, page_size=256,
                                 partition_size=64).num_splits
    assert (split(8, 128), split(1, 128), split(1, 512)) == (4, 32, 32)  # one wave of sealed-block programs


def test_kernel_constants():
    k = td.kernel_constants(num_q_heads=28, num_kv_heads=4, head_dim=128, partition_size=64, page_size=256,
                            pages_per_seq=3, num_pages=9, num_sink_tokens=4, num_splits=2, unpack_asm=True)
    assert (k["Q_PER_KV"], k["Q_PER_KV_PAD"], k["PC"], k["NP"], k["NS_PAD"]) == (7, 8, 64, 2, 16)
    assert math.isclose(k["QK_SCALE"], 1.4426950408889634 / math.sqrt(128))


def test_combine_matches_numpy_lse():
    rng = np.random.default_rng(0)
    acc = rng.normal(size=(2, 3, 4, 8, 16)).astype(np.float32)
    m2 = rng.normal(size=(2, 3, 4, 8)).astype(np.float32)
    l = rng.uniform(0.5, 2, (2, 3, 4, 8)).astype(np.float32)
    m2[0, 0, 1:] = -np.inf  # programs that saw nothing
    l[0, 0, 1:] = 0
    acc[0, 0, 1:] = 0
    m2[1, 2] = -np.inf  # a row of programs that all saw nothing -> 0
    l[1, 2] = 0
    out = np.asarray(td.combine(jnp.asarray(acc), jnp.asarray(m2), jnp.asarray(l), num_q_heads=3 * 5))
    top = np.max(_f64(m2), axis=2, keepdims=True)
    w = np.where(np.isinf(m2), 0.0, np.exp2(_f64(m2) - np.where(np.isinf(top), 0.0, top)))
    ref = (w[..., None] * acc).sum(2) / np.where((w * l).sum(2) > 0, (w * l).sum(2), 1)[..., None]
    np.testing.assert_allclose(out, ref[:, :, :5].reshape(2, 15, 16), rtol=1e-5, atol=1e-6)
    assert (out.reshape(2, 3, 5, 16)[1, 2] == 0).all()


def test_validation_errors_name_the_value():
    s = _shape("d64_P32_g1_ns0")
    q, c = build(**s)
    with pytest.raises(ValueError, match="num_splits"):
        run(q, c, P=32, ns=0, num_splits=0)
    with pytest.raises(ValueError, match="num_warps"):
        run(q, c, P=32, ns=0, config=td.KernelConfig(num_warps=8))
    with pytest.raises(ValueError, match="num_stages"):
        run(q, c, P=32, ns=0, config=td.KernelConfig(num_stages=0))
    with pytest.raises(ValueError, match="k_scale must have shape"):
        td.hack_triton_decode_attention(jnp.asarray(q), *[jnp.asarray(c[f]) for f in FIELDS][:1],
                                        jnp.zeros((3,)), *[jnp.asarray(c[f]) for f in FIELDS][2:],
                                        partition_size=32, num_sink_tokens=0)  # k_scale of the wrong shape
    q2, c2 = build(head_dim=128, P=32, page_size=128, num_kv_heads=1, group=1, pages_per_seq=1, kv_lens=(40,))
    with pytest.raises(ValueError, match="head_dim <= 2 \\* partition_size"):
        run(q2, c2, P=32, ns=4)
    with pytest.raises(ValueError, match="q must be float"):
        td.hack_triton_decode_attention(jnp.asarray(q).astype(jnp.int32), *[jnp.asarray(c[f]) for f in FIELDS],
                                        partition_size=32, num_sink_tokens=0)


def test_dispatch_knows_impl_triton():
    from hack_jax import attention
    assert "triton" in attention.IMPLS
    fn = attention._pallas("triton", "decode", _kivi_layer())
    assert fn is td.hack_triton_decode_attention


def _kivi_layer():
    from hack_jax import kv_cache
    from hack_jax.config import QuantConfig
    cfg = QuantConfig(kv_format="hack", layout="kivi", partition_size=64, page_size=256, num_sink_tokens=4)
    return kv_cache.init_layer(cfg, num_kv_heads=1, head_dim=64, num_pages=2, max_seqs=1)
