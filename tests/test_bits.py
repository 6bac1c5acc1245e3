"""QuantConfig.bits = 4: the HACK cache with 4-bit codes (scale = (max - min) / 15), two blocks per
packing group (a byte holds block 2g's code in its low nibble and block 2g + 1's in its high one).

The cache (written by prefill, appends or both, shuffled page table, poisoned beyond each length) is
decoded by the float64 twin's own NumPy reader (tests/twin.py, the bit order of DESIGN.md "packing")
and compared with the library's dequantization; the paged reference, the Pallas decode kernel (interpret
mode, both operand families; the fused append + decode kernel) and the prefill kernel (whole prompts and a
chunk's cached prefix) with the twin's homomorphic attention on the same codes, at the attention suite's
tolerances (tier a); 4-bit against the unquantized K/V and against 2-bit (tier c, at the cache and at the
model level).
"""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import twin
from hack_jax import attention, kv_cache, packing
from hack_jax.config import QuantConfig
from pallas_kernels import common
from test_attention_suite import HEAD_DIM, NUM_KV_HEADS, NUM_Q_HEADS, TIGHT, check, make_q

P, NS = 32, 4
B4 = QuantConfig(partition_size=P, page_size=2 * P, bits=4)  # a page is one packing group of 2 blocks
B4_PAGE4 = QuantConfig(partition_size=P, page_size=4 * P, bits=4)  # 2 packing groups per page
B4_W64 = QuantConfig(partition_size=P, page_size=4 * P, bits=4, window=64)  # 2 blocks seal together
SEED4 = QuantConfig(layout="seed", partition_size=P, page_size=2 * P, num_sink_tokens=0, bits=4)
CONFIGS = {"b4": B4, "b4_page4": B4_PAGE4, "b4_w64": B4_W64, "seed4": SEED4}
# 4 sinks: blocks end at 36, 68, 100, ...; pages of 64 at 68, 132, of 128 at 132, 260
LENGTHS = (0, 1, 4, 5, 35, 36, 37, 67, 68, 69, 131, 133, 300)
IMPLS = ["reference", "interpret", pytest.param("gpu", marks=pytest.mark.gpu)]


def _impl(impl, **kw):
    return dict(impl="reference") if impl == "reference" else dict(impl="pallas", interpret=impl == "interpret", **kw)


def _cache(config, how="both", lengths=LENGTHS, **kw):
    return twin.build(config, lengths, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, how=how, exact=True, **kw)


# ----------------------------------------------------------------------------- config and packing


def test_config():
    assert QuantConfig().bits == 2 and QuantConfig().codes_per_byte == 4 and B4.codes_per_byte == 2
    with pytest.raises(ValueError, match="multiple of codes_per_byte \\* partition_size = 128"):
        QuantConfig(partition_size=P, page_size=2 * P)  # 2 bits: 4 blocks per packing group
    with pytest.raises(ValueError, match="bits=3.*4-bit bytes for 3-bit precision"):
        QuantConfig(bits=3)
    for bad in (1, 8, True, 4.0):
        with pytest.raises(ValueError, match="bits"):
            QuantConfig(bits=bad)
    with pytest.raises(ValueError, match="kv_format='int8'"):
        QuantConfig(kv_format="int8", bits=4)


def _oracle_pack4(codes):
    """Along the last axis of even length n: byte i = code[i] + 16 * code[i + n / 2], element by element."""
    c = np.asarray(codes, np.int64)
    half = c.shape[-1] // 2
    out = np.zeros(c.shape[:-1] + (half,), np.int64)
    for i in range(half):
        out[..., i] = c[..., i] + 16 * c[..., i + half]
    return out.astype(np.uint8)


def test_pack_4bit_matches_oracle():
    codes = np.random.default_rng(0).integers(0, 16, (3, 5, 32), dtype=np.uint8)
    packed = np.asarray(packing.pack_codes(codes, -1, 4))
    np.testing.assert_array_equal(packed, _oracle_pack4(codes))
    np.testing.assert_array_equal(np.asarray(packing.unpack_codes(packed, -1, 4)), codes)
    moved = np.moveaxis(codes, -1, 1)
    np.testing.assert_array_equal(np.moveaxis(np.asarray(packing.pack_codes(moved, 1, 4)), 1, -1), packed)
    for j in (0, 1):
        np.testing.assert_array_equal(packed & packing.plane_mask(j, 4),
                                      codes[..., 16 * j:16 * (j + 1)].astype(np.int64) * packing.plane_scale(j, 4))
    with pytest.raises(ValueError, match="code of 16"):
        packing.pack_codes(np.array([0, 16], np.uint8), 0, 4)
    with pytest.raises(ValueError, match="multiple of 2"):
        packing.pack_codes(np.zeros(3, np.uint8), 0, 4)
    with pytest.raises(ValueError, match="bits=3"):
        packing.pack_codes(np.zeros(8, np.uint8), 0, 3)


def test_kernel_planes_4bit():
    """The kernels' in-register planes of 4-bit codes (jnp forms): int8 operands code * 2**e and folded
    16-bit operands MAGIC + code * 2**TOP give every byte's two nibbles back exactly."""
    tile = jnp.arange(256, dtype=jnp.uint8).reshape(16, 16)
    byte = np.arange(256).reshape(16, 16)
    for j in (0, 1):
        nibble = (byte >> (4 * j)) & 15
        x = np.asarray(common.plane_int8_masked(tile, j, asm=False, bits=4), np.float64)
        np.testing.assert_array_equal(x * 2.0 ** -common.MASKED_PLANE_EXP[4][j], nibble)
        for dot_dtype in common.FOLDED_PLANES:
            weight, offset = common.folded_plane_constants(dot_dtype, 4)
            x = np.asarray(common.folded_plane(tile, j, dot_dtype, asm=False, bits=4), np.float64)
            np.testing.assert_array_equal(weight * x - offset, nibble)


# ----------------------------------------------------------------------------- the cache


@pytest.mark.parametrize("name", CONFIGS)
def test_layout_and_dequantization(name):
    config = CONFIGS[name]
    cache = _cache(config)
    layer, n_pages = cache.layer, cache.layer.num_pages
    ps, h = config.page_size, NUM_KV_HEADS
    assert layer.k_codes.shape == (n_pages, h, ps // 2, HEAD_DIM) and layer.k_codes.dtype == np.uint8
    assert layer.v_codes.shape == ((n_pages, h, HEAD_DIM, ps // 2) if config.layout == "kivi" else
                                   (n_pages, h, ps // 2, HEAD_DIM))
    assert layer.k_sums.dtype == layer.v_sums.dtype == np.uint16  # 15 * 32 > 255
    ns = config.num_sink_tokens
    top = 0
    for s, (k_hat, v_hat) in enumerate(twin.dequantized(cache)):
        n = int(cache.lengths[s])
        k, v, k_step, v_step = twin.gather(layer, s, n, cache.table, return_step=True)
        np.testing.assert_allclose(k, k_hat, atol=1e-5)
        np.testing.assert_allclose(v, v_hat, atol=1e-5)
        # nearest rounding: within half a step of the written (bf16-exact) values
        assert (np.abs(k - cache.k[s, :n]) <= k_step / 2 + 1e-5).all()
        assert (np.abs(v - cache.v[s, :n]) <= v_step / 2 + 1e-5).all()
        if config.layout == "kivi":  # K per (block, channel): step = (max - min) / 15 over the block
            sealed = config.sealed_blocks(max(n - ns, 0))
            for b in range(sealed):
                rows = slice(ns + b * P, ns + (b + 1) * P)
                span = cache.k[s, rows].max(0) - cache.k[s, rows].min(0)  # [H, D]
                np.testing.assert_allclose(k_step[rows][0], span / 15, rtol=2e-3, atol=1e-4)
    for seg in twin.read(cache):
        for blk in seg.blocks:
            top = max(top, blk["k_codes"].max(), blk["v_codes"].max())
    assert top == 15  # 16 levels in use


@pytest.mark.parametrize("name", ["b4", "b4_page4", "b4_w64", "seed4"])
def test_prefill_equals_appends(name):
    """Prefill, appends, and half-and-half store the same bytes in every live entry (the poison
    equalizes the rest): the nibble of each block is set wherever it is written from."""
    twin.assert_same_layers(*(_cache(CONFIGS[name], how).layer for how in ("prefill", "append", "both")))


def test_chunked_prefill_equals_one_prefill():
    """Chunk edges (37, 50, 300 tokens) inside blocks and packing groups."""
    twin.assert_chunked_prefill_matches(_cache(B4_PAGE4, "prefill", poison_unused=False))


def test_bits_per_element_from_the_arrays():
    """cache_bytes_report reads the allocated arrays: per element, codes (bits) + K scale and min per
    (block, channel) + K sums per (token, channel group) + V scale and min per (token, channel group) +
    V sums per (block, channel), the sums u8 or u16 by their range."""
    for bits, p, d in ((2, 64, 128), (4, 64, 128), (4, 64, 64), (4, 128, 128)):
        pc = min(p, d)
        sums = lambda n: 8 if (2**bits - 1) * n <= 255 else 16  # noqa: E731
        k_bits = bits + 2 * 16 / p + sums(pc) / pc
        v_bits = bits + 2 * 16 / pc + sums(p) / p
        report = kv_cache.cache_bytes_report(QuantConfig(partition_size=p, page_size=4 * p, bits=bits),
                                             num_layers=2, num_kv_heads=3, head_dim=d, seq_len=1000)
        assert report["page_bits_per_element"] == pytest.approx((k_bits + v_bits) / 2), (bits, p, d)
    assert kv_cache.cache_bytes_report(QuantConfig(bits=4), num_layers=1, num_kv_heads=1, head_dim=128,
                                       seq_len=10)["page_bits_per_element"] == pytest.approx(4.75)


# ----------------------------------------------------------------------------- attention


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", ["b4", "b4_page4", "b4_w64"])
def test_decode(name, impl):
    """The paged reference and the kernel ("int8" operands: code for code) vs the twin's homomorphic
    attention on the 4-bit codes."""
    cache = _cache(CONFIGS[name])
    q = make_q((len(LENGTHS), NUM_Q_HEADS, HEAD_DIM))
    out = np.asarray(attention.decode_attention(q, cache.layer, page_indices=cache.table, kv_lens=cache.lengths,
                                                **_impl(impl)))
    want = twin.np_cache_attention(q[:, None], cache, (cache.lengths - 1)[:, None])[:, 0]
    check(out, want, cache, impl, "kivi")
    assert (out[cache.lengths == 0] == 0).all()


# 4 sinks, blocks of 32, pages of 4 blocks (B4_PAGE4, one 4-block loop trip per page): 100 = blocks 0-2 of
# page 0 sealed, open block empty; 233 = page 1's blocks 4-6 sealed (its second packing group half
# filled: block 6's nibble only) + 5 open tokens; 615 = 4 full pages + blocks 16-18 + 7 open; 37 = 1 block
TRIP_LENGTHS = (100, 233, 615, 37)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dot_dtype", ["int8", "folded_f16", "folded_bf16"])
def test_decode_four_block_trips(dot_dtype, num_splits):
    """At 4 bits a page of 4 blocks is one loop trip of 4 virtual planes (common.blocks_per_trip): pages
    whose second packing group is partly sealed, and 3 splits cutting the sequences inside (615 tokens:
    5 trips, splits of 1 / 2 / 2). "int8": code for code with the twin; folded: within 2x the naive
    rounding's error, as test_decode_folded_within_2x_naive."""
    assert common.blocks_per_trip(4, B4_PAGE4.page_size, P) == 4 and common.blocks_per_trip(4, B4.page_size, P) == 2
    cache = _cache(B4_PAGE4, lengths=TRIP_LENGTHS)
    # make_q's default seed: seed 9 puts one of these 16 rows on a transient INT8 near-tie (err 7e-5, the same
    # in the 2-block-trip kernel), more than FLIP_ROWS' 1% of so few rows
    q = make_q((len(TRIP_LENGTHS), NUM_Q_HEADS, HEAD_DIM))
    out = np.asarray(attention.decode_attention(q, cache.layer, page_indices=cache.table, kv_lens=cache.lengths,
                                                **_impl("interpret", dot_dtype=dot_dtype, num_splits=num_splits)))
    q_pos = (cache.lengths - 1)[:, None]
    if dot_dtype == "int8":
        check(out, twin.np_cache_attention(q[:, None], cache, q_pos)[:, 0], cache, "interpret", "kivi")
        return
    exact = twin.np_cache_attention(q[:, None], cache, q_pos, transient_int8=False)[:, 0]
    rnd = {"folded_f16": np.float16, "folded_bf16": ml_dtypes.bfloat16}[dot_dtype]
    naive = twin.np_cache_attention(q[:, None], cache, q_pos, round_to=rnd)[:, 0]
    err, naive_err = np.abs(out - exact).max(), np.abs(naive - exact).max()
    assert 0 < naive_err and err <= 2 * naive_err + TIGHT * np.abs(cache.v).max(), (err, naive_err)


def test_split_heuristics_count_trips():
    """default_config counts 4-block trips at 4 bits where the page allows, packing groups of 2 blocks
    where it does not (pages of 2 P), as 2 bits counts its 4-block packing groups; folded_f16's subnormal
    planes (KernelConfig.denormal) are the decode kernel's default at both widths, the fused kernel's at 2 bits
    only."""
    from pallas_kernels import decode_attention, fused_decode_attention
    for mod in (decode_attention, fused_decode_attention):
        for page, trip in ((256, 4), (128, 2), (384, 2)):
            kw = dict(batch=8, num_kv_heads=8, pages_per_seq=32768 // page, page_size=page, partition_size=64,
                      dot_dtype="folded_f16")
            cfg = mod.default_config(**kw, bits=4)
            slots = mod.RESIDENT_PROGRAMS_PER_SM["folded_f16"] * decode_attention.H200_NUM_SMS
            assert (cfg.num_splits, cfg.open_split) == decode_attention.choose_num_splits(64, 32768 // (trip * 64), slots)
        four, two = (mod.default_config(**dict(kw, page_size=256, pages_per_seq=128), bits=b) for b in (4, 2))
        assert (four.num_splits, four.open_split) == (two.num_splits, two.open_split)
        assert two.denormal and four.denormal == (mod is decode_attention)


def test_decode_seed_reference():
    cache = _cache(SEED4)
    q = make_q((len(LENGTHS), NUM_Q_HEADS, HEAD_DIM))
    out = np.asarray(attention.decode_attention(q, cache.layer, page_indices=cache.table, kv_lens=cache.lengths))
    check(out, twin.np_cache_attention(q[:, None], cache, (cache.lengths - 1)[:, None])[:, 0], cache, "reference",
          "seed")


def _folded_within_2x_naive(config, lengths, impl, dot_dtype="folded_f16", denormal=None):
    """The kernel's folded output vs exact attention over the dequantized cache (float64 twin): at most 2x
    the error of the same 16-bit rounding done naively (the twin with the transients rounded from
    float32), plus float32 order."""
    cache = _cache(config, lengths=lengths)
    q = make_q((len(lengths), NUM_Q_HEADS, HEAD_DIM))
    extra = {} if denormal is None else {"denormal": denormal}
    out = np.asarray(attention.decode_attention(q, cache.layer, page_indices=cache.table, kv_lens=cache.lengths,
                                                **_impl(impl, dot_dtype=dot_dtype, **extra)))
    q_pos = (cache.lengths - 1)[:, None]
    exact = twin.np_cache_attention(q[:, None], cache, q_pos, transient_int8=False)[:, 0]
    rnd = {"folded_f16": np.float16, "folded_bf16": ml_dtypes.bfloat16}[dot_dtype]
    naive = twin.np_cache_attention(q[:, None], cache, q_pos, round_to=rnd)[:, 0]
    err, naive_err = np.abs(out - exact).max(), np.abs(naive - exact).max()
    assert 0 < naive_err and err <= 2 * naive_err + TIGHT * np.abs(cache.v).max(), (err, naive_err)
    assert (out[cache.lengths == 0] == 0).all()


@pytest.mark.parametrize("impl", ["interpret", pytest.param("gpu", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dot_dtype,denormal", [("folded_f16", None), ("folded_bf16", None), ("folded_f16", False)],
                         ids=["folded_f16", "folded_bf16", "folded_f16-magic"])
def test_decode_folded_within_2x_naive(dot_dtype, denormal, impl):
    """The scale-folded operands (the model's decode path) round Q sigma and W tau to 16 bits on purpose
    (_folded_within_2x_naive): folded_f16 with its default nibble planes (f16 subnormals,
    KernelConfig.denormal) and with the 1024 + c planes (denormal=False), 4-block trips (pages of 4 blocks)."""
    _folded_within_2x_naive(B4_PAGE4, LENGTHS, impl, dot_dtype, denormal)


# partition_size 128 (the hack4-p128 format: half the blocks per token), pages of 4 blocks (512 tokens), 4 sinks:
# 133 = 1 sealed block + 1 open token; 390 = 3 blocks (page 0's second packing group half filled) + 2 open;
# 520 = page 0 full + 4 open; 1100 = 2 pages + 72 open; 2100 = 4 pages + 48 open
P128_LENGTHS = (0, 1, 133, 390, 520, 1100, 2100)


@pytest.mark.parametrize("impl", ["interpret", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_decode_p128_folded_within_2x_naive(impl):
    """4-bit codes in blocks of 128 tokens (QuantConfig(partition_size=128, page_size=512, bits=4)), the
    default folded operands (default_config's splits), as test_decode_folded_within_2x_naive."""
    config = QuantConfig(partition_size=128, page_size=512, bits=4)
    _folded_within_2x_naive(config, P128_LENGTHS, impl)


def test_fused_decode_step_interpret():
    """decode_step(fuse=True): the fused append + decode kernel on 4-bit pages writes the token's rows as
    kv_cache.append does and attends as the twin says (a step that seals no block)."""
    lengths = np.asarray((1, 5, 37, 69, 133, 200), np.int32)  # after the step 2, 6, 38, 70, 134, 201
    kv = twin.make_kv((len(lengths), int(lengths.max()) + 1, NUM_KV_HEADS, HEAD_DIM), seed=3)
    cache = _cache(B4_PAGE4, lengths=tuple(lengths), kv=kv)
    rows = np.arange(len(lengths))
    k1, v1 = cache.k[rows, lengths], cache.v[rows, lengths]
    after, active = lengths + 1, np.ones(len(lengths), bool)
    assert not kv_cache.seals_block(B4_PAGE4, after, active)
    q = make_q((len(lengths), NUM_Q_HEADS, HEAD_DIM), seed=7)
    layer, out = attention.decode_step(q, k1, v1, cache.layer, page_indices=cache.table, kv_lens=after,
                                       active=active, impl="pallas", seal="never", fuse=True, interpret=True,
                                       dot_dtype="int8")
    want_layer = kv_cache.append(cache.layer, k1, v1, kv_lens=after, active=active, page_indices=cache.table,
                                 seal="never")
    for name in ("open_k", "open_v", "sink_k", "sink_v"):
        np.testing.assert_array_equal(np.asarray(getattr(layer, name)).view(np.uint16),
                                      np.asarray(getattr(want_layer, name)).view(np.uint16), err_msg=name)
    grown = dataclasses.replace(cache, layer=layer, lengths=after)
    want = twin.np_cache_attention(q[:, None], grown, (after - 1)[:, None])[:, 0]
    check(np.asarray(out), want, grown, "interpret", "kivi")


def test_prefill_reference():
    """The homomorphic prefill (reference) on 4-bit codes vs the twin, chunks at and across block edges."""
    cache = _cache(B4)
    t = 40
    q = make_q((len(LENGTHS), t, NUM_Q_HEADS, HEAD_DIM), seed=6)
    q_start = np.asarray((0, 0, 0, 0, 0, 10, 0, 30, 28, 60, 100, 93, 270), np.int32)
    out = np.asarray(attention.prefill_attention(q, cache.layer, page_indices=cache.table, kv_lens=cache.lengths,
                                                 q_start=q_start))
    q_pos = q_start[:, None] + np.arange(t)[None, :]
    check(out, twin.np_cache_attention(q, cache, q_pos), cache, "reference", "kivi")


@pytest.mark.parametrize("impl", ["interpret", pytest.param("gpu", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name,dot_dtype", [("b4", "bf16"), ("b4_page4", "bf16"), ("b4_page4", "int8")])
def test_prefill_kernel(name, dot_dtype, impl):
    """The HACK prefill kernel (impl="pallas", the INT8-requantized operands as bf16 or int8 dots) on 4-bit codes
    vs the twin's homomorphic attention (transient INT8 as the kernel's), chunks at and across block edges; rows
    at or past a sequence's length return 0."""
    cache = _cache(CONFIGS[name])
    t = 40
    q = make_q((len(LENGTHS), t, NUM_Q_HEADS, HEAD_DIM), seed=6)
    q_start = np.asarray((0, 0, 0, 0, 0, 10, 0, 30, 28, 60, 100, 93, 270), np.int32)
    out = np.asarray(attention.prefill_attention(q, cache.layer, page_indices=cache.table, kv_lens=cache.lengths,
                                                 q_start=q_start, **_impl(impl, dot_dtype=dot_dtype)))
    q_pos = q_start[:, None] + np.arange(t)[None, :]
    check(out, twin.np_cache_attention(q, cache, q_pos), cache, impl, "kivi")
    assert (out[q_pos >= cache.lengths[:, None]] == 0).all()


@pytest.mark.parametrize("impl", ["interpret", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_prefix_kernel_folded_within_2x_naive(impl):
    """attention.cached_prefix_state(impl="pallas") on 4-bit codes: the prefill kernel in prefix mode with its
    default scale-folded f16 operands (every row after the cached tokens). Its normalized output vs exact
    attention over the dequantized cache (float64 twin): at most 2x the error of the same f16 rounding done
    naively, plus float32 order; the log-sum-exp vs float64 logits over the twin's own decode of the keys; an
    empty slot gives l = 0."""
    cache = _cache(B4_PAGE4, lengths=TRIP_LENGTHS + (0,))
    t = 3
    q = make_q((len(cache.lengths), t, NUM_Q_HEADS, HEAD_DIM), seed=8)
    state = attention.cached_prefix_state(q, cache.layer, page_indices=cache.table, kv_lens=cache.lengths,
                                          **_impl(impl))
    out = np.asarray(state.acc) / np.where(np.asarray(state.l) > 0, np.asarray(state.l), 1)[..., None]
    q_pos = np.broadcast_to((cache.lengths - 1)[:, None], (len(cache.lengths), t))
    exact = twin.np_cache_attention(q, cache, q_pos, transient_int8=False)
    naive = twin.np_cache_attention(q, cache, q_pos, round_to=np.float16)
    held = cache.lengths > 0
    err, naive_err = np.abs(out - exact)[held].max(), np.abs(naive - exact)[held].max()
    assert 0 < naive_err and err <= 2 * naive_err + TIGHT * np.abs(cache.v).max(), (err, naive_err)
    assert (np.asarray(state.l)[~held] == 0).all()
    lse = np.asarray(state.m) + np.log(np.where(np.asarray(state.l) > 0, np.asarray(state.l), 1))
    for s, (k, _) in enumerate(twin.dequantized(cache)):  # the twin's own NumPy decode, f64[n, H, D]
        if not held[s]:
            continue
        k = k.repeat(NUM_Q_HEADS // NUM_KV_HEADS, axis=1)
        logits = np.einsum("thd,nhd->thn", np.asarray(q[s], np.float64), k) / np.sqrt(HEAD_DIM)
        top = logits.max(-1)
        want = top + np.log(np.exp(logits - top[..., None]).sum(-1))
        assert np.abs(lse[s] - want).max() <= 2e-3, (s, np.abs(lse[s] - want).max())


def test_quantization_error_vs_2bit():
    """Tier (c), reported: relative error of decode attention vs float attention on the unquantized K/V,
    4-bit against 2-bit on the same K/V (pytest -s prints both). 4 bits carry 5x finer steps."""
    lengths = (133, 300)
    errs = {}
    for bits in (2, 4):
        cache = twin.build(QuantConfig(partition_size=P, page_size=4 * P, bits=bits), lengths,
                           num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, how="both", exact=True)
        q = make_q((len(lengths), NUM_Q_HEADS, HEAD_DIM))
        out = np.asarray(attention.decode_attention(q, cache.layer, page_indices=cache.table,
                                                    kv_lens=cache.lengths))
        exact = np.stack([twin.np_attention(q[s][None], cache.k[s, :n], cache.v[s, :n])[0]
                          for s, n in enumerate(cache.lengths)])
        errs[bits] = float(np.linalg.norm(out - exact) / np.linalg.norm(exact))
    print(f"\nrelative error vs float K/V: 2-bit {errs[2]:.2e}, 4-bit {errs[4]:.2e}")
    assert errs[4] < errs[2] / 3


@pytest.mark.parametrize("dot_dtype", ["int8", "folded_f16", "folded_bf16", "folded_f16-magic"])
def test_decode_kernel_lowers_to_triton_for_cuda(dot_dtype):
    """The 4-bit kernel's GPU forms (the inline-PTX nibble planes, which interpret mode does not run) have
    a Pallas-Triton lowering: what can be checked without a GPU (folded_f16: the inline PTX of the planes
    asked for: subnormal by default, 1024 + c with denormal=False). Llama-3.1-8B heads, P 64, pages of 256."""
    config = QuantConfig(bits=4)
    layer = jax.eval_shape(lambda: kv_cache.init_layer(config, num_kv_heads=8, head_dim=128, num_pages=9,
                                                       max_seqs=2))
    q = jax.ShapeDtypeStruct((2, 32, 128), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((2, 4), jnp.int32)
    lens = jax.ShapeDtypeStruct((2,), jnp.int32)
    dot_dtype, _, flag = dot_dtype.partition("-")
    extra = {"denormal": False} if flag == "magic" else {}
    fn = lambda q, layer, table, lens: attention.decode_attention(  # noqa: E731
        q, layer, page_indices=table, kv_lens=lens, impl="pallas", dot_dtype=dot_dtype, **extra)
    text = jax.jit(fn).trace(q, layer, table, lens).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    if dot_dtype == "folded_f16":  # the option reaches the kernel: its planes' PRMT selectors, not the other's
        subnormal, magic = f"0x{common.DENORMAL_PRMT[1]:04X}" in text, "0x5140" in text
        assert (subnormal, magic) == ((False, True) if flag else (True, False))


@pytest.mark.parametrize("denormal", [None, False], ids=["default", "magic"])
def test_two_bit_planes_lower_with_the_q_they_take(denormal):
    """2-bit folded_f16 with a bf16 q, lowered for CUDA: default_config's subnormal planes get q in float32
    (common.kernel_q; with a bf16 q their compiled loop ran 35-50% slower on the H200) and emit their PRMT
    selector; denormal=False gives the 1024 + 64c planes, which take q as given."""
    layer = jax.eval_shape(lambda: kv_cache.init_layer(QuantConfig(), num_kv_heads=8, head_dim=128, num_pages=9,
                                                       max_seqs=2))
    q = jax.ShapeDtypeStruct((2, 32, 128), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((2, 4), jnp.int32)
    lens = jax.ShapeDtypeStruct((2,), jnp.int32)
    extra = {} if denormal is None else {"denormal": denormal}
    fn = lambda q, layer, table, lens: attention.decode_attention(  # noqa: E731
        q, layer, page_indices=table, kv_lens=lens, impl="pallas", dot_dtype="folded_f16", **extra)
    text = jax.jit(fn).trace(q, layer, table, lens).lower(lowering_platforms=("cuda",)).as_text()
    call = [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]
    assert len(call) == 1
    assert ("tensor<2x32x128xf32>" in call[0], "tensor<2x32x128xbf16>" in call[0]) == (
        (True, False) if denormal is None else (False, True))
    subnormal, magic = f"0x{common.DENORMAL_PRMT[1]:04X}" in text, "0x5140" in text
    assert (subnormal, magic) == ((True, False) if denormal is None else (False, True))


@pytest.mark.parametrize("impl", ["reference", "interpret"])
def test_deferred_seal_4bit(impl):
    """Deferred sealing (tests/test_deferred_seal.py's cases, 4-bit pages of 128): append(seal="after")
    then seal_filled stores the bytes of append(seal="always"), and decode_step(seal="after") attends as the
    twin says over the cache before the step plus the new token in 16 bits."""
    import test_deferred_seal as ds
    config = QuantConfig(partition_size=P, page_size=4 * P, bits=4)
    cache, k, v = ds._setup(config)
    args = dict(kv_lens=ds.BEFORE + ds.ACTIVE, active=ds.ACTIVE, page_indices=cache.table)
    assert kv_cache.seals_block(config, args["kv_lens"], ds.ACTIVE)
    rows_only = kv_cache.append(cache.layer, k, v, **args, seal="after")
    if impl == "reference":
        ds._assert_same_bytes(kv_cache.seal_filled(rows_only, **args),
                              kv_cache.append(cache.layer, k, v, **args, seal="always"))
    q = make_q((len(ds.BEFORE), NUM_Q_HEADS, HEAD_DIM))
    layer, out = attention.decode_step(q, k, v, cache.layer, seal="after", **args, **_impl(impl))
    check(np.asarray(out)[ds.ACTIVE], ds._oracle(cache, q, k, v)[ds.ACTIVE], cache, impl, "kivi")
    ds._assert_same_bytes(layer, rows_only)


# ----------------------------------------------------------------------------- dispatch and errors


def test_paths_without_4bit_kernels_refuse():
    cache = _cache(B4, lengths=(37, 70))
    q = make_q((2, NUM_Q_HEADS, HEAD_DIM))
    for impl in ("pallas_dequant", "triton"):
        with pytest.raises(NotImplementedError, match="bits=4"):
            attention.decode_attention(q, cache.layer, page_indices=cache.table, kv_lens=cache.lengths, impl=impl,
                                       interpret=True)
    arrays, static = attention.kernel_args(cache.layer)
    assert static["bits"] == 4
    from pallas_kernels.decode_attention import hack_decode_attention
    from pallas_kernels.dequant_decode_attention import dequant_decode_attention
    from pallas_kernels.prefill_attention import hack_prefill_attention
    with pytest.raises(NotImplementedError, match="2-bit codes only"):
        dequant_decode_attention(q, *arrays, cache.table, cache.lengths, interpret=True, **static)
    for fn, qq in ((hack_decode_attention, q), (hack_prefill_attention, q[:, None])):
        with pytest.raises(ValueError, match="4-bit cache"):  # the arrays say 4 bits, the caller 2
            fn(qq, *arrays, cache.table, cache.lengths, interpret=True, partition_size=P, num_sink_tokens=NS)


# ----------------------------------------------------------------------------- model, CLI, eval


def test_model_decode_4bit_closer_to_float_than_2bit():
    """A tiny decoder through the Generator (prefill, then teacher-forced decode steps sealing blocks of
    32 across pages of 64): with the 4-bit cache its log-probs are much closer to the uncached float
    forward than with the 2-bit cache."""
    from flax import nnx
    from models.config import ModelConfig
    from models.generate import Generator
    from models.llama import Llama
    from test_models import _Tok, _tiny_weights
    base = dict(architecture="llama", vocab_size=61, num_layers=2, embed_dim=32, hidden_dim=48, num_q_heads=4,
                num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1e4, max_seq_len=256,
                tied_embeddings=True, qkv_bias=False)
    model = Llama.from_weights(ModelConfig(**base), _tiny_weights(ModelConfig(**base), seed=2))
    ids = np.random.default_rng(4).integers(0, 61, size=(2, 140))
    full = np.asarray(jax.nn.log_softmax(nnx.jit(lambda m, x: m(x))(model, jnp.asarray(ids)), axis=-1))
    prompts, forced = [list(ids[0, :40]), list(ids[1, :70])], np.stack([ids[0, 40:110], ids[1, 70:140]])
    want = np.stack([full[0, 39 + np.arange(70), ids[0, 40:110]], full[1, 69 + np.arange(70), ids[1, 70:140]]])
    err = {}
    for bits in (2, 4):
        quant = QuantConfig(partition_size=32, page_size=64 if bits == 4 else 128, bits=bits)
        gen = Generator(model, _Tok(), quant, max_seqs=2, max_len=160)
        logp = np.asarray(gen.generate_ids(prompts, 70, forced=forced).forced_logprobs)
        err[bits] = float(np.abs(logp - want).mean())
    print(f"\nmean |log p - float log p|: 2-bit {err[2]:.2e}, 4-bit {err[4]:.2e}")
    assert err[4] < err[2] / 3, err


def test_cli_and_eval_select_4bit():
    from models.cli import _parser
    from models.cli_generate import quant_config
    from models.eval import FORMATS, parse_format
    args = _parser().parse_args(["perplexity", "--text", "x", "--bits", "4"])
    assert quant_config(args) == QuantConfig(bits=4)
    with pytest.raises(SystemExit):
        _parser().parse_args(["perplexity", "--text", "x", "--bits", "3"])
    assert parse_format("hack:bits=4").quant == QuantConfig(bits=4)
    assert FORMATS["hack4-p64"].quant == QuantConfig(bits=4)
    with pytest.raises(ValueError, match="bits=3"):
        parse_format("hack:bits=3")
