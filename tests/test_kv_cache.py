"""hack_jax.kv_cache: contents vs the written K/V, prefill/append equivalence, reuse, compiles, bytes.

Every format runs the same suite (FORMATS) on one shared geometry: 11 sequences of LENGTHS tokens
(on and off block and page boundaries at the default P = 64, page_size = 256), prompt axis T = 1024,
2 kv heads of head_dim 128 (two channel groups), each sequence's pages drawn from a shuffled pool.
Page tables and lengths are runtime values, so every test of a format reuses the same compiled
write_prefill / append / dequantize (`written` memoizes the written caches; test_attention uses
them too). "kivi" keeps the 4 default sinks; "seed" runs without sinks, so there LENGTHS hit the
block boundaries exactly.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import twin
from hack_jax import kv_cache, paging
from hack_jax.config import QuantConfig

# Its append loops run long enough that XLA's unoptimized code would cost more than its compile saves.
pytestmark = pytest.mark.optimized_xla

EPS32 = float(np.finfo(np.float32).eps)
LENGTHS = (1, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1000)
T_LEN = 1024
NUM_KV_HEADS, HEAD_DIM = 2, 128

FORMATS = {
    "kivi": QuantConfig(),
    "seed": QuantConfig(layout="seed", num_sink_tokens=0),
    "bf16": QuantConfig(kv_format="bf16"),
    "float32": QuantConfig(kv_format="float32"),
    "int8": QuantConfig(kv_format="int8"),
}
HOWS = ("prefill", "append", "both")


def bf16_exact(x):
    """x rounded to bf16 and back: values the 16-bit parts store exactly."""
    return np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))


def make_kv(seed=0, *, exact=False, num_seqs=len(LENGTHS), t_len=T_LEN):
    """k, v f32[num_seqs, t_len, NUM_KV_HEADS, HEAD_DIM]; per-channel offsets in K, as in real K."""
    rng = np.random.default_rng(seed)
    shape = (num_seqs, t_len, NUM_KV_HEADS, HEAD_DIM)
    k = rng.standard_normal(shape).astype(np.float32) + rng.standard_normal(HEAD_DIM).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    return (bf16_exact(k), bf16_exact(v)) if exact else (k, v)


def shuffled_table(config, lengths=LENGTHS, *, seed=0):
    """(page_indices i32[len(lengths), pages_per_seq], num_pages): pages from a shuffled pool."""
    return twin.shuffled_table(config, lengths, spare=3, seed=seed)


def empty_layer(config, num_pages, max_seqs=len(LENGTHS)):
    return kv_cache.init_layer(config, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                               num_pages=num_pages, max_seqs=max_seqs)


prefill_jit = jax.jit(kv_cache.write_prefill)
append_jit = jax.jit(kv_cache.append, donate_argnums=0)


def write(layer, k, v, lengths, table, how, key=None):
    """Writes sequence s's first lengths[s] tokens by "prefill", "append" or "both" (a prefill of
    half, then appends); one jitted append call per step for all sequences. Returns the layer."""
    lengths = np.asarray(lengths, np.int32)
    pre = {"prefill": lengths, "append": 0 * lengths, "both": lengths // 2}[how]
    layer = prefill_jit(layer, k, v, lengths=pre, page_indices=table, key=key)
    cur = pre.copy()
    rows = np.arange(len(lengths))
    while (cur < lengths).any():
        t = np.minimum(cur, k.shape[1] - 1)
        step_key = None if key is None else jax.random.fold_in(key, int(cur.sum()))
        layer = append_jit(layer, k[rows, t], v[rows, t], kv_lens=cur + (cur < lengths),
                           active=cur < lengths, page_indices=table, key=step_key)
        cur = cur + (cur < lengths)
    return layer


@functools.lru_cache(maxsize=None)
def written(fmt, how, *, exact=False, cap=None):
    """(layer, k, v, lengths, table) for FORMATS[fmt]: LENGTHS (capped at cap) written by `how`."""
    config = FORMATS[fmt]
    table, num_pages = shuffled_table(config)
    lengths = np.minimum(LENGTHS, cap or T_LEN).astype(np.int32)
    k, v = make_kv(exact=exact)
    return twin.write(empty_layer(config, num_pages), k, v, lengths, table, how), k, v, lengths, table


def error_bound(config, x, x_hat, step):
    """Per-element bound on |x - x_hat| for what the cache stores.

    2-bit: step / 2 from the stored scale (nearest rounding, HACK.md §2), plus bf16 rounding
    (2**-8 |x|, the unit roundoff of 8 significant bits) since the open block and sinks hold x in
    bf16 and blocks sealed by append are quantized from those bf16 values; int8: step / 2 plus half
    an ulp of the f16 folded minimum, |m| <= |x_hat| + 128 step; bf16: 2**-8 |x|; float32: exact.
    Plus float32 arithmetic slack.
    """
    slack = 4 * EPS32 * (np.abs(x) + np.abs(x_hat) + 8 * step)
    fmt = config.kv_format
    if fmt == "hack":
        return step / 2 + 2.0**-8 * np.abs(x) + slack
    if fmt == "int8":
        return step / 2 + 2.0**-11 * (np.abs(x_hat) + 128 * step) + slack
    return (2.0**-8 * np.abs(x) if fmt == "bf16" else 0 * x) + slack


dequantize_jit = jax.jit(functools.partial(kv_cache.dequantize_cache, return_step=True))


def assert_contents(config, layer, k, v, lengths, table, seqs=None):
    """Each sequence's dequantized contents are within error_bound of the K/V that were written,
    and zero beyond its length."""
    contents = [np.asarray(x) for x in dequantize_jit(layer, table, np.asarray(lengths, np.int32))]
    for s in range(len(lengths)) if seqs is None else seqs:
        n = int(lengths[s])
        k_hat, v_hat, k_step, v_step = (x[s, :n] for x in contents)
        assert all((x[s, n:] == 0).all() for x in contents)
        for name, x, x_hat, step in (("k", k[s, :n], k_hat, k_step), ("v", v[s, :n], v_hat, v_step)):
            excess = np.abs(x - x_hat) - error_bound(config, x, x_hat, step)
            assert excess.max() <= 0, f"{name} of sequence {s} (length {n}): max excess {excess.max()}"
            sealed = n >= kv_cache.sink_tokens(config) + config.partition_size
            if config.kv_format in ("hack", "int8") and sealed:
                assert step.max() > 0, "sealed blocks must be quantized"


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_contents_within_quantization_bound(fmt, how):
    layer, k, v, lengths, table = written(fmt, how)
    assert_contents(FORMATS[fmt], layer, k, v, lengths, table)


@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_and_appends_store_identical_bytes(fmt):
    """With bf16-exact inputs (what the open block holds anyway) sealing a block in append quantizes
    exactly what prefill quantizes: every byte of the cache agrees, whichever path wrote it."""
    ref = written(fmt, "prefill", exact=True, cap=300)[0]
    for how in ("append", "both"):
        other = written(fmt, how, exact=True, cap=300)[0]
        for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(other)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_seals_block_against_its_definition():
    """seals_block (kv_lens after the append, new token included): an active hack slot whose new
    token, at position n - 1 >= ns, is the last of its block (n - 1 - ns = P - 1 mod P); never for
    the baselines or inactive slots."""
    kivi, seed, bf16 = FORMATS["kivi"], FORMATS["seed"], FORMATS["bf16"]  # ns 4 / 0, P 64
    for n in range(1, 300):
        want = n - 1 >= 4 and (n - 1 - 4) % 64 == 63
        assert kv_cache.seals_block(kivi, [n], [True]) == want, n
        assert not kv_cache.seals_block(kivi, [n], [False])
        assert kv_cache.seals_block(seed, [n], [True]) == ((n - 1) % 64 == 63)
        assert not kv_cache.seals_block(bf16, [n], [True])
    assert kv_cache.seals_block(kivi, [6, 68, 10], [True, True, False])
    assert not kv_cache.seals_block(kivi, [6, 68, 132], [True, False, False])


APPEND_BY_SEAL = {mode: jax.jit(functools.partial(kv_cache.append, seal=mode), donate_argnums=0)
                  for mode in kv_cache.SEAL_MODES}


@pytest.mark.parametrize("fmt", ["kivi", "seed"])
def test_append_seal_modes_store_identical_bytes(fmt):
    """A decode loop over block boundaries (lengths off and on block, ragged starts) written with
    seal="never" on the steps where seals_block is False and "always" elsewhere (the Generator's
    choice) stores every byte of the seal="always" loop."""
    config = FORMATS[fmt]
    lengths = np.array([70, 130, 200, 3, 66], np.int32)
    start = np.array([60, 0, 120, 0, 65], np.int32)
    table, num_pages = shuffled_table(config, lengths)
    k, v = make_kv(seed=3, exact=True, num_seqs=len(lengths), t_len=256)
    rows = np.arange(len(lengths))

    def loop(choose):
        layer = prefill_jit(empty_layer(config, num_pages, len(lengths)), k, v, lengths=start, page_indices=table)
        cur = start.copy()
        while (cur < lengths).any():
            active = cur < lengths
            after = cur + active
            layer = APPEND_BY_SEAL[choose(after, active)](layer, k[rows, cur], v[rows, cur], kv_lens=after, active=active, page_indices=table)
            cur = cur + active
        return layer

    ref = loop(lambda cur, active: "always")
    host = loop(lambda cur, active: "always" if kv_cache.seals_block(config, cur, active) else "never")
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(host)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert_contents(config, ref, k, v, lengths, table)


def test_append_seal_never_refuses_a_sealing_step():
    config = FORMATS["kivi"]
    table, num_pages = shuffled_table(config, (80, 80))
    layer = empty_layer(config, num_pages, 2)
    x = jnp.ones((2, NUM_KV_HEADS, HEAD_DIM), jnp.float32)
    with pytest.raises(ValueError, match="seal='never'"):  # slot 1's token 67 = ns + 63 fills its block
        kv_cache.append(layer, x, x, kv_lens=np.array([11, 68], np.int32), active=np.array([True, True]),
                        page_indices=table, seal="never")
    kv_cache.append(layer, x, x, kv_lens=np.array([11, 67], np.int32), active=np.array([True, False]),
                    page_indices=table, seal="never")  # the sealing slot is inactive: fine
    with pytest.raises(ValueError, match="seal must be one of"):
        kv_cache.append(layer, x, x, kv_lens=np.array([11, 12], np.int32), active=np.array([True, True]),
                        page_indices=table, seal="sometimes")


# Chunk boundaries per sequence of LENGTHS (a second chunk ends at SPLITS_2, a third at the length):
# 0 (a chunked write into an empty slot), inside the sinks (2), at the sinks' end (4), right after
# (5), at a block boundary (68 = 4 + 64), inside blocks of the first, second and third packing group,
# at a page boundary (260 = 4 + 256), and a three-chunk sequence crossing pages mid-block (517, 700).
SPLITS_1 = (0, 2, 4, 5, 68, 67, 100, 132, 200, 256, 517)
SPLITS_2 = (1, 63, 40, 65, 100, 128, 129, 255, 256, 257, 700)


def chunk_rows(x, start, lengths):
    """Rows [start, start + lengths) of each sequence of x [S, T, ...] moved to rows [0, lengths)."""
    out = np.zeros_like(x)
    for s, (a, n) in enumerate(zip(start, lengths)):
        out[s, :n] = x[s, a:a + n]
    return out


@functools.lru_cache(maxsize=None)
def chunked(fmt):
    """(layer, k, v, lengths, table): the exact K/V of LENGTHS (capped at 700 for the third
    chunk) written as up to three write_prefill chunks with `start`, into the same table as
    written(fmt, "prefill", exact=True)."""
    config = FORMATS[fmt]
    table, num_pages = shuffled_table(config)
    k, v = make_kv(exact=True)
    lengths = np.minimum(LENGTHS, 700).astype(np.int32)
    layer = empty_layer(config, num_pages)
    done = np.zeros_like(lengths)
    for stop in (SPLITS_1, SPLITS_2, lengths):
        stop = np.minimum(np.maximum(stop, done), lengths).astype(np.int32)
        n = stop - done
        layer = prefill_chunk_jit(layer, chunk_rows(k, done, n), chunk_rows(v, done, n), lengths=n,
                                  page_indices=table, start=done)
        done = stop
    return layer, k, v, lengths, table


prefill_chunk_jit = jax.jit(kv_cache.write_prefill)


@pytest.mark.parametrize("fmt", FORMATS)
def test_chunked_prefill_stores_the_bytes_of_one_prefill(fmt):
    """Prompts written in two or three chunks (write_prefill with start: boundaries in the sinks,
    on and off block, packing-group and page boundaries) store exactly the bytes of one
    write_prefill of the whole prompts (bf16-exact K/V, as in the append equivalence)."""
    layer, k, v, lengths, table = chunked(fmt)
    one = prefill_jit(empty_layer(FORMATS[fmt], layer.num_pages), k, v, lengths=lengths,
                      page_indices=table)
    for f in dataclasses.fields(layer):
        if f.name != "config":
            np.testing.assert_array_equal(np.asarray(getattr(layer, f.name)),
                                          np.asarray(getattr(one, f.name)), err_msg=f.name)
    assert_contents(FORMATS[fmt], layer, k, v, lengths, table)


def test_chunked_prefill_start_zero_and_errors():
    """start = 0 equals start=None (the chunked path is the same write); bad starts raise."""
    config = FORMATS["kivi"]
    table, num_pages = shuffled_table(config)
    k, v = make_kv(exact=True)
    lengths = np.asarray(LENGTHS, np.int32)
    layer = empty_layer(config, num_pages)
    a = prefill_chunk_jit(layer, k, v, lengths=lengths, page_indices=table, start=0 * lengths)
    b = prefill_jit(layer, k, v, lengths=lengths, page_indices=table)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with pytest.raises(ValueError, match="start must be >= 0"):
        kv_cache.write_prefill(layer, k, v, lengths=lengths, page_indices=table, start=-1 + 0 * lengths)
    with pytest.raises(ValueError, match="start.shape"):
        kv_cache.write_prefill(layer, k, v, lengths=lengths, page_indices=table, start=lengths[:3])
    with pytest.raises(ValueError, match="capacity"):  # start + lengths beyond the table's capacity
        kv_cache.write_prefill(layer, k, v, lengths=lengths, page_indices=table, start=lengths + 300)


@pytest.mark.parametrize("fmt", ["kivi", "seed"])
def test_stored_sums_match_codes(fmt):
    """Code sums (HACK.md §3 summation elimination) agree with the stored codes; both layouts keep
    K sums per (token, channel group) and V sums per (block, channel)."""
    config = FORMATS[fmt]
    layer, _, _, lengths, table = written(fmt, "both")
    b = jax.tree.map(np.asarray, kv_cache.read_blocks(layer, table, lengths))
    group = min(config.partition_size, HEAD_DIM)
    k_codes, v_codes = b.k_codes.astype(np.int64), b.v_codes.astype(np.int64)  # [S, NB, H, P, D]
    np.testing.assert_array_equal(b.k_sums, k_codes.reshape(k_codes.shape[:-1] + (-1, group)).sum(-1))
    np.testing.assert_array_equal(b.v_sums, v_codes.sum(3))
    ns = config.num_sink_tokens
    assert b.num_sealed.tolist() == [max(n - ns, 0) // 64 for n in lengths]
    assert b.num_open.tolist() == [max(n - ns, 0) % 64 for n in lengths]
    assert b.k_codes.max() == 3 and b.k_sums.max() > 0


def np_quantize_2bit(x, axis):
    """Float64 NumPy oracle of the 2-bit quantizer contract (DESIGN.md "Quantizer contract") over
    all of `axis`: f16 minimum rounded down, f16 scale (hi - m) / 3 rounded up (at least the f16
    tiny, 0 for a constant partition), codes round-half-even((x - m) / s) clipped to [0, 3].
    Returns (codes int64, t float64 = (x - m) / s before rounding)."""
    def to_f16(v, down):
        y = v.astype(np.float16)
        over = y.astype(np.float64) > v if down else y.astype(np.float64) < v
        return np.where(over, np.nextafter(y, np.float16(-np.inf if down else np.inf)), y).astype(np.float64)

    x = np.asarray(x, np.float64)
    lo, hi = x.min(axis, keepdims=True), x.max(axis, keepdims=True)
    m = to_f16(lo, down=True)
    s = np.where(hi > m, np.maximum(to_f16((hi - m) / 3, down=False), float(np.finfo(np.float16).tiny)), 0.0)
    t = (x - m) / np.where(s > 0, s, 1.0)
    return np.clip(np.round(t), 0, 3).astype(np.int64), t


@pytest.mark.parametrize("how", ["prefill", "append"])
def test_kivi_code_bytes_by_hand(how):
    """The kivi page layout byte by byte, against float64 NumPy codes of the written K/V: for the
    sealed block k of a sequence (page table column k // bpp, slot k % bpp = 4 g + j: packing group g
    of the page, plane j), in-block token r (token ns + k P + r) and channel c,
      v_codes[page, h, c, g * P + r] bits 2j..2j+1 = V code (per token, channel group), token-major;
      k_codes[page, h, g * P + r, c] bits 2j..2j+1 = K code (per block, channel), channel-major;
    planes of unsealed blocks and pages no sequence holds (the null page included) are 0. Pages of
    8P (two packing groups per page), P 32 < head_dim 128 (4 channel groups); a full page, a
    second page with its second group holding one block, a sequence with no sealed block.
    Codes whose t = (x - m) / s is within 1e-3 of a rounding tie are skipped (float32 vs float64)."""
    config = QuantConfig(partition_size=32, page_size=256)
    P, ns, bpp = 32, config.num_sink_tokens, 256 // 32
    pc = min(P, HEAD_DIM)  # V channel group
    lengths = np.array([ns + 13 * P + 5, ns + 8 * P, ns + P - 1], np.int32)
    table, num_pages = shuffled_table(config, lengths, seed=3)
    k, v = make_kv(seed=4, exact=True, num_seqs=3, t_len=int(lengths.max()))
    layer = twin.write(empty_layer(config, num_pages, 3), k, v, lengths, table, how)
    v_codes, k_codes = np.asarray(layer.v_codes), np.asarray(layer.k_codes)
    assert v_codes.shape == (num_pages, NUM_KV_HEADS, HEAD_DIM, 256 // 4)
    assert k_codes.shape == (num_pages, NUM_KV_HEADS, 256 // 4, HEAD_DIM)

    # expected codes and "not a near-tie" per (page, head, slot, token r, channel c)
    want = {name: np.zeros((num_pages, NUM_KV_HEADS, bpp, P, HEAD_DIM), np.int64) for name in "kv"}
    sure = {name: np.ones(want[name].shape, bool) for name in "kv"}
    for s_, n in enumerate(lengths):
        for blk in range((n - ns) // P):
            page, slot = table[s_, blk // bpp], blk % bpp
            toks = slice(ns + blk * P, ns + (blk + 1) * P)
            vq, vt = np_quantize_2bit(v[s_, toks].reshape(P, NUM_KV_HEADS, HEAD_DIM // pc, pc), axis=-1)
            kq, kt = np_quantize_2bit(k[s_, toks], axis=0)  # [P, H, D]: per (block, channel)
            for name, q, t in (("v", vq, vt), ("k", kq, kt)):
                q, t = (np.swapaxes(a.reshape(P, NUM_KV_HEADS, HEAD_DIM), 0, 1) for a in (q, t))  # [H, P, D]
                want[name][page, :, slot] = q
                sure[name][page, :, slot] = np.abs(t - np.floor(t) - 0.5) > 1e-3
    got = {name: np.zeros_like(want[name]) for name in "kv"}
    for slot in range(bpp):
        g, j = divmod(slot, 4)
        rows = slice(g * P, (g + 1) * P)
        got["v"][:, :, slot] = np.swapaxes((v_codes[:, :, :, rows] >> (2 * j)) & 3, 2, 3)  # [N, H, r, c]
        got["k"][:, :, slot] = (k_codes[:, :, rows, :] >> (2 * j)) & 3
    for name in "kv":
        assert sure[name].mean() > 0.99, name
        np.testing.assert_array_equal(np.where(sure[name], got[name], 0), np.where(sure[name], want[name], 0),
                                      err_msg=f"{name}_codes")
        assert want[name].max() == 3


@pytest.mark.parametrize("fmt", FORMATS)
def test_reused_pages_leak_nothing(fmt):
    """The longest sequence (slot 10) ends; its pages (and the null page) get NaN metadata and
    all-ones codes and are
    handed (shuffled) to a new sequence in slot 9, written by prefill then appends: its contents are
    exactly those of the same sequence written into fresh pages, and the other sequences are intact."""
    config = FORMATS[fmt]
    layer, k, v, lengths, table = written(fmt, "prefill")
    freed = table[10][table[10] > 0]

    def poison(a):  # NaN metadata / values, all-ones codes, in the freed pages and the null page
        floating = jnp.issubdtype(a.dtype, jnp.floating)
        a = np.array(a)
        a[np.append(freed, paging.NULL_PAGE)] = np.nan if floating else -1 if a.dtype == np.int8 else 0xFF
        return jnp.asarray(a)

    layer = dataclasses.replace(layer, **{
        f.name: poison(getattr(layer, f.name)) for f in dataclasses.fields(layer)
        if f.name != "config" and not f.name.startswith(("open", "sink"))})
    new_table = table.copy()
    new_table[10] = 0
    new_table[9, :len(freed)] = np.random.default_rng(1).permutation(freed)
    new_lengths = lengths.copy()
    new_lengths[10], new_lengths[9] = 0, 600
    k2, v2 = make_kv(seed=2, exact=True)  # exact: prefill/append splits store the same bytes
    only_9 = np.where(np.arange(len(lengths)) == 9, new_lengths, 0).astype(np.int32)
    cur = np.where(only_9 > 0, 520, 0).astype(np.int32)
    layer = prefill_jit(layer, k2, v2, lengths=cur, page_indices=new_table)
    while cur[9] < 600:  # crosses a block seal into a reused page
        layer = append_jit(layer, k2[:, cur[9]], v2[:, cur[9]], kv_lens=cur + (only_9 > cur),
                           active=only_9 > cur, page_indices=new_table)
        cur = cur + (only_9 > cur)
    fresh = prefill_jit(empty_layer(config, layer.num_pages), k2, v2, lengths=only_9,
                        page_indices=new_table)
    got, want = (twin.gather(x, 9, 600, new_table, return_step=True) for x in (layer, fresh))
    for a, b in zip(got, want):
        assert np.isfinite(a).all()
        np.testing.assert_array_equal(a, b)
    assert_contents(config, layer, k, v, new_lengths, new_table, seqs=range(9))


def test_stochastic_rounding_is_deterministic_per_key():
    """Same key, same bytes (prefill and appends); another key, other codes; no key, ValueError."""
    config = QuantConfig(rounding="stochastic")
    table, num_pages = shuffled_table(config)
    lengths = np.minimum(LENGTHS, 140).astype(np.int32)
    k, v = make_kv()
    run = lambda key, how="both": twin.write(empty_layer(config, num_pages), k, v, lengths, table, how,
                                       key=jax.random.key(key))
    a, b, c = run(0), run(0), run(1, "prefill")
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert not np.array_equal(np.asarray(a.k_codes), np.asarray(c.k_codes))
    assert not np.array_equal(np.asarray(a.v_codes), np.asarray(c.v_codes))
    with pytest.raises(ValueError, match="key"):
        kv_cache.write_prefill(empty_layer(config, num_pages), k, v, lengths=lengths,
                               page_indices=table)


def test_one_append_compile_for_a_decode_loop_with_churn():
    """Sequences join (by appends alone), grow and leave between steps through the PageAllocator;
    pages are freed and reused. One compiled append serves the whole loop (the jit cache of
    append_jit does not grow), and every live sequence's contents stay right."""
    config = FORMATS["kivi"]
    _, num_pages = shuffled_table(config)
    max_seqs = len(LENGTHS)
    alloc = paging.PageAllocator(num_pages, max_seqs, 4, config.page_size, config.num_sink_tokens)
    rng = np.random.default_rng(0)
    layer = empty_layer(config, num_pages)
    kv_lens, target = np.zeros(max_seqs, np.int32), np.zeros(max_seqs, np.int32)
    history = [[] for _ in range(max_seqs)]
    admitted, compiled = 0, None
    need = lambda n: paging.pages_needed(n, page_size=256, num_sink_tokens=4)
    for _ in range(300):
        for s in range(max_seqs):
            if alloc.is_admitted(s) and kv_lens[s] == target[s]:
                alloc.release(s)
                kv_lens[s], history[s] = 0, []
            if not alloc.is_admitted(s) and rng.random() < 0.2:
                want = int(rng.integers(1, 600))
                # Admission control: the pages every admitted sequence will grow into must exist.
                committed = sum(need(target[r]) for r in range(max_seqs) if alloc.is_admitted(r))
                if committed + need(want) <= num_pages - 1:
                    alloc.admit(s, 1)
                    target[s], admitted = want, admitted + 1
        active = np.array([alloc.is_admitted(s) for s in range(max_seqs)])
        for s in np.nonzero(active)[0]:
            alloc.reserve(int(s), int(kv_lens[s]) + 1)
        k = rng.standard_normal((max_seqs, NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)
        v = rng.standard_normal((max_seqs, NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)
        layer = append_jit(layer, k, v, kv_lens=kv_lens + active, active=active,
                           page_indices=alloc.page_indices)
        compiled = compiled or append_jit._cache_size()
        for s in np.nonzero(active)[0]:
            history[s].append((k[s], v[s]))
        kv_lens = kv_lens + active
    assert append_jit._cache_size() == compiled
    assert admitted > max_seqs + 5, "the loop must recycle slots and pages"
    live = [s for s in range(max_seqs) if kv_lens[s] > 0]
    ks = np.zeros((max_seqs, max(kv_lens), NUM_KV_HEADS, HEAD_DIM), np.float32)
    vs = np.zeros_like(ks)
    for s in live:
        ks[s, :kv_lens[s]], vs[s, :kv_lens[s]] = (np.stack(x) for x in zip(*history[s]))
    assert_contents(config, layer, ks, vs, kv_lens, alloc.page_indices, seqs=live)


def test_prefill_compiles_once_per_length_bucket():
    """T (the bucket) is the only static size: other lengths, tables and slots reuse the compile.
    (bf16 format: the jit mechanics are the same for every format, and it compiles fast.)"""
    config = QuantConfig(kv_format="bf16")
    traces = []

    def counted(layer, k, v, **kw):
        traces.append(k.shape[1])
        return kv_cache.write_prefill(layer, k, v, **kw)

    prefill = jax.jit(counted)
    table, num_pages = shuffled_table(config, (512, 512))
    layer = empty_layer(config, num_pages, 2)
    for bucket, lengths in ((128, (100, 128)), (128, (5, 77)), (512, (300, 512)), (128, (1, 0))):
        k, v = make_kv(num_seqs=2, t_len=bucket)
        prefill(layer, k, v, lengths=np.array(lengths, np.int32), page_indices=table[::-1].copy())
    assert traces == [128, 512]


def test_cache_pytree_and_init():
    cache = kv_cache.init_cache(QuantConfig(), num_layers=3, num_kv_heads=2, head_dim=128,
                                num_pages=5, max_seqs=2, pages_per_seq=2)
    assert (cache.num_layers, cache.max_seqs, cache.pages_per_seq, cache.num_pages) == (3, 2, 2, 5)
    assert cache.capacity == 4 + 2 * 256
    layer = cache.layers[0]
    assert layer.k_codes.shape == (5, 2, 64, 128) and layer.k_codes.dtype == jnp.uint8
    assert layer.v_codes.shape == (5, 2, 128, 64) and layer.v_codes.dtype == jnp.uint8  # token-major
    assert layer.k_scale.shape == (5, 2, 4, 128) and layer.k_scale.dtype == jnp.float16
    assert layer.k_sums.shape == (5, 2, 256, 2) and layer.k_sums.dtype == jnp.uint8
    assert layer.v_scale.shape == (5, 2, 256, 2) and layer.v_sums.shape == (5, 2, 4, 128)
    assert layer.open_k.shape == (2, 2, 64, 128) and layer.open_k.dtype == jnp.bfloat16
    assert layer.sink_v.shape == (2, 2, 4, 128)
    leaves, tree = jax.tree.flatten(cache)
    assert len(leaves) == 3 * 12 + 2
    assert jax.tree.unflatten(tree, leaves).config == QuantConfig()
    # stacked (a model scanning over its layers): one LayerCache, each array [num_layers, ...] zero
    stacked = kv_cache.init_cache(QuantConfig(), num_layers=3, num_kv_heads=2, head_dim=128,
                                  num_pages=5, max_seqs=2, pages_per_seq=2, stacked=True)
    assert stacked.stacked and not cache.stacked
    assert (stacked.num_layers, stacked.max_seqs, stacked.num_pages, stacked.capacity) == (3, 2, 5, 4 + 512)
    for a, b in zip(jax.tree.leaves(stacked.layers), jax.tree.leaves(layer)):
        assert a.shape == (3,) + b.shape and a.dtype == b.dtype and not np.asarray(a).any()
    seed = kv_cache.init_layer(QuantConfig(layout="seed", partition_size=128, page_size=512),
                               num_kv_heads=1, head_dim=128, num_pages=2, max_seqs=1)
    assert seed.k_scale.shape == (2, 1, 512, 1) and seed.v_scale.shape == (2, 1, 4, 128)
    seed64 = kv_cache.init_layer(QuantConfig(layout="seed", page_size=512), num_kv_heads=1, head_dim=64,
                                 num_pages=2, max_seqs=1)
    assert seed64.k_codes.shape == seed64.v_codes.shape == (2, 1, 128, 64)  # seed: both channel-major
    assert seed.v_sums.dtype == jnp.uint16 and seed.k_sums.dtype == jnp.uint16  # 3 * 128 > 255
    assert not hasattr(seed, "open_k")
    int8 = kv_cache.init_layer(QuantConfig(kv_format="int8"), num_kv_heads=2, head_dim=64,
                               num_pages=3, max_seqs=1)
    assert int8.k_codes.dtype == jnp.int8 and int8.k_scale.shape == (3, 2, 256)
    assert kv_cache.sink_tokens(QuantConfig(kv_format="int8")) == 0


def test_errors():
    config = QuantConfig()
    with pytest.raises(ValueError, match="kv_format"):
        QuantConfig(kv_format="fp4")
    with pytest.raises(ValueError, match="QuantConfig"):
        kv_cache.init_layer("hack", num_kv_heads=1, head_dim=64, num_pages=2, max_seqs=1)
    with pytest.raises(ValueError, match="num_pages"):
        empty_layer(config, 1, 1)
    with pytest.raises(ValueError, match="head_dim"):
        kv_cache.init_layer(config, num_kv_heads=1, head_dim=96, num_pages=2, max_seqs=1)
    layer = empty_layer(config, 4, 2)
    k, v = make_kv(num_seqs=2, t_len=300)
    ok_table = np.array([[1, 2], [3, 0]], np.int32)
    with pytest.raises(ValueError, match=r"page id out of range.*page_indices\[1, 0\]=7"):
        kv_cache.write_prefill(layer, k, v, lengths=np.array([300, 10]),
                               page_indices=np.array([[1, 2], [7, 0]], np.int32))
    with pytest.raises(ValueError, match="null page"):
        kv_cache.write_prefill(layer, k, v, lengths=np.array([300, 10]),
                               page_indices=np.array([[1, 0], [3, 0]], np.int32))
    with pytest.raises(ValueError, match="page=3"):
        kv_cache.write_prefill(layer, k, v, lengths=np.array([300, 10]),
                               page_indices=np.array([[1, 3], [3, 0]], np.int32))
    with pytest.raises(ValueError, match="capacity"):
        kv_cache.append(layer, k[:, 0], v[:, 0], kv_lens=np.array([4 + 512 + 1, 0]),
                        active=np.array([True, False]), page_indices=ok_table)
    full = jax.tree.map(jnp.copy, layer)  # under jit nothing raises: a token beyond capacity is dropped
    after = jax.jit(kv_cache.append)(full, k[:, 0], v[:, 0], kv_lens=np.array([4 + 512 + 1, 1]),
                                     active=np.array([True, True]), page_indices=ok_table)
    assert (np.asarray(after.sink_k[1, :, 0]) != 0).all()  # the other slot's token is written
    for f in dataclasses.fields(layer):
        if f.name != "config" and not f.name.startswith("sink"):
            np.testing.assert_array_equal(getattr(after, f.name), getattr(layer, f.name))
    with pytest.raises(ValueError, match="exceeds the prompt"):
        kv_cache.write_prefill(layer, k, v, lengths=np.array([301, 0]), page_indices=ok_table)
    with pytest.raises(ValueError, match="num_kv_heads, head_dim"):
        kv_cache.write_prefill(layer, k[..., :64], v[..., :64], lengths=np.array([3, 0]),
                               page_indices=ok_table)


def test_bytes_per_token_hand_arithmetic():
    """Per token, per kv head, per layer at P = 64 (fp16 scale/min, uint8 sums), HACK.md §6:
      head_dim 128 (NP = 2 channel groups):
        K codes 128/4 = 32 | K scale+min per (block, channel) 2*128*2/64 = 8 | K sums per
        (token, group) 2*1 = 2 | V codes 32 | V scale+min per (token, group) 2*2*2 = 8 |
        V sums per (block, channel) 128/64 = 2  -> 84 B (vs bf16 2*128*2 = 512 B: 16.4%)
      head_dim 64 (NP = 1): 16 + 4 + 1 + 16 + 4 + 1 = 42 B (vs bf16 256 B).
    SmolLM2-135M (30 layers, 3 kv heads, d 64): 42 * 3 * 30 = 3780 B/token; bf16 23040.
    Llama-3.1-8B (32 layers, 8 kv heads, d 128): 84 * 8 * 32 = 21504 B/token; bf16 131072.
    The seed layout moves the same sizes between K and V; int8 stores d + 2*2 B per token and head
    for K and for V: (64 + 4) * 2 * 3 * 30 = 12240 and (128 + 4) * 2 * 8 * 32 = 67584.
    """
    smol = dict(num_kv_heads=3, head_dim=64, num_layers=30)
    llama = dict(num_kv_heads=8, head_dim=128, num_layers=32)
    for layout in ("kivi", "seed"):
        assert kv_cache.bytes_per_token(QuantConfig(layout=layout), **smol) == 3780
        assert kv_cache.bytes_per_token(QuantConfig(layout=layout), **llama) == 21504
    assert kv_cache.bytes_per_token(QuantConfig(kv_format="bf16"), **smol) == 23040
    assert kv_cache.bytes_per_token(QuantConfig(kv_format="bf16"), **llama) == 131072
    assert kv_cache.bytes_per_token(QuantConfig(kv_format="float32"), **llama) == 262144
    assert kv_cache.bytes_per_token(QuantConfig(kv_format="int8"), **smol) == 12240
    assert kv_cache.bytes_per_token(QuantConfig(kv_format="int8"), **llama) == 67584


def test_cache_bytes_report_hand_arithmetic():
    """Llama-3.1-8B, one 32768-token sequence, kivi defaults (P 64, page 256, 4 sinks):
      pages = ceil((32768 - 4) / 256) = 128, + the null page = 129; per page and layer:
        codes    K 8*64*128 + V 8*64*128                        = 131072
        metadata K 8*4*128*2*2 + V 8*256*2*2*2                   =  32768
        sums     K 8*256*2 + V 8*4*128                           =   8192
      x 129 pages x 32 layers: codes 541065216, metadata 135266304, sums 33816576;
      open blocks (K, V) 2*8*64*128*2 * 32 = 8388608; sinks 2*8*4*128*2 * 32 = 524288;
      total 719060992 B (~0.72 GB, HACK.md §6 "~0.7 GB") vs bf16 32*2*32768*8*128*2 = 4294967296.
    SmolLM2-135M, one 8192-token sequence: pages ceil(8188/256) = 32 + 1 = 33; per page and layer
      codes 2*3*64*64 = 24576, metadata 3*4*64*2*2 + 3*256*1*2*2 = 6144, sums 3*256 + 3*4*64 = 1536;
      x 33 x 30: 24330240, 6082560, 1520640; open 2*3*64*64*2*30 = 1474560; sinks 2*3*4*64*2*30 =
      92160; total 33500160 vs bf16 30*2*8192*3*64*2 = 188743680.
    """
    llama = kv_cache.cache_bytes_report(QuantConfig(), num_layers=32, num_kv_heads=8, head_dim=128,
                                        seq_len=32768)
    assert llama == pytest.approx(dict(
        codes=541065216, metadata=135266304, sums=33816576, open_blocks=8388608, sinks=524288,
        total=719060992, num_pages=129, bf16=4294967296, ratio=719060992 / 4294967296,
        bits_per_element=8 * 719060992 / (32 * 2 * 8 * 128 * 32768),
        page_bits_per_element=8 * (541065216 + 135266304 + 33816576) / 129 / 256 / (32 * 2 * 8 * 128)))
    # V rotation stores no extra byte
    assert kv_cache.cache_bytes_report(QuantConfig(v_rotation=64), num_layers=32, num_kv_heads=8,
                                       head_dim=128, seq_len=32768) == llama
    smol = kv_cache.cache_bytes_report(QuantConfig(), num_layers=30, num_kv_heads=3, head_dim=64,
                                       seq_len=8192)
    assert smol == pytest.approx(dict(
        codes=24330240, metadata=6082560, sums=1520640, open_blocks=1474560, sinks=92160,
        total=33500160, num_pages=33, bf16=188743680, ratio=33500160 / 188743680,
        bits_per_element=8 * 33500160 / (30 * 2 * 3 * 64 * 8192),
        page_bits_per_element=8 * (24576 + 6144 + 1536) / 256 / (2 * 3 * 64)))
    dense = kv_cache.cache_bytes_report(QuantConfig(kv_format="bf16"), num_layers=32, num_kv_heads=8,
                                        head_dim=128, seq_len=32768, max_seqs=2)
    # 2 * 128 pages + the null page, each 2 (K, V) * 8 * 256 * 128 * 2 B per layer, 32 layers.
    assert dense["total"] == 257 * 2 * 8 * 256 * 128 * 2 * 32 and dense["open_blocks"] == 0


def test_init_cache_rejects_non_int_sizes():
    for bad in ("4", 4.5, True):
        with pytest.raises(TypeError, match="num_pages"):
            kv_cache.init_cache(QuantConfig(), num_layers=1, num_kv_heads=1, head_dim=64,
                                num_pages=bad, max_seqs=1, pages_per_seq=1)


def test_write_errors_name_the_problem():
    layer = kv_cache.init_layer(QuantConfig(kv_format="bf16"), num_kv_heads=1, head_dim=64,
                                num_pages=2, max_seqs=1)
    table = np.array([[1]], np.int32)
    ok = np.zeros((1, 1, 64), np.float32)
    with pytest.raises(ValueError, match="3 axes"):
        kv_cache.append(layer, ok[None], ok[None], kv_lens=[1], active=[True], page_indices=table)
    with pytest.raises(ValueError, match="floating"):
        kv_cache.append(layer, ok.astype(np.int32), ok.astype(np.int32), kv_lens=[1], active=[True],
                        page_indices=table)


def test_bad_positions_and_values_never_reach_the_cache():
    """A negative length, or an active slot with no room for its new token (kv_len 0 after the
    append), raises eagerly; under jit such a token is dropped (it used to wrap into the last sink
    row); NaN / inf in the rows to be written and float lengths / positions raise, naming them."""
    config = QuantConfig()  # kivi, 4 sinks
    layer = kv_cache.init_layer(config, num_kv_heads=1, head_dim=64, num_pages=3, max_seqs=2)
    table = np.array([[1], [2]], np.int32)
    k = np.ones((2, 1, 64), np.float32)
    with pytest.raises(ValueError, match=r"kv_lens must be >= 0: kv_lens=\[-1, 0\]"):
        kv_cache.append(layer, k, k, kv_lens=[-1, 0], active=[False, False], page_indices=table)
    with pytest.raises(ValueError, match=r"active slot must hold >= 1 token.*kv_lens=\[0, 0\]"):
        kv_cache.append(layer, k, k, kv_lens=[0, 0], active=[True, False], page_indices=table)
    out = jax.jit(kv_cache.append)(layer, k, k, kv_lens=jnp.array([0, 0]), active=jnp.array([True, False]),
                                   page_indices=table)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(layer)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # nothing written anywhere
    with pytest.raises(TypeError, match="kv_lens must be integers"):
        kv_cache.append(layer, k, k, kv_lens=[1.5, 0.0], active=[True, False], page_indices=table)
    nan = k.copy()
    nan[0, 0, 3] = np.nan
    with pytest.raises(ValueError, match="v holds 1 NaN or inf"):
        kv_cache.append(layer, k, nan, kv_lens=[1, 0], active=[True, False], page_indices=table)
    # the same NaN in an inactive slot's row is ignored, as the row is
    kv_cache.append(layer, k, nan, kv_lens=[0, 1], active=[False, True], page_indices=table)
    kp = np.ones((2, 8, 1, 64), np.float32)
    kp[1, 5, 0, 0] = np.inf
    with pytest.raises(ValueError, match="k holds 1 NaN or inf"):
        kv_cache.write_prefill(layer, kp, np.ones_like(kp), lengths=[8, 6], page_indices=table)
    kv_cache.write_prefill(layer, kp, np.ones_like(kp), lengths=[8, 5], page_indices=table)  # row 5 unused
    with pytest.raises(TypeError, match="lengths must be integers"):
        kv_cache.write_prefill(layer, kp, kp, lengths=[8.0, 5.0], page_indices=table)
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        kv_cache.write_prefill(layer, kp, np.ones_like(kp), lengths=[8, -1], page_indices=table)
    with pytest.raises(ValueError, match=r"kv_lens must be i32\[2\]"):
        kv_cache.dequantize_cache(layer, table, [1, 2, 3])


@pytest.mark.parametrize("how", ["prefill", "both"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_readers_match_the_numpy_page_reader(fmt, how):
    """dequantize_cache (and, for the 2-bit formats, read_blocks behind it) equals twin's float64
    NumPy decoding of the same pages, on a cache poisoned everywhere no live token is (unused and
    null pages, slots and planes past each length, stale open-block and sink rows): nothing of the
    poison leaks, and positions past each length are 0. Small geometry (P 32, pages of 128)."""
    config = dataclasses.replace(FORMATS[fmt], partition_size=32, page_size=128)
    cache = twin.build(config, (0, 1, 4, 36, 37, 132, 133, 300), head_dim=64, how=how,
                       exact=how == "prefill")
    k, v = (np.asarray(x) for x in dequantize_jit(cache.layer, cache.table, cache.lengths)[:2])
    assert np.isfinite(k).all() and np.isfinite(v).all()
    for s, (k_np, v_np) in enumerate(twin.dequantized(cache)):
        n = int(cache.lengths[s])
        np.testing.assert_allclose(k[s, :n], k_np, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(v[s, :n], v_np, rtol=1e-6, atol=1e-6)
        assert (k[s, n:] == 0).all() and (v[s, n:] == 0).all()


def test_stacked_flat_view():
    """kv_cache.stacked: the flat form of a stacked cache (paged arrays [L * N, ...], per-sequence
    arrays [L, S, ...]) round-trips; layer i's page table maps valid ids p to i * N + p and the null
    page / out-of-range ids to page 0; layer_of / put_layer slice and update only the per-sequence
    arrays; pallas_addressable is False for u8 pools in the (2**31, 2**32] byte window; use_flat
    is off on the CPU."""
    from hack_jax.kv_cache import stacked
    layers = kv_cache.init_cache(QuantConfig(), num_layers=3, num_kv_heads=1, head_dim=64, num_pages=5,
                                 max_seqs=2, pages_per_seq=2, stacked=True).layers
    layers = jax.tree.map(lambda a: jnp.asarray(np.arange(a.size).reshape(a.shape) % 251, a.dtype), layers)
    flat = stacked.flatten(layers)
    assert flat.k_codes.shape == (15, 1, 64, 64) and flat.v_sums.shape == (15, 1, 4, 64)
    assert flat.open_k.shape == layers.open_k.shape and flat.sink_v.shape == layers.sink_v.shape
    assert stacked.pages_per_layer(layers) == 5 and flat.num_pages == 15
    for a, b in zip(jax.tree.leaves(stacked.unflatten(flat, 3)), jax.tree.leaves(layers)):
        np.testing.assert_array_equal(a, b)
    table = np.array([[3, 0], [-1, 5]], np.int32)
    np.testing.assert_array_equal(stacked.layer_page_indices(table, 2, 5), [[13, 0], [0, 0]])
    np.testing.assert_array_equal(stacked.layer_page_indices(table, 0, 5), [[3, 0], [0, 0]])
    one = stacked.layer_of(flat, 1)
    np.testing.assert_array_equal(one.open_v, layers.open_v[1])
    assert one.k_codes.shape == (15, 1, 64, 64)
    back = stacked.put_layer(flat, dataclasses.replace(one, open_v=one.open_v * 0), 1)
    np.testing.assert_array_equal(back.open_v[1], 0)
    np.testing.assert_array_equal(back.open_v[0], layers.open_v[0])
    np.testing.assert_array_equal(back.k_codes, flat.k_codes)
    shapes = lambda n: jax.eval_shape(lambda: kv_cache.init_cache(
        QuantConfig(), num_layers=3, num_kv_heads=1, head_dim=64, num_pages=n, max_seqs=1,
        pages_per_seq=1, stacked=True)).layers  # k_codes: 3 * n * 4096 bytes
    assert stacked.pallas_addressable(shapes(100_000))  # 1.2e9 bytes
    assert not stacked.pallas_addressable(shapes(200_000))  # 2.5e9
    assert stacked.pallas_addressable(shapes(400_000))  # 4.9e9: 64-bit offsets
    assert stacked.use_flat(shapes(100_000)) == (jax.default_backend() != "cpu")
    assert not stacked.use_flat(shapes(200_000))


# ----------------------------------------------------------------------------- issue 17


def _nbytes(tree):
    return sum(np.asarray(a).nbytes for a in jax.tree.leaves(tree))


def test_cache_bytes_report_of_a_load_held_in_sinks():
    """issue 17.1: seq_len <= num_sink_tokens needs no page, but init_cache needs the null page plus
    one: the report counts those 2 pages (it raised 'need the null page plus at least one page')."""
    for seq_len in (0, 3, 4):
        report = kv_cache.cache_bytes_report(QuantConfig(), num_layers=1, num_kv_heads=1, head_dim=64,
                                             seq_len=seq_len)
        cache = kv_cache.init_cache(QuantConfig(), num_layers=1, num_kv_heads=1, head_dim=64,
                                    num_pages=2, max_seqs=1, pages_per_seq=1)
        assert report["num_pages"] == 2 and report["total"] == _nbytes(cache.layers)


def _slot_bytes(layer, slot, pages):
    """Every byte the cache holds for one sequence: its pages' arrays and its per-slot buffers."""
    out = []
    for f in dataclasses.fields(layer):
        if f.name == "config":
            continue
        a = np.asarray(getattr(layer, f.name))
        out.append(a[slot] if f.name.startswith(("open", "sink")) else a[np.asarray(pages)])
    return out


@pytest.mark.parametrize("layout", ["kivi", "seed"])
def test_stochastic_noise_is_keyed_by_sequence_position_not_slot(layout):
    """issue 17.3: with one key, a sequence gets the same codes in slot 0 and in slot 1 (beside
    another sequence), and a prefill of 150 tokens stores the bytes of a 70-token prefill plus 80
    appends (on main the noise was drawn per array position: slot and batch shape changed it)."""
    config = QuantConfig(layout=layout, rounding="stochastic", num_sink_tokens=4 if layout == "kivi" else 0)
    key = jax.random.key(7)
    n = 150
    k, v = make_kv(3, exact=True, num_seqs=2, t_len=n)
    other_k, other_v = make_kv(4, exact=True, num_seqs=2, t_len=n)
    table = np.array([[1, 0], [2, 0]], np.int32)
    lengths = np.array([n, 0], np.int32)
    alone = prefill_jit(empty_layer(config, 4, 2), k, v, lengths=lengths, page_indices=table, key=key)
    # the same sequence in slot 1, slot 0 holding another one
    k2 = np.stack([other_k[0], k[0]]); v2 = np.stack([other_v[0], v[0]])
    swapped = prefill_jit(empty_layer(config, 4, 2), k2, v2, lengths=np.array([90, n], np.int32),
                          page_indices=np.array([[2, 0], [1, 0]], np.int32), key=key)
    for a, b in zip(_slot_bytes(alone, 0, [1]), _slot_bytes(swapped, 1, [1])):
        np.testing.assert_array_equal(a, b)
    # prefill 70, then append the rest one token per step with the same key
    layer = prefill_jit(empty_layer(config, 4, 2), k, v, lengths=np.array([70, 0], np.int32),
                        page_indices=table, key=key)
    active = np.array([True, False])
    for t in range(70, n):
        layer = append_jit(layer, k[:, t], v[:, t], kv_lens=np.array([t + 1, 0], np.int32),
                           active=active, page_indices=table, key=key)
    for a, b in zip(_slot_bytes(alone, 0, [1]), _slot_bytes(layer, 0, [1])):
        np.testing.assert_array_equal(a, b)
    # and the noise is live: another key gives other codes
    other = prefill_jit(empty_layer(config, 4, 2), k, v, lengths=lengths, page_indices=table,
                        key=jax.random.key(8))
    assert not np.array_equal(np.asarray(alone.k_codes[1]), np.asarray(other.k_codes[1]))


def test_nearest_cache_bytes_do_not_depend_on_batch_mates():
    """issue 17.3 (nearest): a sequence's bytes are the same alone (max_seqs 1, T = its length) and
    beside a longer sequence (max_seqs 2, T padded to the mate's length): the cache reduces nothing
    over the batch axis. (The log-prob difference of the issue comes from the model's float matmuls,
    whose CPU accumulation order depends on the batch size, not from the cache.)"""
    config = QuantConfig()
    k, v = make_kv(5, exact=False, num_seqs=2, t_len=300)
    alone = prefill_jit(empty_layer(config, 2, 1), k[:1, :70], v[:1, :70], lengths=np.array([70], np.int32),
                        page_indices=np.array([[1, 0]], np.int32))
    pair = prefill_jit(empty_layer(config, 4, 2), k, v, lengths=np.array([70, 300], np.int32),
                       page_indices=np.array([[3, 0], [1, 2]], np.int32))
    for a, b in zip(_slot_bytes(alone, 0, [1]), _slot_bytes(pair, 0, [3])):
        np.testing.assert_array_equal(a, b)


def test_lengths_and_page_ids_that_would_wrap_to_int32_are_rejected():
    """issue 17.4: an int64 2**32 + 8 wrapped to 8 and passed every check."""
    layer = empty_layer(QuantConfig(), 4, 2)
    k, v = make_kv(num_seqs=2, t_len=8)
    table = np.array([[1], [2]], np.int32)
    with pytest.raises(ValueError, match="int32 range"):
        kv_cache.write_prefill(layer, k, v, lengths=np.array([2**32 + 8, 8]), page_indices=table)
    with pytest.raises(ValueError, match="int32 range"):
        kv_cache.write_prefill(layer, k, v, lengths=np.array([8, 8]), page_indices=np.array([[2**32 + 1], [2]]))
    with pytest.raises(ValueError, match="int32 range"):
        kv_cache.write_prefill(layer, k, v, lengths=np.array([8, 8]), page_indices=table,
                               start=np.array([-2**40, 0]))
    with pytest.raises(ValueError, match="int32 range"):
        kv_cache.append(layer, k[:, 0], v[:, 0], kv_lens=np.array([2**32 + 9, 9]),
                        active=np.array([True, True]), page_indices=table)
    assert kv_cache.seals_block(QuantConfig(), np.array([68], np.int64), [True])  # in range: fine


def test_seals_block_and_sizes_reject_bad_arguments():
    """issue 17.6: seals_block broadcast [1, 2] against [True]; bytes_per_token(num_layers=-1) was -42."""
    config = QuantConfig()
    with pytest.raises(ValueError, match="one shape"):
        kv_cache.seals_block(config, [1, 2], [True])
    with pytest.raises(TypeError, match="integers"):
        kv_cache.seals_block(config, [1.5], [True])
    with pytest.raises(ValueError, match="num_layers must be >= 1"):
        kv_cache.bytes_per_token(config, 1, 64, -1)
    with pytest.raises(TypeError, match="num_kv_heads"):
        kv_cache.bytes_per_token(config, 1.5, 64, 1)
    with pytest.raises(ValueError, match="seq_len"):
        kv_cache.cache_bytes_report(config, num_layers=1, num_kv_heads=1, head_dim=64, seq_len=-1)
    assert kv_cache.bytes_per_token(config, 1, 64, 2) == 2 * kv_cache.bytes_per_token(config, 1, 64, 1) > 0


@pytest.mark.parametrize("fmt", ["kivi", "seed", "int8", "kivi2"])
def test_values_beyond_the_float16_metadata_are_rejected_unchanged(fmt):
    """issue 17.8: 70000 was clipped to 65504 by the f16 scale/min, silently. Now the writers reject
    it eagerly (the cache unchanged); bf16 stores it (no f16 metadata)."""
    config = FORMATS[fmt] if fmt in FORMATS else QuantConfig(kv_format=fmt)
    layer = empty_layer(config, 4, 2)
    k, v = make_kv(num_seqs=2, t_len=80)
    table = np.array([[1], [2]], np.int32)
    before = jax.tree.map(np.asarray, layer)
    big = k.copy()
    big[1, 70, 0, 3] = 70000.0
    with pytest.raises(ValueError, match="65504"):
        kv_cache.write_prefill(layer, big, v, lengths=np.array([80, 80], np.int32), page_indices=table)
    with pytest.raises(ValueError, match="65504"):
        kv_cache.append(layer, k[:, 0], -big[:, 70], kv_lens=np.array([1, 1], np.int32),
                        active=np.array([True, True]), page_indices=table)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(layer)):
        np.testing.assert_array_equal(a, np.asarray(b))
    dense = empty_layer(FORMATS["bf16"], 4, 2)
    out = kv_cache.write_prefill(dense, big, v, lengths=np.array([80, 80], np.int32), page_indices=table)
    kk, _ = kv_cache.dequantize_cache(out, table, np.array([80, 80], np.int32))
    assert float(kk[1, 70, 0, 3]) == 70144.0  # bf16 holds it (to its 8-bit mantissa)


def test_clear_errors_for_a_whole_cache_and_an_oversized_cache():
    """issue 17 unclear errors: write_prefill(KVCache) and init_cache(num_pages=2**40) (an XLA
    out-of-memory error) now name the problem up front."""
    cache = kv_cache.init_cache(QuantConfig(), num_layers=1, num_kv_heads=2, head_dim=128, num_pages=3,
                                max_seqs=1, pages_per_seq=1)
    k, v = make_kv(num_seqs=1, t_len=8)
    with pytest.raises(ValueError, match=r"got KVCache.*cache\.layers\[i\]"):
        kv_cache.write_prefill(cache, k, v, lengths=np.array([8], np.int32), page_indices=np.array([[1]]))
    with pytest.raises(ValueError, match="i32 page ids"):
        kv_cache.init_cache(QuantConfig(), num_layers=1, num_kv_heads=1, head_dim=64, num_pages=2**40,
                            max_seqs=1, pages_per_seq=1)
    with pytest.raises(ValueError, match=r"GiB .*more than the .* GiB of cpu memory"):
        kv_cache.init_cache(QuantConfig(), num_layers=64, num_kv_heads=8, head_dim=128,
                            num_pages=2**31 - 1, max_seqs=1, pages_per_seq=1)
