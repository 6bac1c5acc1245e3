"""The tests' float64 NumPy twin of the paged cache and of attention over it, and the one cache builder.

  build(config, lengths, ...) -> Cache   K/V written through the public kv_cache API into a
      shuffled page table; then everything no live token occupies is poisoned (NaN metadata and
      values, all-ones codes, max sums): unused pages, the null page, page rows / block slots / code
      planes past each length, stale open-block and sink rows. Readers that mask correctly do not
      see the poison.
  read(cache) -> [Segments] per sequence: the pages decoded in NumPy (own unpacking, not kv_cache's
      readers), the 16-bit parts taken from the raw inputs rounded to bf16.
  dequantized(cache) -> [(k_hat, v_hat) f64[n, H, D]]; gather(...): one sequence through the
      public dequantize_cache (for tests of the cache itself).
  assert_same_layers(first, *others), assert_chunked_prefill_matches(whole): byte equality of
      caches written by different paths.
  np_attention (float attention), np_hack_attention (DESIGN.md "Homomorphic attention semantics":
      INT8 images of the transients, codes attended per block), np_cache_attention (either, per
      format, on a Cache).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from hack_jax import kv_cache, paging
from hack_jax.config import QuantConfig
from hack_jax.kv_cache.common import array_fields  # the field names only; the values are this module's own
from oracles import q8_rows

BLOCKED = ("hack",)  # kv_formats with sinks, sealed 2-bit blocks and an open block


def bf16(x):
    return np.asarray(np.asarray(x, np.float32).astype(ml_dtypes.bfloat16), np.float64)


def make_kv(shape, seed=0, *, exact=True):
    """k, v f32[shape]: K with per-channel offsets and spreads (as real keys), V standard normal;
    exact: rounded to bf16 (what the 16-bit parts store), so every write path stores the same bytes."""
    rng = np.random.default_rng(seed)
    d = shape[-1]
    k = rng.standard_normal(shape) * rng.uniform(0.5, 2, d) + rng.standard_normal(d)
    v = rng.standard_normal(shape)
    k, v = k.astype(np.float32), v.astype(np.float32)
    return (bf16(k).astype(np.float32), bf16(v).astype(np.float32)) if exact else (k, v)


def shuffled_table(config, lengths, *, spare=2, extra_cols=0, seed=0):
    """(page_indices i32[len(lengths), pages_per_seq], num_pages): each sequence's pages drawn from
    a shuffled pool with `spare` pages nobody holds; extra_cols null columns past the longest."""
    ns = kv_cache.sink_tokens(config)
    need = [paging.pages_needed(int(n), page_size=config.page_size, num_sink_tokens=ns) for n in lengths]
    num_pages = 1 + sum(need) + spare
    perm = np.random.default_rng(seed).permutation(np.arange(1, num_pages))
    table = np.zeros((len(lengths), max(max(need), 1) + extra_cols), np.int32)
    nxt = 0
    for s, n in enumerate(need):
        table[s, :n] = perm[nxt:nxt + n]
        nxt += n
    return table, num_pages


@dataclasses.dataclass(frozen=True)
class Cache:
    layer: object  # a kv_cache LayerCache
    k: np.ndarray  # f32[S, T, H, D], the K/V that were written (row t = token t)
    v: np.ndarray
    lengths: np.ndarray  # i32[S]
    table: np.ndarray  # i32[S, pages_per_seq]

    @property
    def config(self) -> QuantConfig:
        return self.layer.config


_prefill = jax.jit(kv_cache.write_prefill)
_append = jax.jit(kv_cache.append, donate_argnums=0)


def write(layer, k, v, lengths, table, how="prefill", key=None):
    """Sequence s's first lengths[s] tokens by "prefill", "append" or "both" (a prefill of half,
    then appends; one jitted append per step for all sequences). Returns the layer."""
    lengths = np.asarray(lengths, np.int32)
    pre = {"prefill": lengths, "append": 0 * lengths, "both": lengths // 2}[how]
    layer = _prefill(layer, k, v, lengths=pre, page_indices=table, key=key)
    cur, rows = pre.copy(), np.arange(len(lengths))
    while (cur < lengths).any():
        t = np.minimum(cur, k.shape[1] - 1)
        step_key = None if key is None else jax.random.fold_in(key, int(cur.sum()))
        active = cur < lengths
        layer = _append(layer, k[rows, t], v[rows, t], kv_lens=cur + active, active=active,
                        page_indices=table, key=step_key)
        cur = cur + active
    return layer


def build(config, lengths, *, num_kv_heads=2, head_dim=64, how="prefill", seed=0, exact=True,
          kv=None, poison_unused=True, extra_cols=1) -> Cache:
    """A cache holding len(lengths) sequences (module docstring); kv = (k, v) overrides the random
    K/V. The table gets extra_cols null columns beyond the longest sequence."""
    lengths = np.asarray(lengths, np.int32)
    table, num_pages = shuffled_table(config, lengths, extra_cols=extra_cols, seed=seed)
    if kv is None:
        kv = make_kv((len(lengths), max(int(lengths.max()), 1), num_kv_heads, head_dim), seed, exact=exact)
    k, v = (np.asarray(x, np.float32) for x in kv)
    layer = kv_cache.init_layer(config, num_kv_heads=k.shape[2], head_dim=k.shape[3],
                                num_pages=num_pages, max_seqs=len(lengths))
    layer = write(layer, k, v, lengths, table, how)
    cache = Cache(layer, k, v, lengths, table)
    return poison(cache) if poison_unused else cache


def assert_same_layers(first, *others):
    """Every array of each LayerCache in others equals first's, field by field (NaN matches NaN, so
    poisoned entries compare equal when both were poisoned)."""
    for other in others:
        for f in dataclasses.fields(first):
            if f.name != "config":
                np.testing.assert_array_equal(np.asarray(getattr(first, f.name)),
                                              np.asarray(getattr(other, f.name)), err_msg=f.name)


def assert_chunked_prefill_matches(whole, chunks=(37, 50, 300)):
    """whole: a Cache written by one write_prefill, not poisoned. Its K/V written again into an empty
    layer by write_prefill calls of `chunks` tokens each (start= continuing the sequences) store the
    same bytes in every live entry (both poisoned after)."""
    lengths = np.asarray(whole.lengths, np.int32)
    layer = kv_cache.init_layer(whole.config, num_kv_heads=whole.k.shape[2], head_dim=whole.k.shape[3],
                                num_pages=whole.layer.num_pages, max_seqs=len(lengths))
    start = np.zeros_like(lengths)
    for chunk in chunks:
        n = np.minimum(lengths - start, chunk)
        rows = np.clip(start[:, None] + np.arange(chunk)[None, :], 0, whole.k.shape[1] - 1)
        take = lambda x: np.take_along_axis(x, rows[:, :, None, None], axis=1)  # noqa: E731
        layer = kv_cache.write_prefill(layer, take(whole.k), take(whole.v), lengths=n, page_indices=whole.table,
                                       start=start)
        start = start + n
    assert (start == lengths).all(), f"chunks {chunks} do not cover lengths {lengths}"
    assert_same_layers(poison(whole).layer, poison(dataclasses.replace(whole, layer=layer)).layer)


# ----------------------------------------------------------------------------- layout in NumPy


def _geometry(config, head_dim):
    p = config.partition_size
    pc = min(config.v_group or p, head_dim)  # the channel group: v_group when set
    return p, pc, head_dim // pc, config.page_size // p


def _held(cache, s):
    """(n_u, num_sealed): block positions held and sealed blocks of sequence s (2-bit formats)."""
    cfg = cache.config
    n_u = max(int(cache.lengths[s]) - cfg.num_sink_tokens, 0)
    w = cfg.window or cfg.partition_size  # the 16-bit open region: its blocks seal together
    return n_u, (n_u // w) * (w // cfg.partition_size)


def _plane(codes, rows, j, token_major, bits):
    """b-bit plane j of packed rows `rows` of one page's codes [H, ps//C, D] (token_major
    [H, D, ps//C]), C = 8 // b codes per byte, plane j in bits [b j, b j + b - 1] (DESIGN.md packing)
    -> [H, len(rows), D]."""
    x = codes[:, :, rows] if token_major else codes[:, rows, :]
    x = (x.astype(np.int64) // 2 ** (bits * j)) % 2**bits
    return np.swapaxes(x, 1, 2) if token_major else x


def poison(cache) -> Cache:
    """The cache with every entry no live token occupies overwritten (module docstring)."""
    layer, cfg = cache.layer, cache.config
    a = {name: np.array(getattr(layer, name)) for name in array_fields(layer)}  # (absent code sums left out)
    live = {int(x) for s, row in enumerate(cache.table) for x in row[:_pages_of(cache, s)]}
    dead = [x for x in range(layer.num_pages) if x not in live]  # includes the null page
    junk = lambda x: np.nan if jnp.issubdtype(x.dtype, jnp.floating) else np.iinfo(x.dtype).max
    for name, x in a.items():
        if not name.startswith(("open", "sink")):
            x[dead] = junk(x)
    ps = cfg.page_size
    if cfg.kv_format not in BLOCKED:
        for s, n in enumerate(cache.lengths):
            for col in range(_pages_of(cache, s)):
                rows = np.arange(ps) >= int(n) - col * ps
                for x in a.values():
                    x[cache.table[s, col], :, rows] = junk(x)
        return dataclasses.replace(cache, layer=dataclasses.replace(layer, **a))
    p, _, _, bpp = _geometry(cfg, layer.head_dim)
    seed, bits = cfg.layout == "seed", cfg.bits
    for s, n in enumerate(cache.lengths):
        n_u, sealed = _held(cache, s)
        for col in range(_pages_of(cache, s)):
            page = cache.table[s, col]
            for slot in range(bpp):
                blk = col * bpp + slot
                g, j = divmod(slot, 8 // bits)
                tok = slot * p + np.arange(p)  # page rows of the block
                tok_dead = col * ps + tok >= (n_u if seed else sealed * p)  # seed K: per token
                blk_dead = blk >= sealed
                for name, x in a.items():
                    if name.startswith(("open", "sink")):
                        continue
                    k_side = name.startswith("k")
                    dead_rows = tok_dead if (seed and k_side) else np.full(p, blk_dead)
                    if not dead_rows.any():
                        continue
                    if name.endswith("codes"):  # set the block's plane to its largest code in dead rows
                        rows = g * p + np.flatnonzero(dead_rows)
                        mask = np.uint8((2**bits - 1) << (bits * j))
                        if name == "v_codes" and not seed:
                            x[page, :, :, rows] |= mask
                        else:
                            x[page, :, rows] |= mask
                    elif x.shape[2] == bpp:  # per-block metadata or sums
                        x[page, :, slot] = junk(x)
                    else:  # per-token rows
                        x[page, :, tok[dead_rows]] = junk(x)
    ns = cfg.num_sink_tokens
    for s, n in enumerate(cache.lengths):
        n_u, sealed = _held(cache, s)
        for name in ("open_k", "open_v"):
            if name in a:
                a[name][s, :, n_u - sealed * p:] = np.nan
        for name in ("sink_k", "sink_v"):
            a[name][s, :, min(int(n), ns):] = np.nan
    return dataclasses.replace(cache, layer=dataclasses.replace(layer, **a))


def _pages_of(cache, s):
    return paging.pages_needed(int(cache.lengths[s]), page_size=cache.config.page_size,
                               num_sink_tokens=kv_cache.sink_tokens(cache.config))


# ----------------------------------------------------------------------------- reading


@dataclasses.dataclass
class Segments:
    """One sequence of a 2-bit cache in float64, per DESIGN.md's segments (H kv heads):
      sink_k, sink_v [H, ns', D]; blocks: list of dicts per sealed block with k_codes, v_codes
      [H, P, D] and the layout's metadata (kivi: k_scale/k_min [H, D], v_scale/v_min [H, P, NP];
      seed: k_* [H, P, NP], v_* [H, D]); open_v [H, m, D]; open_k [H, m, D] (kivi) or, seed,
      open_k_codes [H, m, D] with open_k_scale / open_k_min [H, m, NP].
    """

    sink_k: np.ndarray
    sink_v: np.ndarray
    blocks: list
    open_v: np.ndarray
    open_k: np.ndarray | None = None
    open_k_codes: np.ndarray | None = None
    open_k_scale: np.ndarray | None = None
    open_k_min: np.ndarray | None = None


def read(cache) -> list:
    """Segments of every sequence of a 2-bit cache (module docstring)."""
    layer, cfg = cache.layer, cache.config
    f = {name: np.asarray(getattr(layer, name)) for name in array_fields(layer)}
    f64 = lambda x: np.asarray(x, np.float64)
    p, _, _, bpp = _geometry(cfg, layer.head_dim)
    ns, seed = cfg.num_sink_tokens, cfg.layout == "seed"
    out = []
    for s, n in enumerate(cache.lengths):
        n = int(n)
        n_u, sealed = _held(cache, s)
        kt, vt = np.swapaxes(cache.k[s], 0, 1), np.swapaxes(cache.v[s], 0, 1)  # [H, T, D]

        def block(blk, rows=slice(None)):
            page, slot = cache.table[s, blk // bpp], blk % bpp
            g, j = divmod(slot, 8 // cfg.bits)
            prow = np.arange(g * p, (g + 1) * p)[rows]
            trow = np.arange(slot * p, (slot + 1) * p)[rows]
            per_block = lambda name: f64(f[name][page, :, slot])
            per_token = lambda name: f64(f[name][page][:, trow])
            b = dict(k_codes=f64(_plane(f["k_codes"][page], prow, j, False, cfg.bits)),
                     v_codes=f64(_plane(f["v_codes"][page], prow, j, not seed, cfg.bits)))
            kmeta, vmeta = (per_token, per_block) if seed else (per_block, per_token)
            b.update(k_scale=kmeta("k_scale"), k_min=kmeta("k_min"),
                     v_scale=vmeta("v_scale"), v_min=vmeta("v_min"))
            return b

        start = ns + sealed * p
        seg = Segments(sink_k=bf16(kt[:, :min(n, ns)]), sink_v=bf16(vt[:, :min(n, ns)]),
                       blocks=[block(b) for b in range(sealed)], open_v=bf16(vt[:, start:n]))
        if seed:
            if n > start:
                b = block(sealed, slice(0, n - start))
                seg.open_k_codes, seg.open_k_scale, seg.open_k_min = b["k_codes"], b["k_scale"], b["k_min"]
            else:
                h, d = layer.num_kv_heads, layer.head_dim
                seg.open_k_codes = np.zeros((h, 0, d))
                seg.open_k_scale = seg.open_k_min = np.zeros((h, 0, d // _geometry(cfg, d)[1]))
        else:
            seg.open_k = bf16(kt[:, start:n])
        out.append(seg)
    return out


def _per_group(meta, d):  # [..., NP] -> [..., D]
    return np.repeat(meta, d // meta.shape[-1], axis=-1)


def dequantized(cache) -> list:
    """[(k_hat, v_hat) f64[n, H, D]] per sequence: the cache's contents, decoded in NumPy."""
    cfg, layer = cache.config, cache.layer
    if cfg.kv_format not in BLOCKED:
        f = {x.name: np.asarray(getattr(layer, x.name), np.float64)
             for x in dataclasses.fields(layer) if x.name != "config"}
        ps, out = cfg.page_size, []
        for s, n in enumerate(cache.lengths):
            t = np.arange(int(n))
            pages, rows = cache.table[s, t // ps], t % ps
            if "k" in f:
                k, v = f["k"][pages, :, rows], f["v"][pages, :, rows]  # [n, H, D]
            else:
                k = f["k_codes"][pages, :, rows] * f["k_scale"][pages, :, rows][..., None] + f["k_min"][pages, :, rows][..., None]
                v = f["v_codes"][pages, :, rows] * f["v_scale"][pages, :, rows][..., None] + f["v_min"][pages, :, rows][..., None]
            out.append((k, v))
        return out
    seed, d = cfg.layout == "seed", layer.head_dim
    out = []
    for seg in read(cache):
        def deq(codes, scale, minimum, per_token):
            if per_token:
                return codes * _per_group(scale, d) + _per_group(minimum, d)
            return codes * scale[:, None, :] + minimum[:, None, :]

        kb = [deq(b["k_codes"], b["k_scale"], b["k_min"], seed) for b in seg.blocks]
        vb = [deq(b["v_codes"], b["v_scale"], b["v_min"], not seed) for b in seg.blocks]
        open_k = (deq(seg.open_k_codes, seg.open_k_scale, seg.open_k_min, True) if seed else seg.open_k)
        k = np.concatenate([seg.sink_k, *kb, open_k], axis=1)
        v = np.concatenate([seg.sink_v, *vb, seg.open_v], axis=1)
        out.append((np.swapaxes(k, 0, 1), np.swapaxes(v, 0, 1)))
    return out


_dequantize_jit = jax.jit(kv_cache.dequantize_cache, static_argnames="return_step")


def gather(layer, seq: int, kv_len: int, page_indices, *, return_step: bool = False):
    """One sequence's contents through the public dequantize_cache: (k, v) np.float32[kv_len, H, D]
    (and the per-element steps with return_step)."""
    lens = np.zeros(np.shape(page_indices)[0], np.int32)
    lens[seq] = kv_len
    out = _dequantize_jit(layer, jnp.asarray(page_indices, jnp.int32), jnp.asarray(lens),
                          return_step=return_step)
    return tuple(np.asarray(x[seq, :kv_len]) for x in out)


# ----------------------------------------------------------------------------- attention


def np_attention(q, k, v, q_pos=None):
    """Float64 softmax attention of one sequence: q [T, Hq, D], k/v [n, H, D] -> [T, Hq, D];
    query head h uses kv head h // (Hq // H); query t sees keys j <= q_pos[t] (None: all keys).
    Rows that see no key are 0."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # [n, Hq, D]
    logits = np.einsum("thd,nhd->htn", q, k) / math.sqrt(q.shape[-1])
    vis = np.ones((q.shape[0], k.shape[0]), bool) if q_pos is None else (
        np.arange(k.shape[0])[None, :] <= np.asarray(q_pos)[:, None])
    logits = np.where(vis[None], logits, -np.inf)
    m = logits.max(-1, keepdims=True, initial=-np.inf)
    w = np.where(vis[None], np.exp(logits - np.where(np.isfinite(m), m, 0)), 0.0)
    l = w.sum(-1, keepdims=True)
    return np.einsum("htn,nhd->thd", w / np.where(l > 0, l, 1), v)


def np_int8_image(x, axis, group):
    """Dequantized INT8 image of x per `group` consecutive elements along `axis`, by the quantizer
    contract's float32 arithmetic (nearest, float32 metadata, folded minimum: oracles.q8_rows), the
    one the references and kernels use for transient operands, so codes agree except where float32
    evaluation order moves a value across a rounding tie."""
    x = np.moveaxis(np.asarray(x, np.float64), axis, -1)
    shape = x.shape
    codes, s, mf = q8_rows(x.reshape(-1, group))
    return np.moveaxis((s[:, None] * codes + mf[:, None]).reshape(shape), -1, axis)


class _Softmax:
    """Sequential online softmax in float64 over query rows."""

    def __init__(self, rows, head_dim):
        self.acc, self.m, self.l = np.zeros((rows, head_dim)), np.full(rows, -np.inf), np.zeros(rows)

    def add(self, acc, m, l):
        new = np.maximum(self.m, m)
        safe = np.where(np.isfinite(new), new, 0)
        a, b = np.exp(self.m - safe), np.exp(m - safe)
        self.acc, self.l, self.m = self.acc * a[:, None] + acc * b[:, None], self.l * a + l * b, new

    @staticmethod
    def weights(logits, mask):
        m = np.where(mask, logits, -np.inf).max(-1, initial=-np.inf)
        return np.where(mask, np.exp(logits - np.where(np.isfinite(m), m, 0)[:, None]), 0.0), m

    def output(self):
        return np.where(self.l[:, None] > 0, self.acc / np.where(self.l > 0, self.l, 1)[:, None], 0)


def np_hack_attention(q, seg: Segments, config, q_pos, *, transient_int8=True, round_to=None):
    """DESIGN.md "Homomorphic attention semantics" in float64 for one sequence of a 2-bit cache.

    q [T, Hq, D] at positions q_pos int[T] (sees keys j <= q_pos[t]); seg from read(). The sinks,
    each sealed block (kivi: Q scaled by the K channel scales and the softmax weights times the V
    scales, quantized INT8 per (row, channel group) / (row, block); seed: Q per (row, channel group)
    once, W per (row, block)), then the open block, merged by one online softmax. transient_int8
    False: the transients unquantized (plain dequantize-then-attend, merged per block). round_to: a
    16-bit dtype (np.float16, ml_dtypes.bfloat16): the transients rounded to it from float32 instead
    (the folded decode math done naively, kivi).
    """
    q = np.asarray(q, np.float64)
    t_len, hq, d = q.shape
    h = seg.sink_k.shape[0]
    g = hq // h
    p = config.partition_size
    pc, ns = _geometry(config, d)[1], config.num_sink_tokens
    image = np_int8_image if transient_int8 else (lambda x, axis, group: x)
    if round_to is not None:
        image = lambda x, axis, group: np.asarray(np.asarray(x, np.float32).astype(round_to), np.float64)  # noqa: E731
    q_pos = np.repeat(np.asarray(q_pos), g)  # rows r = t * G + g
    vis = lambda first, count: np.arange(first, first + count)[None, :] <= q_pos[:, None]
    out = np.zeros((t_len, hq, d))
    for kh in range(h):
        q_s = q[:, kh * g:(kh + 1) * g].reshape(t_len * g, d) / math.sqrt(d)
        sm = _Softmax(t_len * g, d)
        q_img = image(q_s, 1, pc)

        def dense(logits, vv, mask):
            w, m = sm.weights(logits, mask)
            sm.add(w @ vv, m, w.sum(-1))

        dense(q_s @ seg.sink_k[kh].T, seg.sink_v[kh], vis(0, seg.sink_k.shape[1]))
        for i, b in enumerate(seg.blocks):
            mask = vis(ns + i * p, p)
            kc, vc = b["k_codes"][kh], b["v_codes"][kh]  # [P, D]
            if config.layout == "kivi":
                sigma, mu, tau, nu = b["k_scale"][kh], b["k_min"][kh], b["v_scale"][kh], b["v_min"][kh]
                logits = image(q_s * sigma, 1, pc) @ kc.T + (q_s @ mu)[:, None]
                w, m = sm.weights(logits, mask)
                wt = image(w[:, :, None] * tau[None], 1, p)  # [rows, P, NP], per (row, group)
                acc = np.einsum("rjc,jc->rc", _per_group(wt, d), vc) + w @ _per_group(nu, d)
                sm.add(acc, m, w.sum(-1))
            else:
                k_hat = _per_group(b["k_scale"][kh], d) * kc + _per_group(b["k_min"][kh], d)
                v_hat = b["v_scale"][kh] * vc + b["v_min"][kh]
                w, m = sm.weights(q_img @ k_hat.T, mask)
                w_img = image(w, 1, p)
                sm.add(w_img @ v_hat, m, w_img.sum(-1))
        start, m_open = ns + len(seg.blocks) * p, seg.open_v.shape[1]
        if config.layout == "kivi":
            logits = q_s @ seg.open_k[kh].T
        else:
            k_hat = (_per_group(seg.open_k_scale[kh], d) * seg.open_k_codes[kh]
                     + _per_group(seg.open_k_min[kh], d))
            logits = q_img @ k_hat.T
        dense(logits, seg.open_v[kh], vis(start, m_open))
        out[:, kh * g:(kh + 1) * g] = sm.output().reshape(t_len, g, d)
    return out


def np_cache_attention(q, cache, q_pos, *, transient_int8=True, round_to=None):
    """Float64 twin of hack_jax.attention over a Cache: q f[S, T, Hq, D], q_pos int[S, T] (a query
    at or past its sequence's length sees nothing) -> f64[S, T, Hq, D]. 2-bit formats:
    np_hack_attention on the pages' codes; the others: np_attention over the dequantized pages."""
    q_pos = np.where(q_pos < cache.lengths[:, None], q_pos, -1)
    out = np.zeros(q.shape)
    if cache.config.kv_format in BLOCKED:
        for s, seg in enumerate(read(cache)):
            out[s] = np_hack_attention(q[s], seg, cache.config, q_pos[s], transient_int8=transient_int8,
                                       round_to=round_to)
    else:
        for s, (k, v) in enumerate(dequantized(cache)):
            out[s] = np_attention(q[s], k, v, q_pos[s])
    return out
