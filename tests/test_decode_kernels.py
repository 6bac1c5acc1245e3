"""Tier (a) tests of the paged INT2 decode kernels: pallas_kernels.decode_attention (HACK, on the
codes) and pallas_kernels.dequant_decode_attention (fused-dequant baseline).

Each kernel runs on a synthetic paged kivi cache built here in the DESIGN.md layout (independently
of hack_jax: own packing, K codes channel-major and V codes token-major, shuffled page ids, garbage
ids in unused page-table entries, NaN in the metadata of every unsealed block slot and in the unused
open-block / sink rows) and is compared with an independent NumPy twin of DESIGN.md's semantics over
the same codes (`numpy_kivi_decode` for the "int8" mode, `numpy_dequant_decode` /
`numpy_folded_decode` for the folded modes and the dequant baseline), plus once on a cache written by
hack_jax.kv_cache against hack_jax's paged reference.

Modes: "interpret" (Pallas interpret mode on the CPU, CI) and "gpu" (compiled, `gpu` marker,
auto-skipped without a GPU). Interpret mode recompiles per shape and config (~5-10 s each), so the
cases below are chosen to cover head_dim 64/128, G = 1/3/4/8, P = 32/64/128 with pages of 4P and 8P,
the operand modes (int8, folded_f16, folded_bf16), num_splits 1-4 (more splits than groups too),
lengths 0, 1, 63, 64, 65, 1000, exactly on block and page boundaries, and ns = 0, without the full product.

Tolerance of the HACK kernel (tier (a), same codes). The NumPy twin repeats the INT8 quantizer of
the transient operands in float32 (hack_jax.quantization.quantize's arithmetic) and does
everything else in float64. The integer dots are exact in both, so what differs is float32
rounding and summation order of the correction terms, the softmax and the merges: a few ulps of
the output's scale. INT8 codes could in principle flip where (x - m) / s sits within an ulp of a
.5 tie, but measured over these cases none did in interpret mode (max error 2e-7 .. 5e-6 at
|V| <= 5.5), so the bound is 64 * eps32 * max|V| (2.3e-5 .. 4.2e-5 here), 8-100x above what is
measured, far below one code flip (>= max|W tau| / 255 ~ 1e-3). On the GPU, float32 division is
not correctly rounded and the logits' float order differs, so flips could happen (none did on the
H200: same max errors as interpret mode); the gpu mode bound allows them: per element
<= FLIP_BOUND * max|V|, and mean error <= 64 * eps32 * max|V| * 8.

Tolerance of the folded modes: they round Q*sigma and W*tau to f16 / bf16 on purpose (no INT8 codes),
so they are checked against float64 attention over the dequantized cache (`numpy_dequant_decode`, exact
by the homomorphic identity) with the flash-attention rule: error <= 2x that of the same folded math
done naively at the operand dtype (`numpy_folded_decode`: the two roundings, everything else float64),
plus TIGHT for float32 order. Measured in interpret mode: kernel within 1.02x of the naive error.

Tolerance of the dequant baseline: it rounds q, K, V and W to bf16 on purpose, so it is checked
against float64 attention over the dequantized cache with the flash-attention rule: its error must be
<= 2x the error of the same math done naively in bf16 (`numpy_dequant_decode(..., bf16=True)`).
"""
from __future__ import annotations

import dataclasses
import math
import warnings

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from oracles import q8_rows
from pallas_kernels import common
from pallas_kernels.common import q_per_kv_pad
from pallas_kernels.decode_attention import RESIDENT_PROGRAMS_PER_SM, KernelConfig, default_config, hack_decode_attention
from pallas_kernels.dequant_decode_attention import dequant_decode_attention

pytestmark = pytest.mark.filterwarnings(f"ignore:{common.TRITON_DEPRECATION_MESSAGE}:DeprecationWarning")

EPS32 = float(np.finfo(np.float32).eps)
TIGHT = 64 * EPS32  # times max|V|: float32 order differences only (module docstring)
FLIP_BOUND = 2e-2  # gpu mode: an INT8 code flip moves one block's output by <= 3 s' <= max|W tau| / 42
BF16 = ml_dtypes.bfloat16
FIELDS = ("k_codes", "k_scale", "k_min", "k_sums", "v_codes", "v_scale", "v_min", "v_sums", "open_k",
          "open_v", "sink_k", "sink_v", "page_indices", "kv_lens")
MODES = ["interpret", pytest.param("gpu", marks=pytest.mark.gpu)]


# ----------------------------------------------------------------------------------------------
# Synthetic paged cache (DESIGN.md layout, built without hack_jax)
# ----------------------------------------------------------------------------------------------


def pack_group(codes):
    """u8[4P, d] codes of one packing group -> u8[P, d]: plane j (bits 2j..2j+1) = rows [jP, (j+1)P)."""
    P = codes.shape[0] // 4
    out = np.zeros((P, codes.shape[1]), np.uint8)
    for j in range(4):
        out |= (codes[j * P:(j + 1) * P] << (2 * j)).astype(np.uint8)
    return out


def pack_group_token_major(codes):
    """u8[4P, d] codes of one packing group -> u8[d, P]: byte (c, r) holds the codes of tokens
    jP + r (block j, in-block token r) at channel c in bits 2j..2j+1, j = 0..3 (kivi v_codes)."""
    P = codes.shape[0] // 4
    out = np.zeros((codes.shape[1], P), np.uint8)
    for j in range(4):
        out |= (codes[j * P:(j + 1) * P].T << (2 * j)).astype(np.uint8)
    return out


def make_cache(rng, *, batch, num_kv_heads, head_dim, P, page_size, pages_per_seq, ns, kv_lens):
    """Random codes and metadata in the kivi page layout (k_codes u8[N, H, page_size // 4, d],
    v_codes u8[N, H, d, page_size // 4]); code sums are the true sums of the codes.

    Every block slot not sealed by some sequence has NaN metadata; open-block and sink rows beyond a
    sequence's length are NaN; page-table entries beyond a sequence's pages hold garbage ids, some
    out of range; used pages are a shuffled subset of 1..num_pages-1 (page 0 is the null page).
    """
    H, d = num_kv_heads, head_dim
    Pc = min(P, d)
    NP, bpp = d // Pc, page_size // P
    sealed = [min(max(L - ns, 0) // P, pages_per_seq * bpp) for L in kv_lens]
    pages_needed = [-(-s // bpp) for s in sealed]
    num_pages = sum(pages_needed) + 2
    perm = rng.permutation(np.arange(1, num_pages))
    page_indices = rng.integers(-3, num_pages + 3, (batch, pages_per_seq)).astype(np.int32)
    used = np.zeros((num_pages, bpp), bool)
    k = 0
    for b in range(batch):
        for i in range(pages_needed[b]):
            page_indices[b, i] = perm[k]
            k += 1
        for blk in range(sealed[b]):
            used[page_indices[b, blk // bpp], blk % bpp] = True

    kc = rng.integers(0, 4, (num_pages, H, page_size, d)).astype(np.uint8)
    vc = rng.integers(0, 4, (num_pages, H, page_size, d)).astype(np.uint8)
    c = dict(
        k_scale=rng.uniform(0.05, 0.6, (num_pages, H, bpp, d)).astype(np.float16),
        k_min=rng.normal(0, 1, (num_pages, H, bpp, d)).astype(np.float16),
        v_scale=rng.uniform(0.05, 0.6, (num_pages, H, page_size, NP)).astype(np.float16),
        v_min=rng.normal(0, 1, (num_pages, H, page_size, NP)).astype(np.float16),
        k_sums=kc.reshape(num_pages, H, page_size, NP, Pc).sum(-1).astype(np.uint8 if 3 * Pc <= 255 else np.uint16),
        v_sums=vc.reshape(num_pages, H, bpp, P, d).sum(3).astype(np.uint8 if 3 * P <= 255 else np.uint16),
        open_k=rng.normal(0, 1, (batch, H, P, d)).astype(BF16),
        open_v=rng.normal(0, 1, (batch, H, P, d)).astype(BF16),
        sink_k=rng.normal(0, 1, (batch, H, ns, d)).astype(BF16),
        sink_v=rng.normal(0, 1, (batch, H, ns, d)).astype(BF16),
        page_indices=page_indices, kv_lens=np.asarray(kv_lens, np.int32))
    for pg, sl in zip(*np.nonzero(~used)):
        c["k_scale"][pg, :, sl] = c["k_min"][pg, :, sl] = np.nan
        c["v_scale"][pg, :, sl * P:(sl + 1) * P] = c["v_min"][pg, :, sl * P:(sl + 1) * P] = np.nan
    for b, L in enumerate(kv_lens):
        n_open = min(max(L - ns, 0), pages_per_seq * page_size) % P
        for name in ("open_k", "open_v"):
            c[name][b, :, n_open:] = np.nan
        for name in ("sink_k", "sink_v"):
            c[name][b, :, min(L, ns):] = np.nan
    groups = page_size // (4 * P)
    tokens = lambda g: slice(g * 4 * P, (g + 1) * 4 * P)  # noqa: E731
    c["k_codes"] = np.stack([np.concatenate([pack_group(kc[n, h, tokens(g)]) for g in range(groups)])
                             for n in range(num_pages) for h in range(H)]).reshape(num_pages, H, page_size // 4, d)
    c["v_codes"] = np.stack([np.concatenate([pack_group_token_major(vc[n, h, tokens(g)]) for g in range(groups)],
                                            axis=1)
                             for n in range(num_pages) for h in range(H)]).reshape(num_pages, H, d, page_size // 4)
    return c


# ----------------------------------------------------------------------------------------------
# NumPy twins (float64; the INT8 transients in float32 as the quantizer contract computes them)
# ----------------------------------------------------------------------------------------------


def _f64(x):
    return np.asarray(x, np.float64)


def _sealed_blocks(c, b, h, P, ns):
    """Yields (codes_k, codes_v, k_scale, k_min, k_sums, v_scale, v_min, v_sums) of every sealed block."""
    page_size = c["k_sums"].shape[2]
    bpp = page_size // P
    L = int(c["kv_lens"][b])
    nb = min(max(L - ns, 0), c["page_indices"].shape[1] * page_size) // P
    for k in range(nb):
        page, slot = int(c["page_indices"][b, k // bpp]), k % bpp
        gi, j = divmod(slot, 4)
        rows, toks = slice(gi * P, (gi + 1) * P), slice(slot * P, (slot + 1) * P)
        yield ((c["k_codes"][page, h, rows] >> (2 * j)) & 3, ((c["v_codes"][page, h, :, rows] >> (2 * j)) & 3).T,
               c["k_scale"][page, h, slot], c["k_min"][page, h, slot], c["k_sums"][page, h, toks],
               c["v_scale"][page, h, toks], c["v_min"][page, h, toks], c["v_sums"][page, h, slot])


def _residual_tokens(c, b, h, P, ns):
    """(k, v) float64 [n, d] of the valid sinks and open-block tokens (kv_lens clipped to the capacity)."""
    L = int(c["kv_lens"][b])
    n_open = min(max(L - ns, 0), c["page_indices"].shape[1] * c["k_sums"].shape[2]) % P
    k = [c["sink_k"][b, h, :min(L, ns)], c["open_k"][b, h, :n_open]]
    v = [c["sink_v"][b, h, :min(L, ns)], c["open_v"][b, h, :n_open]]
    return _f64(np.concatenate(k)), _f64(np.concatenate(v))


def _finish(parts, rows, d):
    if not parts:
        return np.zeros((rows, d))
    M = np.max([m for m, _, _ in parts], axis=0)
    l = sum(l_ * np.exp(m - M) for m, l_, _ in parts)
    return sum(a * np.exp(m - M)[:, None] for m, _, a in parts) / l[:, None]


def numpy_kivi_decode(q, c, *, P, ns):
    """DESIGN.md "Homomorphic attention semantics", layout="kivi", decode: f64[S, Hq, d]."""
    q = np.asarray(q, np.float32)
    S, Hq, d = q.shape
    H = c["k_codes"].shape[1]
    G, NP = Hq // H, c["k_sums"].shape[3]
    Pc = d // NP
    out = np.zeros((S, Hq, d))
    for b in range(S):
        for h in range(H):
            qs32 = q[b, h * G:(h + 1) * G] * np.float32(1.0 / math.sqrt(d))
            qs = _f64(qs32)
            parts = []
            kr, vr = _residual_tokens(c, b, h, P, ns)
            if len(kr):
                lg = qs @ kr.T
                m = lg.max(1)
                w = np.exp(lg - m[:, None])
                parts.append((m, w.sum(1), w @ vr))
            for kc, vc, sigma, mu, kappa, tau, nu, omega in _sealed_blocks(c, b, h, P, ns):
                kc, vc, kappa, nu, omega = _f64(kc), _f64(vc), _f64(kappa), _f64(nu), _f64(omega)
                qt = qs32 * np.asarray(sigma, np.float32)[None]
                lg = np.repeat((qs @ _f64(mu))[:, None], P, 1)
                for p in range(NP):
                    ch = slice(p * Pc, (p + 1) * Pc)
                    qc, s, mf = q8_rows(qt[:, ch])
                    lg = lg + s[:, None] * (qc @ kc[:, ch].T) + mf[:, None] * kappa[None, :, p]
                m = lg.max(1)
                w = np.exp(lg - m[:, None])
                o = np.zeros((G, d))
                for p in range(NP):
                    ch = slice(p * Pc, (p + 1) * Pc)
                    wc, s2, mf2 = q8_rows(w.astype(np.float32) * np.asarray(tau, np.float32)[None, :, p])
                    o[:, ch] = s2[:, None] * (wc @ vc[:, ch]) + mf2[:, None] * omega[None, ch] + (w @ nu[:, p])[:, None]
                parts.append((m, w.sum(1), o))
            out[b, h * G:(h + 1) * G] = _finish(parts, G, d)
    return out


def numpy_folded_decode(q, c, *, P, ns, dtype):
    """The scale-folded decode math done naively at `dtype` (float16 or bfloat16): per sealed block,
    logits = r(q_s * sigma) . k_codes + q_s . mu and PV = r(W * tau) . v_codes + W . nu with r() the
    rounding of the transient operand to `dtype` (from float32, as the kernel rounds it) and everything
    else in float64; sinks and the open block in float64. f64[S, Hq, d]. The rule the folded kernel is
    held to: its error vs float64 attention over the dequantized cache <= 2x this version's."""
    rnd = lambda x: _f64(np.asarray(x, np.float32).astype(dtype))  # noqa: E731
    q = np.asarray(q, np.float32)
    S, Hq, d = q.shape
    H = c["k_codes"].shape[1]
    G, NP = Hq // H, c["k_sums"].shape[3]
    Pc = d // NP
    out = np.zeros((S, Hq, d))
    for b in range(S):
        for h in range(H):
            qs32 = q[b, h * G:(h + 1) * G] * np.float32(1.0 / math.sqrt(d))
            qs = _f64(qs32)
            parts = []
            kr, vr = _residual_tokens(c, b, h, P, ns)
            if len(kr):
                lg = qs @ kr.T
                m = lg.max(1)
                w = np.exp(lg - m[:, None])
                parts.append((m, w.sum(1), w @ vr))
            for kc, vc, sigma, mu, _, tau, nu, _ in _sealed_blocks(c, b, h, P, ns):
                lg = rnd(qs32 * np.float32(sigma)[None]) @ _f64(kc).T + (qs @ _f64(mu))[:, None]
                m = lg.max(1)
                w = np.exp(lg - m[:, None])
                o = np.zeros((G, d))
                for p in range(NP):
                    ch = slice(p * Pc, (p + 1) * Pc)
                    o[:, ch] = rnd(w * _f64(tau)[None, :, p]) @ _f64(vc)[:, ch] + (w @ _f64(nu)[:, p])[:, None]
                parts.append((m, w.sum(1), o))
            out[b, h * G:(h + 1) * G] = _finish(parts, G, d)
    return out


def numpy_dequant_decode(q, c, *, P, ns, bf16=False):
    """Dense float64 attention over the dequantized cache; bf16=True rounds q_s, the dequantized
    sealed K/V and the sealed softmax weights (relative to each block's max) to bf16 first: the
    naive bf16 version the dequant kernel's error is bounded against."""
    rnd = (lambda x: _f64(np.asarray(x, np.float32).astype(BF16))) if bf16 else _f64
    q = np.asarray(q, np.float32)
    S, Hq, d = q.shape
    H = c["k_codes"].shape[1]
    G, NP = Hq // H, c["k_sums"].shape[3]
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
                k = rnd(np.float32(sigma)[None] * np.float32(kc) + np.float32(mu)[None])
                v = rnd((np.float32(tau)[:, :, None] * np.float32(vc).reshape(P, NP, -1)
                         + np.float32(nu)[:, :, None]).reshape(P, d))
                lg = rnd(qs) @ k.T
                m = lg.max(1)
                w = np.exp(lg - m[:, None])
                parts.append((m, w.sum(1), rnd(w) @ v))
            out[b, h * G:(h + 1) * G] = _finish(parts, G, d)
    return out


# ----------------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    head_dim: int
    P: int
    page_size: int
    num_kv_heads: int
    group: int
    pages_per_seq: int
    kv_lens: tuple
    ns: int = 4
    dot_dtype: str = "int8"
    num_splits: int = 1


CASES = [
    # d 64, P 32, page 4P; lengths 0/1/63/64/65, a page boundary (4 + 128), beyond the capacity of
    # 4 + 3 * 128 (clipped to it): mixed in one batch.
    Case("d64_P32_g4_s1", 64, 32, 128, 2, 4, 3, (0, 1, 63, 64, 65, 132, 300, 410)),
    Case("d64_P32_g4_s3", 64, 32, 128, 2, 4, 3, (0, 1, 63, 64, 65, 132, 300, 410),
         num_splits=3),
    # Llama-3 heads (G 4, d 128, P 64, page 4P): length 1000, block-exact 4 + 64 k.
    Case("d128_P64_g4_s2", 128, 64, 256, 2, 4, 4, (1000, 65, 68, 4 + 256)),
    Case("d128_P64_g4_s1", 128, 64, 256, 1, 4, 4, (1000, 65, 68, 4 + 256)),
    Case("d128_P64_g4_s3", 128, 64, 256, 2, 4, 4, (1000, 0, 129, 4 + 512), num_splits=3),
    # page 8P (2 packing groups per page), G 3, one channel group (Pc = P = d).
    Case("d64_P64_g3_page8P_s4", 64, 64, 512, 1, 3, 2, (1000, 4 + 64 * 5, 63)),
    # P 128 = d (NP 1), G 8 -> 32 rows; more splits than a short sequence has groups.
    Case("d128_P128_g8_s2", 128, 128, 512, 1, 8, 2, (1000, 129), num_splits=2),
    # P > d (Pc = d), G 1, no sinks, page 8P.
    Case("d64_P128_g1_ns0_s2", 64, 128, 1024, 2, 1, 1, (0, 63, 1000), ns=0, num_splits=2),
    # d 128, P 32: four channel groups (NP 4: the per-token metadata tile split 4 ways in the kernel).
    Case("d128_P32_g4_np4_s2", 128, 32, 128, 1, 4, 3, (0, 37, 4 + 128, 300), num_splits=2),
]


CASE = {c.name: c for c in CASES}


def build(case: Case, seed=0):
    rng = np.random.default_rng(seed)
    c = make_cache(rng, batch=len(case.kv_lens), num_kv_heads=case.num_kv_heads, head_dim=case.head_dim,
                   P=case.P, page_size=case.page_size, pages_per_seq=case.pages_per_seq, ns=case.ns,
                   kv_lens=list(case.kv_lens))
    q = rng.normal(0, 1, (len(case.kv_lens), case.num_kv_heads * case.group, case.head_dim)).astype(np.float32)
    return q, c


def run_kernel(fn, q, c, case: Case, mode: str, **kw):
    args = [jnp.asarray(c[f]) for f in FIELDS]
    out = fn(jnp.asarray(q), *args, partition_size=case.P, num_sink_tokens=case.ns,
             num_splits=case.num_splits, interpret=(mode == "interpret"), **kw)
    return np.asarray(out)


def v_scale_of(c):
    """max |V| over the cache's valid contents (the output's scale)."""
    vals = [np.nanmax(np.abs(_f64(c[n]))) for n in ("open_v", "sink_v") if c[n].size]
    tau, nu = _f64(c["v_scale"]), _f64(c["v_min"])
    return max(vals + [np.nanmax(np.abs(3 * tau + nu)), np.nanmax(np.abs(nu))])


# ----------------------------------------------------------------------------------------------
# Tests: HACK kernel
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_hack_kernel_matches_numpy_twin(case, mode):
    q, c = build(case)
    out = run_kernel(hack_decode_attention, q, c, case, mode, dot_dtype=case.dot_dtype)
    ref = numpy_kivi_decode(q, c, P=case.P, ns=case.ns)
    assert np.isfinite(out).all()
    empty = np.asarray(case.kv_lens) == 0
    assert (out[empty] == 0).all()
    err, scale = np.abs(out - ref), v_scale_of(c)
    if mode == "interpret":
        assert err.max() <= TIGHT * scale, (err.max(), TIGHT * scale)
    else:
        assert err.max() <= FLIP_BOUND * scale, (err.max(), FLIP_BOUND * scale)
        assert err.mean() <= 8 * TIGHT * scale, (err.mean(), 8 * TIGHT * scale)


def run_config(q, c, case: Case, config: KernelConfig, mode: str):
    return np.asarray(hack_decode_attention(jnp.asarray(q), *[jnp.asarray(c[f]) for f in FIELDS],
                                            partition_size=case.P, num_sink_tokens=case.ns, config=config,
                                            interpret=(mode == "interpret")))


@pytest.mark.parametrize("mode", MODES)
def test_hack_kernel_deterministic_and_split_invariant(mode):
    """Same call twice: identical bits. Another num_splits: equal up to float32 merge order (the
    block-local max makes the INT8 codes independent of the split, DESIGN.md step 2)."""
    case = CASES[0]
    q, c = build(case, seed=1)
    a = run_kernel(hack_decode_attention, q, c, case, mode)
    b = run_kernel(hack_decode_attention, q, c, case, mode)
    assert np.array_equal(a, b)
    other = run_kernel(hack_decode_attention, q, c, dataclasses.replace(case, num_splits=3), mode)
    assert np.abs(other - a).max() <= TIGHT * v_scale_of(c)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", [CASES[1], CASE["d64_P128_g1_ns0_s2"]], ids=lambda c: c.name)
@pytest.mark.parametrize("splits", [1, 3])
def test_hack_kernel_open_split(case, splits, mode):
    """KernelConfig.open_split (sinks and open block in a program of their own) vs the NumPy twin:
    with and without sinks, lengths 0..beyond capacity, 1 and 3 group splits; and vs the same config
    without it (the same INT8 codes: equal up to float32 merge order). (Seed 0: at seed 4 one transient
    INT8 code of this case sits at a rounding tie that float32 and the float64 twin break differently,
    with or without open_split.)"""
    q, c = build(case, seed=0)
    cfg = KernelConfig(num_splits=splits, open_split=True)
    out = run_config(q, c, case, cfg, mode)
    ref = numpy_kivi_decode(q, c, P=case.P, ns=case.ns)
    assert np.isfinite(out).all() and (out[np.asarray(case.kv_lens) == 0] == 0).all()
    tol = (TIGHT if mode == "interpret" else FLIP_BOUND) * v_scale_of(c)
    assert np.abs(out - ref).max() <= tol
    joined = run_config(q, c, case, dataclasses.replace(cfg, open_split=False), mode)
    assert np.abs(out - joined).max() <= TIGHT * v_scale_of(c)


# Llama-3 heads (G 4, d 128, P 64, page 4P) with lengths 1, 63, 64, 65 (+ sinks) and an odd number of
# packing groups (4 + 64 * 12 + 37: 12 sealed blocks = 3 groups, 4 + 64 * 20: 5 groups), shuffled page ids.
ODD_CASE = Case("d128_P64_g4_int8_odd", 128, 64, 256, 1, 4, 6, (1, 4 + 63, 4 + 64, 4 + 65, 4 + 64 * 12 + 37,
                                                               4 + 64 * 20))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("splits,open_split", [(1, False), (3, True), (20, True)], ids=["s1", "s3_open", "s20_open"])
def test_hack_kernel_llama_heads_odd_lengths(splits, open_split, mode):
    """ODD_CASE (Llama-3 heads, lengths 1, 63, 64, 65 + sinks, 3 and 5 packing groups, shuffled pages) vs the
    float64 NumPy twin: 1 split, 3 splits + open_split, and 21 programs (common.combine_splits' Pallas merge,
    most of them empty)."""
    case = dataclasses.replace(ODD_CASE, num_splits=splits)
    q, c = build(case, seed=0)
    out = run_config(q, c, case, KernelConfig(num_splits=splits, open_split=open_split), mode)
    ref = numpy_kivi_decode(q, c, P=case.P, ns=case.ns)
    assert np.isfinite(out).all()
    tol = (TIGHT if mode == "interpret" else FLIP_BOUND) * v_scale_of(c)
    assert np.abs(out - ref).max() <= tol, (np.abs(out - ref).max(), tol)


@pytest.mark.gpu
@pytest.mark.parametrize("case,warps,dot_dtype", [(ODD_CASE, 4, "int8"), (ODD_CASE, 8, "int8"),
                                                  (CASE["d64_P64_g3_page8P_s4"], 4, "int8"),
                                                  (ODD_CASE, 8, "folded_f16")],
                         ids=["llama_w4", "llama_w8", "g3_page8P_w4", "llama_w8_folded_f16"])
def test_hack_kernel_warps_gpu(case, warps, dot_dtype):
    """The kernel compiled at 4 and 8 warps (Triton picks other register layouts for the token-major V
    tile and the unpacked planes) vs the twins: Llama heads, and G 3 with pages of 8P (the second packing
    group of a page is the second quarter of each channel's byte row)."""
    case = dataclasses.replace(case, num_splits=3)
    q, c = build(case, seed=0)
    out = run_config(q, c, case, KernelConfig(num_splits=3, num_warps=warps, dot_dtype=dot_dtype), "gpu")
    assert np.isfinite(out).all() and (out[np.asarray(case.kv_lens) == 0] == 0).all()
    if dot_dtype == "int8":
        assert np.abs(out - numpy_kivi_decode(q, c, P=case.P, ns=case.ns)).max() <= FLIP_BOUND * v_scale_of(c)
    else:
        err, naive = within_2x_naive(out, q, c, case, dot_dtype)
        assert err <= 2 * naive + TIGHT * v_scale_of(c), (err, naive)


@pytest.mark.parametrize("fn", [hack_decode_attention, dequant_decode_attention], ids=["hack", "dequant"])
def test_kernels_reject_channel_major_v_codes(fn):
    """v_codes are token-major, u8[N, H, d, page_size // 4]: the same bytes in k_codes' channel-major order
    ([N, H, page_size // 4, d]) are refused, naming v_codes (here d = 128, page_size // 4 = 64)."""
    case = ODD_CASE
    q, c = build(case, seed=0)
    args = [jnp.asarray(np.swapaxes(c[f], 2, 3) if f == "v_codes" else c[f]) for f in FIELDS]
    with pytest.raises(ValueError, match=r"v_codes must have shape \(\d+, 1, 128, 64\)"):
        fn(jnp.asarray(q), *args, partition_size=case.P, num_sink_tokens=case.ns, interpret=True)


@pytest.mark.parametrize("mode", MODES)
def test_hack_kernel_constant_v_returns_the_constant(mode):
    """tau = 0 (constant V per token group) -> every sealed token's V is nu; with nu the same
    constant everywhere, attention must return it exactly up to float32 rounding (the nu term uses
    float W, DESIGN.md step 3)."""
    case = CASE["d128_P64_g4_s2"]
    q, c = build(case, seed=2)
    for name in ("v_scale", "v_min"):
        c[name] = np.where(np.isnan(c[name]), c[name], np.float16(0.0 if name == "v_scale" else 0.75))
    for name in ("open_v", "sink_v"):
        c[name] = np.where(np.isnan(_f64(c[name])), c[name], BF16(0.75)).astype(BF16)
    out = run_kernel(hack_decode_attention, q, c, case, mode)
    np.testing.assert_allclose(out, 0.75, rtol=0, atol=16 * EPS32)


def test_hack_kernel_on_a_real_cache():
    """A cache written by hack_jax.kv_cache: the kernel on the layer's arrays vs hack_jax's paged
    reference (impl="reference") and vs the NumPy twin reading the same arrays."""
    from hack_jax import attention, kv_cache, paging
    from hack_jax.config import QuantConfig

    config = QuantConfig(partition_size=32, page_size=128, num_sink_tokens=4)
    H, G, d, S, pps = 2, 2, 64, 3, 3
    lens = np.array([0, 70, 300], np.int32)
    alloc = paging.PageAllocator(num_pages=12, max_seqs=S, pages_per_seq=pps, page_size=config.page_size,
                                 num_sink_tokens=config.num_sink_tokens)
    for s, n in enumerate(lens):
        alloc.admit(s, int(n))
    page_indices = jnp.asarray(alloc.page_indices)
    rng = np.random.default_rng(3)
    k = jnp.asarray(rng.normal(0, 1, (S, 300, H, d)), jnp.float32)
    v = jnp.asarray(rng.normal(0, 1, (S, 300, H, d)), jnp.float32)
    layer = kv_cache.init_layer(config, num_kv_heads=H, head_dim=d, num_pages=12, max_seqs=S)
    layer = kv_cache.write_prefill(layer, k, v, lengths=jnp.asarray(lens), page_indices=page_indices)
    q = jnp.asarray(rng.normal(0, 1, (S, H * G, d)), jnp.float32)
    kw = dict(page_indices=page_indices, kv_lens=jnp.asarray(lens))
    ref = np.asarray(attention.decode_attention(q, layer, impl="reference", **kw))
    out = np.asarray(hack_decode_attention(q, *[getattr(layer, f) for f in FIELDS[:12]], page_indices,
                                           jnp.asarray(lens), partition_size=32, num_sink_tokens=4,
                                           interpret=True))
    c = {f: np.asarray(getattr(layer, f)) for f in FIELDS[:12]}
    c.update(page_indices=np.asarray(page_indices), kv_lens=lens)
    twin = numpy_kivi_decode(np.asarray(q), c, P=32, ns=4)
    scale = float(jnp.max(jnp.abs(v)))
    assert np.abs(out - twin).max() <= TIGHT * scale
    assert np.abs(out - ref).max() <= TIGHT * scale
    assert (out[0] == 0).all()


FOLDED_DTYPES = {"folded_f16": np.float16, "folded_bf16": BF16}


def within_2x_naive(out, q, c, case, dot_dtype):
    """(kernel error, naive error) vs float64 attention over the dequantized cache; the naive error is
    numpy_folded_decode's at the same 16-bit dtype (the flash-attention rule: kernel <= 2x naive, plus
    float32 order differences)."""
    exact = numpy_dequant_decode(q, c, P=case.P, ns=case.ns)
    naive = numpy_folded_decode(q, c, P=case.P, ns=case.ns, dtype=FOLDED_DTYPES[dot_dtype])
    return np.abs(out - exact).max(), np.abs(naive - exact).max()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case,dot_dtype", [
    (ODD_CASE, "folded_f16"), (dataclasses.replace(ODD_CASE, num_splits=3), "folded_bf16"),
    (CASE["d64_P32_g4_s3"], "folded_f16"), (CASE["d128_P128_g8_s2"], "folded_f16"),
    (CASE["d64_P64_g3_page8P_s4"], "folded_f16"), (CASE["d64_P128_g1_ns0_s2"], "folded_bf16"),
    (CASE["d128_P32_g4_np4_s2"], "folded_f16")],
    ids=["llama_f16", "llama_s3_bf16", "d64_P32_s3_f16", "P128_g8_f16", "g3_page8P_s4_f16", "P128_d64_ns0_bf16",
         "np4_f16"])
def test_folded_kernel_within_2x_naive_16bit(case, dot_dtype, mode):
    """The scale-folded path (default_config(dot_dtype=folded_*): inline-PTX unpack on the GPU, jnp in
    interpret mode) vs float64 attention over the dequantized cache: its error is at most 2x that of the
    same math done naively at the operand dtype (plus float32 order differences), on lengths off page
    and block boundaries, beyond the capacity and 0, shuffled page tables, NaN metadata in unused slots."""
    q, c = build(case, seed=0)
    out = run_kernel(hack_decode_attention, q, c, case, mode, dot_dtype=dot_dtype)
    assert np.isfinite(out).all() and (out[np.asarray(case.kv_lens) == 0] == 0).all()
    err, naive = within_2x_naive(out, q, c, case, dot_dtype)
    assert naive > 0
    assert err <= 2 * naive + TIGHT * v_scale_of(c), (err, naive)


@pytest.mark.parametrize("mode", MODES)
def test_folded_kernel_open_split_and_constant_v(mode):
    """folded_f16 with sinks + open block in their own program (open_split, 3 splits) against the 2x
    rule; and tau = 0 with one constant nu everywhere returns that constant (the W.nu term is float)."""
    case = dataclasses.replace(CASE["d64_P32_g4_s3"], num_splits=3)
    q, c = build(case, seed=1)
    cfg = dataclasses.replace(default_config(batch=len(case.kv_lens), num_kv_heads=case.num_kv_heads,
                                             pages_per_seq=case.pages_per_seq, page_size=case.page_size,
                                             partition_size=case.P, dot_dtype="folded_f16"),
                              num_splits=3, open_split=True)
    out = run_config(q, c, case, cfg, mode)
    err, naive = within_2x_naive(out, q, c, case, "folded_f16")
    assert err <= 2 * naive + TIGHT * v_scale_of(c), (err, naive)
    for name in ("v_scale", "v_min"):
        c[name] = np.where(np.isnan(c[name]), c[name], np.float16(0.0 if name == "v_scale" else 0.75))
    for name in ("open_v", "sink_v"):
        c[name] = np.where(np.isnan(_f64(c[name])), c[name], BF16(0.75)).astype(BF16)
    out = run_config(q, c, case, cfg, mode)
    live = np.asarray(case.kv_lens) > 0
    np.testing.assert_allclose(out[live], 0.75, rtol=0, atol=16 * EPS32)


def test_folded_plane_bits():
    """common.folded_plane (jnp form) gives MAGIC + code * 2**TOP exactly for every byte and plane, and
    folded_plane_constants undo it: weight * value - offset = code."""
    tile = jnp.arange(256, dtype=jnp.uint8).reshape(16, 16)
    codes = np.arange(256).reshape(16, 16)
    for dot_dtype in FOLDED_DTYPES:
        weight, offset = common.folded_plane_constants(dot_dtype)
        for j in range(4):
            x = np.asarray(common.folded_plane(tile, j, dot_dtype, asm=False), np.float64)
            np.testing.assert_array_equal(weight * x - offset, (codes >> (2 * j)) & 3)


def test_interleaved_plane_bits():
    """common.interleaved_plane (jnp form) gives 1024 + code * 2**top for every byte and plane, in
    INTERLEAVE order (0, 2, 1, 3) within each group of 4, and interleaved_plane_constants undo it; the
    GPU form's word operations (interleaved_word_ops: shift, and, or on 32-bit words of 4 bytes, emulated
    here in NumPy) give the same 16-bit values."""
    rng = np.random.default_rng(11)
    for bits in (2, 4):
        tile = rng.integers(0, 256, (8, 32)).astype(np.uint8)
        words = tile.view("<u4")  # [8, 8]: bytes k..k+3 of a row, byte 0 lowest
        for j, (weight, offset) in enumerate(common.interleaved_plane_constants(bits)):
            codes = (tile.astype(np.int64) >> (bits * j)) & ((1 << bits) - 1)
            want = codes.reshape(8, 8, 4)[:, :, [0, 2, 1, 3]].reshape(8, 32)
            got = np.asarray(common.interleaved_plane(jnp.asarray(tile), j, asm=False, bits=bits), np.float64)
            np.testing.assert_array_equal(weight * got - offset, want)
            (lo, hi), mask = common.interleaved_word_ops(j, bits)
            halves = []
            for shift in (lo, hi):
                w = words.astype(np.uint64)
                w = (w << np.uint64(shift)) if shift > 0 else (w >> np.uint64(-shift))
                r = ((w & np.uint64(mask)) | np.uint64(0x64006400)).astype(np.uint32)
                halves.append(r.view("<u2").reshape(8, 8, 2))  # (bytes 0, 2) or (bytes 1, 3) of each word
            emulated = np.stack([halves[0][..., 0], halves[0][..., 1], halves[1][..., 0], halves[1][..., 1]], -1)
            np.testing.assert_array_equal(emulated.reshape(8, 32).view(np.float16).astype(np.float64), got)


def test_denormal_plane_bits():
    """common.denormal_plane (jnp form) gives code * 2**(bits j) * 2**-24 (an f16 subnormal) exactly for
    every byte and plane, denormal_plane_weight undoes it, and the GPU form's word operations (two PRMTs
    with common.DENORMAL_PRMT's selectors and a zero register, then one AND each; PTX prmt emulated here
    in NumPy) give the same 16-bit values in the same element order."""
    rng = np.random.default_rng(12)
    for bits in (2, 4):
        tile = rng.integers(0, 256, (8, 32)).astype(np.uint8)
        words = tile.view("<u4").astype(np.uint64)  # [8, 8]: bytes k..k+3 of a row, byte 0 lowest
        for j in range(8 // bits):
            codes = (tile.astype(np.int64) >> (bits * j)) & ((1 << bits) - 1)
            got = np.asarray(common.denormal_plane(jnp.asarray(tile), j, asm=False, bits=bits), np.float64)
            assert (got < 2.0 ** -14).all()  # subnormal (or zero): no exponent bits
            np.testing.assert_array_equal(got * common.denormal_plane_weight(j, bits), codes)
            mask = np.uint64((((1 << bits) - 1) << (bits * j)) * 0x10001)

            def prmt(sel):  # PTX prmt.b32 d, a=words, b=0, sel: byte i of d = byte (sel >> 4i) & 7 of {b, a}
                out = np.zeros_like(words)
                for i in range(4):
                    k = (sel >> (4 * i)) & 7
                    src = (words >> np.uint64(8 * k)) & np.uint64(0xFF) if k < 4 else np.zeros_like(words)
                    out |= src << np.uint64(8 * i)
                return out
            halves = [(prmt(sel) & mask).astype(np.uint32).view("<u2").reshape(8, 8, 2) for sel in common.DENORMAL_PRMT]
            emulated = np.concatenate(halves, -1).reshape(8, 32).view(np.float16).astype(np.float64)
            np.testing.assert_array_equal(emulated, got)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("flag", ["interleaved", "denormal", "magic"])
@pytest.mark.parametrize("case", [ODD_CASE, CASE["d64_P32_g4_s3"], CASE["d64_P64_g3_page8P_s4"]],
                         ids=["llama", "d64_P32_s3", "g3_page8P_s4"])
def test_plane_variants_within_2x_naive_f16(case, flag, mode):
    """The folded f16 path's three plane encodings, each vs float64 attention over the dequantized cache:
    within 2x of the naive f16 math, open_split too. interleaved: planes unpacked without byte permutes and
    the K rows, q, sigma, mu, tau, nu read in the planes' order; denormal (default_config's): the codes
    as f16 subnormals (on the GPU this checks that the tensor cores multiply them exactly); magic: 1024 + 64c."""
    q, c = build(case, seed=2)
    fields = {"interleaved": {"interleaved": True}, "denormal": {"denormal": True}, "magic": {"denormal": False}}
    for open_split in (False, True):
        cfg = KernelConfig(num_splits=case.num_splits, open_split=open_split, dot_dtype="folded_f16",
                           **fields[flag])
        out = run_config(q, c, case, cfg, mode)
        assert np.isfinite(out).all() and (out[np.asarray(case.kv_lens) == 0] == 0).all()
        err, naive = within_2x_naive(out, q, c, case, "folded_f16")
        assert err <= 2 * naive + TIGHT * v_scale_of(c), (err, naive, open_split)


def test_resolve_config_validates_options():
    q, c = build(ODD_CASE, seed=0)
    for dot in ("int8", "folded_bf16"):
        with pytest.raises(ValueError, match="interleaved"):
            run_config(q, c, ODD_CASE, KernelConfig(dot_dtype=dot, interleaved=True), "interpret")
    from pallas_kernels.decode_attention import resolve_config
    args = (jnp.zeros((1, 4, 64)), jnp.zeros((3, 1, 64, 64), jnp.uint8), jnp.zeros((3, 1, 256, 1), jnp.uint8),
            jnp.zeros((1, 2), jnp.int32))
    cfg = KernelConfig(dot_dtype="folded_f16", interleaved=True)
    assert resolve_config(*args, partition_size=64, config=cfg, bits=2) == cfg
    with pytest.raises(ValueError, match="2-bit"):
        resolve_config(*args, partition_size=64, config=cfg, bits=4)
    # the keyword sets the flag on the given or the default config; a non-bool is named
    plain = KernelConfig(num_splits=3, dot_dtype="folded_f16")
    assert resolve_config(*args, partition_size=64, config=plain, interleaved=True) == KernelConfig(
        num_splits=3, dot_dtype="folded_f16", interleaved=True)
    assert resolve_config(*args, partition_size=64, dot_dtype="folded_f16", interleaved=True).interleaved is True
    with pytest.raises(ValueError, match="interleaved must be a bool"):
        resolve_config(*args, partition_size=64, dot_dtype="folded_f16", interleaved=1)
    with pytest.raises(ValueError, match="interleaved"):
        resolve_config(*args, partition_size=64, dot_dtype="int8", interleaved=True)
    # denormal: the default for folded_f16 (2- and 4-bit codes); the keyword sets it either way; the interleaved keyword
    # replaces it on the default or a given config; denormal=True asked for with interleaved: a ValueError
    assert resolve_config(*args, partition_size=64, dot_dtype="folded_f16").denormal is True
    for dot in ("int8", "folded_bf16"):
        assert resolve_config(*args, partition_size=64, dot_dtype=dot).denormal is False
    assert resolve_config(*args, partition_size=64, dot_dtype="folded_f16", bits=4).denormal is True
    assert resolve_config(*args, partition_size=64, dot_dtype="folded_f16", denormal=False).denormal is False
    both = resolve_config(*args, partition_size=64, dot_dtype="folded_f16", interleaved=True)
    assert (both.interleaved, both.denormal) == (True, False)
    with pytest.raises(ValueError, match="denormal"):
        resolve_config(*args, partition_size=64, dot_dtype="folded_f16", interleaved=True, denormal=True)
    assert resolve_config(*args, partition_size=64, dot_dtype="folded_f16", denormal=True).denormal is True
    given = resolve_config(*args, partition_size=64, config=dataclasses.replace(plain, denormal=True), interleaved=True)
    assert given == dataclasses.replace(plain, interleaved=True)
    with pytest.raises(ValueError, match="denormal"):
        resolve_config(*args, partition_size=64, config=dataclasses.replace(plain, denormal=True, interleaved=True))
    # denormal=True: folded_f16 only, not with interleaved; a bool or None
    assert resolve_config(*args, partition_size=64, config=plain, denormal=True) == KernelConfig(
        num_splits=3, dot_dtype="folded_f16", denormal=True)
    for bad_dot in ("int8", "folded_bf16"):
        with pytest.raises(ValueError, match="denormal"):
            resolve_config(*args, partition_size=64, dot_dtype=bad_dot, denormal=True)
    with pytest.raises(ValueError, match="denormal"):
        resolve_config(*args, partition_size=64, config=cfg, denormal=True)
    with pytest.raises(ValueError, match="denormal must be a bool"):
        resolve_config(*args, partition_size=64, config=plain, denormal="yes")
    # num_stages overrides the config's pipeline depth; out-of-range or non-int values are named
    assert resolve_config(*args, partition_size=64, config=plain, num_stages=3).num_stages == 3
    for bad in (0, 9, 2.0, True):
        with pytest.raises(ValueError, match="num_stages"):
            resolve_config(*args, partition_size=64, config=plain, num_stages=bad)
    assert resolve_config(*args, partition_size=64, config=plain, num_warps=8).num_warps == 8
    for bad in (0, 3, 32, 8.0, True):
        with pytest.raises(ValueError, match="num_warps"):
            resolve_config(*args, partition_size=64, config=plain, num_warps=bad)
    # maxnreg: default_config caps the folded modes' registers (3 programs per SM), not int8's; a given
    # config's cap is checked
    assert resolve_config(*args, partition_size=64, dot_dtype="folded_f16").maxnreg == 168
    assert resolve_config(*args, partition_size=64, dot_dtype="int8").maxnreg is None
    for bad in (16, 256, 168.0, True, "168"):
        with pytest.raises(ValueError, match="maxnreg"):
            resolve_config(*args, partition_size=64, config=dataclasses.replace(plain, maxnreg=bad))
    # the keyword: 0 removes the cap, N sets it, on the default or a given config; other values are named
    assert resolve_config(*args, partition_size=64, dot_dtype="folded_f16", maxnreg=0).maxnreg is None
    assert resolve_config(*args, partition_size=64, config=plain, maxnreg=200).maxnreg == 200
    for bad in (1, 23, 256, 168.0, True):
        with pytest.raises(ValueError, match="maxnreg must be None, 0"):
            resolve_config(*args, partition_size=64, dot_dtype="folded_f16", maxnreg=bad)


def _lowered_modules(fn, *args):
    """The Triton modules (MLIR text) of the Pallas-Triton kernels in jit(fn) lowered for CUDA: the module
    each lowering returns, after the register cap's wrapper (if any) has set its attributes."""
    from jax._src.pallas.triton import lowering as triton_lowering
    inner = triton_lowering.lower_jaxpr_to_triton_module
    modules = []

    def keep(*a, **k):
        result = inner(*a, **k)
        modules.append(result.module.operation.get_asm(enable_debug_info=False))
        return result
    triton_lowering.lower_jaxpr_to_triton_module = keep
    try:
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        triton_lowering.lower_jaxpr_to_triton_module = inner
    return modules


@pytest.mark.parametrize("dot_dtype,cap", [("folded_f16", 168), ("int8", None), ("int8", 200)])
def test_register_cap_reaches_the_triton_module(dot_dtype, cap):
    """KernelConfig.maxnreg N puts `ttg.maxnreg = N` (Triton's register cap) on the kernel's Triton module and
    `_maxnreg{N}` on its name; without a cap the module has no such attribute. default_config's folded_f16
    cap is 168 (3 programs per SM), int8 has none; an int8 config with a cap of 200 gets it."""
    from pallas_kernels.decode_attention import resolve_config
    case = CASE["d128_P64_g4_s1"]
    q, c = build(case, seed=0)
    arrays = [jnp.asarray(c[f]) for f in FIELDS]
    cfg = resolve_config(q, arrays[0], arrays[3], arrays[12], partition_size=case.P, dot_dtype=dot_dtype)
    if cap != cfg.maxnreg:
        cfg = dataclasses.replace(cfg, maxnreg=cap)
    fn = lambda q, *a: hack_decode_attention(q, *a, partition_size=case.P, num_sink_tokens=case.ns,  # noqa: E731
                                             config=cfg)
    # the kernel's module (with many splits combine_splits lowers a second one, its merge)
    modules = _lowered_modules(fn, jnp.asarray(q), *arrays)
    (module,) = [m for m in modules if "@hack_decode_attention" in m.splitlines()[0]]
    header = module.splitlines()[0]
    if cap is None:
        assert "maxnreg" not in header, header
    else:
        assert f"@hack_decode_attention_maxnreg{cap} " in header and f"ttg.maxnreg = {cap} : i32" in header, header


# ----------------------------------------------------------------------------------------------
# Tests: dequant baseline
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", [dataclasses.replace(CASES[0], name="d64_P32_g4_s16", num_splits=16),
                                  CASE["d128_P64_g4_s1"]],
                         ids=lambda c: c.name)  # 16 splits: combine_splits' kernel; the other XLA's merge
def test_dequant_kernel_within_2x_naive_bf16(case, mode):
    q, c = build(case)
    out = run_kernel(dequant_decode_attention, q, c, case, mode)
    exact = numpy_dequant_decode(q, c, P=case.P, ns=case.ns)
    naive = numpy_dequant_decode(q, c, P=case.P, ns=case.ns, bf16=True)
    assert np.isfinite(out).all()
    assert (out[np.asarray(case.kv_lens) == 0] == 0).all()
    naive_err = np.abs(naive - exact).max()
    assert naive_err > 0
    assert np.abs(out - exact).max() <= 2 * naive_err + TIGHT * v_scale_of(c)


# ----------------------------------------------------------------------------------------------
# Tests: helpers, config, validation (no kernel compile)
# ----------------------------------------------------------------------------------------------


def test_in_kernel_quantizer_matches_hack_jax_quantize():
    from hack_jax import quantization
    rng = np.random.default_rng(4)
    x = rng.normal(0, 1, (16, 64)).astype(np.float32)
    x[3] = 0.25  # constant row: scale 0, codes 0
    x[5, :8] = np.round(x[5, :8] * 4) / 4  # some exact binary fractions
    for interpret in (True, False):  # eager: the magic-number rounding is not folded away
        codes, s, mf = common.quantize_rows_int8(jnp.asarray(x), interpret=interpret)
        ref = quantization.quantize(jnp.asarray(x), bits=8, axis=1, partition_size=64, meta_dtype=jnp.float32)
        np.testing.assert_array_equal(np.asarray(codes), np.asarray(ref.codes, np.float32))
        np.testing.assert_array_equal(np.asarray(s), np.asarray(ref.scale)[:, 0])
        np.testing.assert_array_equal(np.asarray(mf), np.asarray(ref.minimum)[:, 0])


def test_round_half_even_both_paths():
    x = jnp.asarray([0.5, 1.5, 2.5, -0.5, -1.5, 126.5, 127.49, -127.5, 3.0], jnp.float32)
    want = np.round(np.asarray(x))
    for interpret in (True, False):
        np.testing.assert_array_equal(np.asarray(common.round_half_even(x, interpret=interpret)), want)


def test_test_packing_matches_hack_jax_packing():
    from hack_jax import packing
    codes = np.random.default_rng(5).integers(0, 4, (128, 16)).astype(np.uint8)
    np.testing.assert_array_equal(pack_group(codes), np.asarray(packing.pack_2bit(jnp.asarray(codes), axis=0)))


def test_merge_and_combine_empty_parts_stay_finite():
    m = jnp.full((4,), -jnp.inf)
    l = jnp.zeros((4,))
    acc = (jnp.zeros((4, 8)),)
    nan = jnp.full((4, 8), jnp.nan)
    valid = jnp.array([False, False, True, True])
    m2, l2, (a2,) = common.merge_state(m, l, acc, jnp.array([jnp.nan, 1.0, 0.5, 2.0]),
                                       jnp.array([jnp.nan, 1.0, 2.0, 3.0]),
                                       (jnp.where(valid[:, None], 1.0, nan),), valid)
    assert np.isfinite(np.asarray(a2)).all() and np.isfinite(np.asarray(l2)).all()
    np.testing.assert_array_equal(np.asarray(m2), [-np.inf, -np.inf, 0.5, 2.0])
    out = common.lse_combine(jnp.stack([m, m2]), jnp.stack([l, l2]), jnp.stack([acc[0], a2]), axes=0)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_array_equal(np.asarray(out[:2]), 0.0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("programs,heads,q_per_kv,head_dim", [(43, 8, 4, 128), (20, 2, 7, 64), (5, 2, 4, 32),
                                                             (86, 1, 7, 32)])
def test_combine_splits_vs_numpy(programs, heads, q_per_kv, head_dim, mode):
    """common.combine_splits vs a float64 log-sum-exp merge: rows past `programs` hold NaN (never written by
    a kernel: must not be read), one empty state (m -inf, l 0) per (sequence, kv head), one all-empty row,
    one (sequence, kv head) whose states all have m near -200 (an empty state's weight must not take their
    place); 43 and 20 programs take its Pallas kernel (PALLAS_COMBINE_MIN_PROGRAMS), 5 (too few) and 86 (128
    rows, rounded up, x 8 heads: over COMBINE_MAX_PARTIALS, so not padded) the jnp lse_combine."""
    rng = np.random.default_rng(programs)
    batch, num_q_heads, pad = 2, heads * q_per_kv, common.q_per_kv_pad(q_per_kv, at_least=4)
    slots = common.split_slots(programs, pad, head_dim)
    m = rng.normal(size=(batch, heads, slots, pad)) * 20
    m[1, 0] = rng.normal(size=m[1, 0].shape) - 200
    l = rng.uniform(0.5, 3.0, size=m.shape)
    acc = rng.normal(size=m.shape + (head_dim,))
    m[:, :, 1] = -np.inf
    l[:, :, 1] = acc[:, :, 1] = 0
    m[0, 0, :, 0], l[0, 0, :, 0], acc[0, 0, :, 0] = -np.inf, 0, 0  # a row that attended to nothing
    m[:, :, programs:] = l[:, :, programs:] = acc[:, :, programs:] = np.nan
    w = np.exp(m[:, :, :programs] - np.max(np.where(np.isinf(m), -1e300, m)[:, :, :programs], axis=2, keepdims=True))
    l_tot = np.sum(w * l[:, :, :programs], axis=2)
    with np.errstate(invalid="ignore"):
        want = np.where(l_tot[..., None] > 0, np.sum(w[..., None] * acc[:, :, :programs], axis=2) / l_tot[..., None], 0)
    want = want[:, :, :q_per_kv].reshape(batch, num_q_heads, head_dim)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    got = np.asarray(common.combine_splits(f32(acc), f32(m), f32(l), num_q_heads, programs=programs,
                                           interpret=(mode == "interpret")))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert (got[0, 0] == 0).all()


def test_default_config_and_rows():
    cfg = default_config(batch=8, num_kv_heads=8, pages_per_seq=128, page_size=256, partition_size=64)
    assert isinstance(cfg, KernelConfig) and cfg.dot_dtype == "int8"
    assert KernelConfig() == KernelConfig(num_splits=1, open_split=False, dot_dtype="int8", num_warps=4, num_stages=2)
    for dot_dtype, resident in RESIDENT_PROGRAMS_PER_SM.items():
        slots = resident * 132  # programs resident at once on the H200

        def cost(pairs, groups, s, o):  # waves x (longest program's groups + one group of fixed cost)
            longest = math.ceil(groups / s) if o else groups // s + 1  # without o, split 0 adds the open block
            return math.ceil(pairs * (s + o) / slots) * (longest + 1)

        for batch, pages in ((1, 128), (8, 128), (32, 128), (1, 4), (8, 4), (64, 128), (1, 1), (3, 37)):
            cfg = default_config(batch=batch, num_kv_heads=8, pages_per_seq=pages, page_size=256, partition_size=64,
                                 dot_dtype=dot_dtype)
            n, o = cfg.num_splits, cfg.open_split
            assert cfg.dot_dtype == dot_dtype and 1 <= n <= pages  # at most one split per packing group here
            assert all(cost(batch * 8, pages, n, o) <= cost(batch * 8, pages, s, oo)
                       for s in range(1, pages + 1) for oo in (False, True))
    # the H200 cases of the docstring ("int8": 3 programs per SM): one wave at batch 1 and 8, two full
    # waves instead of one two-thirds-empty wave at batch 32; an open split at 1K tokens
    got = [(lambda cfg: (cfg.num_splits, cfg.open_split))(default_config(
        batch=b, num_kv_heads=8, pages_per_seq=pps, page_size=256, partition_size=64))
        for b, pps in ((1, 128), (8, 128), (32, 128), (1, 4), (8, 4))]
    assert got == [(43, False), (6, False), (3, False), (4, True), (4, True)]
    assert [q_per_kv_pad(g, at_least=4) for h, g in ((8, 1), (8, 3), (8, 4), (8, 8))] == [4, 4, 4, 8]


def test_validation_errors():
    case = CASES[0]
    q, c = build(case)
    args = {f: jnp.asarray(c[f]) for f in FIELDS}
    kw = dict(partition_size=case.P, num_sink_tokens=case.ns, interpret=True)

    def call(q=jnp.asarray(q), **over):
        a = dict(args, **{k: v for k, v in over.items() if k in FIELDS})
        opts = dict(kw, **{k: v for k, v in over.items() if k not in FIELDS})
        return hack_decode_attention(q, *[a[f] for f in FIELDS], **opts)

    with pytest.raises(ValueError, match="partition_size"):
        call(partition_size=16)
    with pytest.raises(ValueError, match="k_scale"):
        call(k_scale=args["k_scale"][:, :, :2])
    with pytest.raises(ValueError, match="k_codes"):
        call(k_codes=args["k_codes"].astype(jnp.int8))
    with pytest.raises(ValueError, match="kv_lens"):
        call(kv_lens=args["kv_lens"].astype(jnp.float32))
    with pytest.raises(ValueError, match="num_q_heads"):
        call(q=jnp.asarray(q[:, :3]))
    with pytest.raises(ValueError, match="dot_dtype"):
        call(dot_dtype="fp8")
    with pytest.raises(ValueError, match="num_splits"):
        call(num_splits=0)
    with pytest.raises(ValueError, match="dot_dtype"):
        call(config=KernelConfig(dot_dtype="bf16"))
    with pytest.raises(ValueError, match="config"):
        call(config={"num_splits": 2})
    with pytest.raises(TypeError, match="k_codes must be an array"):  # the layer form is gone
        hack_decode_attention(jnp.asarray(q), object(), *[args[f] for f in FIELDS[1:]], **kw)
    with pytest.raises(ValueError, match="page_indices"):
        call(page_indices=args["page_indices"][:2])


# ----------------------------------------------------------------------------- a real cache for the dispatch tests

KIVI_ARRAYS = ("k_codes", "k_scale", "k_min", "k_sums", "v_codes", "v_scale", "v_min", "v_sums", "open_k", "open_v",
               "sink_k", "sink_v")  # a kivi layer's arrays in the kernels' order (hack_jax.attention.kernel_args)


def prefilled_kivi_layer(seed=4):
    """A hack kivi layer (P 64, page 256, 4 sinks, 2 kv heads, head_dim 128) written by write_prefill with lengths
    300 and 70 (sinks, sealed blocks, open tokens) and a q of 8 heads: (layer, page_indices, lengths, q)."""
    from hack_jax import kv_cache
    from hack_jax.config import QuantConfig
    cfg = QuantConfig(kv_format="hack", layout="kivi", partition_size=64, page_size=256, num_sink_tokens=4)
    rng = np.random.default_rng(seed)
    lengths = np.array([300, 70], np.int32)
    layer = kv_cache.init_layer(cfg, num_kv_heads=2, head_dim=128, num_pages=6, max_seqs=2)
    page_indices = np.array([[1, 2], [3, 4]], np.int32)
    k = rng.normal(0, 1, (2, 320, 2, 128)).astype(np.float32)
    v = rng.normal(0, 1, (2, 320, 2, 128)).astype(np.float32)
    layer = kv_cache.write_prefill(layer, jnp.asarray(k), jnp.asarray(v), lengths=jnp.asarray(lengths),
                                   page_indices=jnp.asarray(page_indices))
    return layer, page_indices, lengths, rng.normal(0, 1, (2, 8, 128)).astype(np.float32)


def check_vs_dequantized(out, layer, page_indices, lengths, q, atol):
    """out f32[S, Hq, D] against float64 attention over hack_jax's dequantization of the layer."""
    from hack_jax import kv_cache
    kd, vd = kv_cache.dequantize_cache(layer, jnp.asarray(page_indices), jnp.asarray(lengths))
    kd, vd = np.asarray(kd, np.float64), np.asarray(vd, np.float64)
    g = q.shape[1] // kd.shape[2]  # query heads per kv head
    for s_, n in enumerate(lengths):
        for hq in range(q.shape[1]):
            lg = kd[s_, :n, hq // g] @ (q[s_, hq].astype(np.float64) / math.sqrt(q.shape[2]))
            w = np.exp(lg - lg.max())
            np.testing.assert_allclose(np.asarray(out)[s_, hq], w @ vd[s_, :n, hq // g] / w.sum(), atol=atol)
