"""hack_jax.prefill: exact causal prefill on the fresh 16-bit K/V, chunked over the cached prefix.

Oracles are float64 NumPy attention written here (np_causal), on the unquantized K/V or on the
cache's own dequantized prefix (twin.gather, a host-side read of the stored bytes).
Geometry: 3 slots of 150 / 70 / 0 tokens (sinks 4, sealed blocks [4, 68) and [68, 132), an open
block of 18 / 2 tokens), head_dim 64, 2 kv heads, GQA group 2; T = 160 rows (not a power of two).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hack_jax import attention, kv_cache, paging, reference
from hack_jax import prefill as hp
from hack_jax.config import QuantConfig
import twin

S, T, H, G, D = 3, 160, 2, 2, 64
LENGTHS = np.array([150, 70, 0], np.int32)
PAGES_PER_SEQ = 2
FORMATS = {"hack": QuantConfig(), "bf16": QuantConfig(kv_format="bf16"),
           "float32": QuantConfig(kv_format="float32")}
# hack4 (only where a test names it): blocks of 32, so a 100- or 132-token prefix fills both packing groups of a page
CONFIGS = {**FORMATS, "hack4": QuantConfig(bits=4, partition_size=32)}
EXACT_CPU = ("reference", "xla", "pallas")  # the backends that run here (cudnn: tests/gpu)


def bf16_exact(x):
    return np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))


def make_qkv(seed=0):
    rng = np.random.default_rng(seed)
    q = bf16_exact(rng.standard_normal((S, T, H * G, D)))
    k = bf16_exact(rng.standard_normal((S, T, H, D)))
    v = bf16_exact(rng.standard_normal((S, T, H, D)))
    return q, k, v


def setup(fmt, lengths=LENGTHS):
    cfg = CONFIGS[fmt]
    sinks = kv_cache.sink_tokens(cfg)
    alloc = paging.PageAllocator(1 + S * PAGES_PER_SEQ, S, PAGES_PER_SEQ, cfg.page_size, sinks)
    for s in reversed(range(S)):  # pages handed out in reverse: a non-identity table
        alloc.admit(s, int(lengths[s]) + 1)
    layer = kv_cache.init_layer(cfg, num_kv_heads=H, head_dim=D, num_pages=1 + S * PAGES_PER_SEQ,
                                max_seqs=S)
    return layer, alloc.page_indices


def np_causal(q, k, v, n, start=0, k_prefix=None, v_prefix=None):
    """float64 attention of one sequence's rows t < n (positions start + t) over the prefix keys
    (k_prefix [start, H, D], all visible) and the fresh keys at positions <= their own."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    kp = np.zeros((0, H, D)) if k_prefix is None else np.asarray(k_prefix, np.float64)
    vp = np.zeros((0, H, D)) if v_prefix is None else np.asarray(v_prefix, np.float64)
    out = np.zeros(q.shape)
    for t in range(n):
        kk = np.concatenate([kp, k[:t + 1]]).repeat(G, axis=1)  # [keys, Hq, D]
        vv = np.concatenate([vp, v[:t + 1]]).repeat(G, axis=1)
        logits = np.einsum("hd,jhd->hj", q[t], kk) / np.sqrt(D)
        w = np.exp(logits - logits.max(-1, keepdims=True))
        out[t] = np.einsum("hj,jhd->hd", w / w.sum(-1, keepdims=True), vv)
    return out


def oracle(q, k, v, lengths=LENGTHS):
    return np.stack([np_causal(q[s], k[s], v[s], int(lengths[s])) for s in range(S)])


def run(fmt, q, k, v, attn, lengths=LENGTHS):
    layer, table = setup(fmt, lengths)
    opts = {"interpret": True} if attn == "pallas" else {}
    return hp.prefill(q, k, v, layer, page_indices=table, lengths=lengths, attention=attn, **opts)


# ------------------------------------------------------------------------------ (a) causality


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("attn", EXACT_CPU)
def test_exact_prefill_is_causal(fmt, attn):
    """Changing token 100 of slot 0 (x8, K and V) leaves rows 0..99 bit-identical."""
    q, k, v = make_qkv()
    _, out = run(fmt, q, k, v, attn)
    k2, v2 = k.copy(), v.copy()
    k2[0, 100] *= 8
    v2[0, 100] *= 8
    _, out2 = run(fmt, q, k2, v2, attn)
    out, out2 = np.asarray(out), np.asarray(out2)
    np.testing.assert_array_equal(out2[0, :100], out[0, :100])
    np.testing.assert_array_equal(out2[1:], out[1:])
    assert np.abs(out2[0, 100:150] - out[0, 100:150]).max() > 1e-2  # the change is seen after


def test_chunked_prefill_is_causal():
    """The same within a chunk that attends to a cached (2-bit) prefix."""
    q, k, v = make_qkv()
    outs = []
    for scale in (1, 8):
        k2, v2 = k.copy(), v.copy()
        k2[0, 120] *= scale
        v2[0, 120] *= scale
        # cut at 100 (mid-block), as the hack kernel test's [100]: the same compiled chunk programs
        outs.append(np.concatenate(chunked("hack", q, k2, v2, [100])[1], axis=1))
    np.testing.assert_array_equal(outs[1][0, :120], outs[0][0, :120])
    assert np.abs(outs[1][0, 120:150] - outs[0][0, 120:150]).max() > 1e-2


def test_homomorphic_option_is_not_causal():
    """attention="homomorphic" (the paper's numerics over the 2-bit cache) is documented as not
    causal: a query sees its own block's codes, whose min/max include the block's later tokens.
    Token 100 lies in block [68, 132): rows 68..99 move, rows 0..67 do not."""
    q, k, v = make_qkv()
    _, out = run("hack", q, k, v, "homomorphic")
    k2 = k.copy()
    k2[0, 100] *= 8
    _, out2 = run("hack", q, k2, v, "homomorphic")
    diff = np.abs(np.asarray(out2) - np.asarray(out))[0]
    assert diff[:68].max() == 0
    assert diff[68:100].max() > 1e-2


# ---------------------------------------------------------------- (b) vs float64 attention


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("attn", EXACT_CPU)
def test_exact_prefill_matches_float64_attention(fmt, attn):
    """Exact up to the dtype: float32 backends to 1e-5 * max|V|; the bf16 Pallas kernel (bf16 q
    and softmax weights in the dots) to 2x the error of the same math done naively in bf16."""
    q, k, v = make_qkv(1)
    layer, out = run(fmt, q, k, v, attn)
    out, want = np.asarray(out, np.float64), oracle(q, k, v)
    assert np.all(out[2] == 0) and np.all(out[1, 70:] == 0)
    err = np.abs(out - want).max()
    if attn == "pallas":
        naive = np.stack([np_causal(bf16_exact(q[s]), k[s], v[s], int(LENGTHS[s])) for s in range(S)])
        naive = np.abs(bf16_exact(naive) - want).max()  # rounding q and the output to bf16
        assert err <= 2 * naive, (err, naive)
    else:
        assert err <= 1e-5 * np.abs(v).max(), err
    # the cache holds what write_prefill stores (the same call, checked byte for byte)
    ref_layer, table = setup(fmt)
    ref_layer = kv_cache.write_prefill(ref_layer, k, v, lengths=LENGTHS, page_indices=table)
    for a, b in zip(jax.tree.leaves(layer), jax.tree.leaves(ref_layer)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_errors_leave_the_cache_alone():
    q, k, v = make_qkv()
    layer, table = setup("hack")
    with pytest.raises(ValueError, match="attention must be one of"):
        hp.prefill(q, k, v, layer, page_indices=table, lengths=LENGTHS, attention="flash")
    with pytest.raises(ValueError, match="matching k/v"):
        hp.prefill(q[:, :10], k, v, layer, page_indices=table, lengths=LENGTHS)
    with pytest.raises(ValueError, match="no log-sum-exp"):
        hp.prefill(q, k, v, layer, page_indices=table, lengths=LENGTHS, q_start=LENGTHS * 0,
                   attention="pallas")
    with pytest.raises(ValueError, match="lengths"):
        hp.prefill(q, k, v, layer, page_indices=table, lengths=-LENGTHS)
    assert all(not np.asarray(x).any() for x in jax.tree.leaves(layer))  # still all zeros


# --------------------------------------------------------------------- (c) chunked prefill


def chunked(fmt, q, k, v, cuts, lengths=LENGTHS, **options):
    """Prefills rows [c_i, c_{i+1}) per call (cuts = the inner boundaries); options go to
    hp.prefill (impl=, interpret=). Returns (layer, [out chunk]); chunk outputs f32[S, c_{i+1} - c_i,
    Hq, D]."""
    layer, table = setup(fmt, lengths)
    bounds = [0, *cuts, T]
    outs = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        n = np.clip(lengths - lo, 0, hi - lo).astype(np.int32)
        start = None if lo == 0 else np.minimum(lengths, lo).astype(np.int32)
        layer, out = hp.prefill(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], layer, page_indices=table,
                                lengths=n, q_start=start, attention="reference", **options)
        outs.append(np.asarray(out, np.float64))
    return layer, outs


def chunk_oracles(fmt, q, k, v, cuts):
    """Per chunk, f64[S, rows, Hq, D]: float64 attention over the prefix AS STORED (twin.gather of
    the cache after the earlier chunks: 2-bit for hack) and the chunk's own exact tokens."""
    staged, table = setup(fmt)
    bounds, wants = [0, *cuts, T], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        n = np.clip(LENGTHS - lo, 0, hi - lo)
        want = np.zeros((S, hi - lo, H * G, D))
        for s in range(S):
            start = int(min(LENGTHS[s], lo))
            kp, vp = twin.gather(staged, s, start, table) if start else (None, None)
            want[s] = np_causal(q[s, lo:hi], k[s, lo:hi], v[s, lo:hi], int(n[s]), start, kp, vp)
        wants.append(want)
        staged = kv_cache.write_prefill(staged, k[:, lo:hi], v[:, lo:hi], lengths=n.astype(np.int32),
                                        page_indices=table, start=None if lo == 0 else
                                        np.minimum(LENGTHS, lo).astype(np.int32))
    return wants


@pytest.mark.parametrize("fmt", FORMATS)
# cut sets whose chunk shapes (rows, first chunk or not) recur in the module's other chunk tests, so that
# they reuse the compiled write / attention programs: [36, 100]'s later chunks are [68, 132]'s 64 rows
# and the hack kernel test's [100] 60 rows
@pytest.mark.parametrize("cuts", [[64], [36, 100], [68, 132]], ids=str)
def test_chunked_matches_its_float64_oracle_and_stores_one_shot_bytes(fmt, cuts):
    """Each chunk = float64 attention over the prefix AS STORED (gather: 2-bit for hack) and its
    own exact tokens: 1e-5 * max|V| for the 16-bit formats; for hack the homomorphic INT8 Q / W
    quantization of the prefix adds its own error (measured <= 4e-3 * max|V|, bound 1e-2). The
    cache bytes equal one write_prefill's (bf16-exact K/V, nearest rounding)."""
    q, k, v = make_qkv(2)
    layer, outs = chunked(fmt, q, k, v, cuts)
    one_layer, table = run(fmt, q, k, v, "reference")[0], setup(fmt)[1]
    for a, b in zip(jax.tree.leaves(layer), jax.tree.leaves(one_layer)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tol = (1e-2 if fmt == "hack" else 1e-5) * np.abs(v).max()
    for i, want in enumerate(chunk_oracles(fmt, q, k, v, cuts)):
        err = np.abs(outs[i] - want).max()
        assert err <= tol, (i, err)


@pytest.mark.parametrize("mode", ["interpret", pytest.param("gpu", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("cuts", [[100], [68, 132]], ids=str)
@pytest.mark.parametrize("fmt", ["hack", "hack4"])
def test_chunked_prefix_through_the_hack_kernel(fmt, cuts, mode):
    """impl="pallas" (Pallas interpret mode, or compiled on the GPU): the cached prefix is read by the
    HACK prefill kernel in prefix mode on the 2- or 4-bit codes (scale-folded f16 operands by default), inside
    hack_jax.prefill as a model layer calls it. Each chunk vs float64 attention over the prefix as
    stored: within 1e-2 * max|V| and, chunk by chunk, a mean error no larger than the reference
    (INT8 requantized) path's plus float32 slack; the cache holds the same bytes."""
    q, k, v = make_qkv(2)
    layer, outs = chunked(fmt, q, k, v, cuts, impl="pallas", interpret=mode == "interpret")
    ref_layer, ref_outs = chunked(fmt, q, k, v, cuts)
    for a, b in zip(jax.tree.leaves(layer), jax.tree.leaves(ref_layer)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    scale = np.abs(v).max()
    for i, want in enumerate(chunk_oracles(fmt, q, k, v, cuts)):
        err, ref_err = np.abs(outs[i] - want), np.abs(ref_outs[i] - want)
        print(f"\nchunk {i}: kernel prefix max {err.max():.2e} mean {err.mean():.2e}; reference prefix "
              f"max {ref_err.max():.2e} mean {ref_err.mean():.2e}")
        assert err.max() <= 1e-2 * scale, (i, err.max())
        assert err.mean() <= ref_err.mean() + 1e-6 * scale, (i, err.mean(), ref_err.mean())


def test_chunked_vs_one_shot_error_against_float64():
    """hack: one-shot rows are exact; chunk rows (cut at 68: the prefix is 4 sinks + one sealed
    2-bit block) see the prefix through the 2-bit cache. Their error vs float64 attention on the
    unquantized K/V must stay within that of the homomorphic prefill (every earlier token through
    the 2-bit cache, own block included) on the same rows (slot 0, rows 68..149)."""
    q, k, v = make_qkv(3)
    want = oracle(q, k, v)[0, 68:150]
    one = np.abs(np.asarray(run("hack", q, k, v, "reference")[1])[0, 68:150] - want)
    hom = np.abs(np.asarray(run("hack", q, k, v, "homomorphic")[1])[0, 68:150] - want).mean()
    chk = np.abs(chunked("hack", q, k, v, [68])[1][1][0, :82] - want).mean()
    print(f"\nmean |err| vs float64, slot 0 rows 68..149: one-shot {one.mean():.2e}, chunked "
          f"{chk:.3e}, homomorphic {hom:.3e}")
    assert one.max() <= 1e-5 * np.abs(v).max()
    assert 1e-4 < chk <= hom  # the prefix really is read as 2-bit codes, and it is no worse


def test_reference_prefix_in_key_tiles():
    """Past its logits limit the reference's dense path walks the keys in tiles with an online
    softmax (memory for a long chunk over a long prefix): the prefix state of rows 100..159 over 100
    cached bf16 tokens read in tiles of 7 keys equals the one-piece read to 1e-6 * max|V|, and both
    equal float64 attention over the stored prefix to 1e-5 * max|V|."""
    q, k, v = make_qkv(6)
    layer, table = setup("bf16")
    cut = np.minimum(LENGTHS, 100).astype(np.int32)
    layer, _ = hp.prefill(q[:, :100], k[:, :100], v[:, :100], layer, page_indices=table, lengths=cut,
                          attention="reference")
    qc = jnp.asarray(q[:, 100:160])
    q_pos = jnp.broadcast_to(jnp.asarray(cut)[:, None] - 1, (S, 60))
    outs = [np.asarray(reference.softmax_state_output(attention._dense(qc, layer, jnp.asarray(table),
                                                                       jnp.asarray(cut), q_pos, limit=lim)))
            for lim in (attention.DENSE_LOGITS_LIMIT, S * H * G * 60 * 7)]
    scale = np.abs(v).max()
    np.testing.assert_allclose(outs[1], outs[0], rtol=0, atol=1e-6 * scale)
    for s in range(2):  # slot 2 holds nothing
        kp, vp = (np.asarray(x, np.float64).repeat(G, axis=1) for x in twin.gather(layer, s, int(cut[s]), table))
        logits = np.einsum("thd,jhd->thj", np.asarray(q[s, 100:160], np.float64), kp) / np.sqrt(D)
        w = np.exp(logits - logits.max(-1, keepdims=True))
        want = np.einsum("thj,jhd->thd", w / w.sum(-1, keepdims=True), vp)
        assert np.abs(outs[1][s] - want).max() <= 1e-5 * scale
    assert not outs[1][2].any()


# -------------------------------------------------------------------- (d) prefill, then decode


@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_then_decode_matches_the_next_prefill_row(fmt):
    """prefill(n) + append/decode of token n vs the last row of prefill(n + 1) and the float64
    oracle. 16-bit formats: equal to 1e-5 * max|V|. hack: a 1-token chunk equals the decode step
    to 1e-5 where token n seals no block (both see the open block in 16 bits); the decode row's
    error vs float64 stays within the 2-bit noise of the homomorphic row at that position."""
    q, k, v = make_qkv(4)
    n = np.array([100, 67, 130], np.int32)  # 67 and 130: the appended token seals its block
    layer, table = setup(fmt, n)
    layer, _ = hp.prefill(q, k, v, layer, page_indices=table, lengths=n, attention="reference")
    at = lambda x: x[np.arange(S), n]  # row n of each slot
    appended = kv_cache.append(layer, at(k), at(v), kv_lens=n + 1, active=np.ones(S, bool),
                               page_indices=table)
    dec = np.asarray(attention.decode_attention(at(q), appended, page_indices=table, kv_lens=n + 1),
                     np.float64)
    full = np.asarray(run(fmt, q, k, v, "reference", n + 1)[1], np.float64)
    want = np.stack([np_causal(q[s], k[s], v[s], int(n[s]) + 1)[n[s]] for s in range(S)])
    scale = np.abs(v).max()
    assert np.abs(at(full) - want).max() <= 1e-5 * scale
    if fmt != "hack":
        assert np.abs(dec - want).max() <= 1e-5 * scale
        return
    _, one = hp.prefill(at(q)[:, None], at(k)[:, None], at(v)[:, None], layer,
                        page_indices=table, lengths=np.ones(S, np.int32), q_start=n,
                        attention="reference")
    np.testing.assert_allclose(np.asarray(one)[0, 0], dec[0], atol=1e-5 * scale)  # no seal at 100
    hom = np.asarray(run(fmt, q, k, v, "homomorphic", n + 1)[1], np.float64)
    dec_err, hom_err = np.abs(dec - want).mean(), np.abs(at(hom) - want).mean()
    print(f"\nhack decode row mean |err| {dec_err:.3e}, homomorphic row {hom_err:.3e}")
    assert 1e-4 < dec_err <= 1.5 * hom_err


# ------------------------------------------------------------------------------------ GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("with_prefix", [False, True], ids=["one_shot", "chunk"])
def test_cudnn_prefill_matches_float64_attention(with_prefix):
    """cuDNN flash attention on bf16 q/k/v (GQA, padding-causal, ragged): within 2x the error of
    the same math done naively in bf16 (q and output rounded); as a chunk over a cached bf16
    prefix its float32 log-sum-exp merges to the reference backend's result (same tolerance)."""
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in make_qkv(5))
    assert hp.resolve("auto", q.dtype, k.dtype) == "cudnn"
    qf, kf, vf = (np.asarray(x, np.float32) for x in (q, k, v))
    if not with_prefix:
        _, out = run("bf16", q, k, v, "cudnn")
        want = oracle(qf, kf, vf)
        naive = np.abs(bf16_exact(want) - want).max()
        assert np.abs(np.asarray(out, np.float64) - want).max() <= 2 * naive + 1e-2 * np.abs(vf).max()
        return
    layer, table = setup("bf16")
    cut = np.minimum(LENGTHS, 64).astype(np.int32)
    layer, _ = hp.prefill(q[:, :64], k[:, :64], v[:, :64], layer, page_indices=table, lengths=cut)
    rest = (LENGTHS - cut).astype(np.int32)
    got = [np.asarray(hp.prefill(q[:, 64:], k[:, 64:], v[:, 64:], layer, page_indices=table,
                                 lengths=rest, q_start=cut, attention=attn)[1], np.float64)
           for attn in ("cudnn", "reference")]
    assert np.abs(got[0] - got[1]).max() <= 1e-2 * np.abs(vf).max()
