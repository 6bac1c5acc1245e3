"""Machinery the two 2-bit layouts (kivi.py, seed.py) share: the prefill block stream, the append
step's sink / open-block / seal targets, block reads (HackBlocks) and their dequantization.

A 2-bit layer holds token t < num_sink_tokens (ns) in a 16-bit per-sequence sink, token t >= ns at
block position u = t - ns: page column u // page_size, row u % page_size, block u // P. The newest
u % W tokens (W = config.open_window: partition_size, or the kivi `window`, a multiple of P) are the
16-bit open region ("open block" when W = P); when it holds W tokens its W // P blocks are sealed
(quantized into their page slots with their code sums), so config.sealed_blocks(u) =
(u // W) * (W // P) blocks are sealed. Packed code bytes hold C = config.codes_per_byte blocks (a packing
group, one plane per block: 4 at 2 bits, 2 at 4 bits; hack_jax.packing).
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hack_jax import packing
from hack_jax.kv_cache.common import ALL, geometry, page_ids, put, safe_ids


def code_index(pages, rows, token_major):
    """Index of packed code rows `rows` (int, broadcast with `pages`) of pages `pages` in a code array:
    channel-major u8[N, H, page_size // C, D] or token-major u8[N, H, D, page_size // C] (kivi V).
    Either way a[index] is [*broadcast(pages, rows).shape, H, D] (the advanced axes first) and
    put(a, index, x) takes x of that shape: one in-place scatter, no transpose of the pool."""
    return (pages, ALL, ALL, rows) if token_major else (pages, ALL, rows)


def set_plane(old, codes, plane, bits):
    """Clears plane `plane` (int, broadcastable) of packed bytes `old` and ORs in `bits`-bit `codes`."""
    shift = packing.plane_shift(plane, bits).astype(jnp.uint8)
    mask = packing.plane_mask(plane, bits).astype(jnp.uint8)
    return (old & ~mask) | (codes.astype(jnp.uint8) << shift)


def channel_sums(codes, np_, pc):
    """u8[..., D] -> i32[..., NP]: code sums per channel group."""
    return codes.reshape(codes.shape[:-1] + (np_, pc)).astype(jnp.int32).sum(-1)


# ----------------------------------------------------------------------------- prefill


class PrefillStream:
    """Rows [0, lengths) of k/v f32[S, T, H, D] as tokens [start, start + lengths) (start None: 0,
    empty slots), seen as a stream of block positions u = ustart + i, i < NU.

    ustart is the packing group of the old open region's first block b0; the stream holds the
    earlier 16-bit open tokens (u in [b0 P, u_old)) followed by the new tokens. Its complete blocks in
    [b0, sealed_new) are the ones this write seals; packed bytes keep the planes of tokens stored
    before (u < u_keep). Masks: tok_sealed / tok_new bool[S, NU] (tokens of the blocks sealed now /
    tokens written now), blk_sealed bool[S, NB].
    """

    def __init__(self, layer, k, v, lengths, page_indices, start):
        cfg = layer.config
        self.p, self.pc, self.np_, self.bpp = geometry(cfg, layer.head_dim)
        self.ps, self.ns, self.n = cfg.page_size, cfg.num_sink_tokens, layer.num_pages
        self.bits, self.c = cfg.bits, cfg.codes_per_byte  # C blocks per packing group
        p, ps, ns, c = self.p, self.ps, self.ns, self.c
        self.s, self.t_len, self.h, self.d = k.shape
        self.page_indices, self.lengths = page_indices, lengths
        self.chunked = chunked = start is not None
        self.st = st = start if chunked else jnp.zeros_like(lengths)
        self.kt = jnp.swapaxes(k, 1, 2).astype(jnp.float32)  # [S, H, T, D]
        self.vt = jnp.swapaxes(v, 1, 2).astype(jnp.float32)
        self.written = written = lengths > 0
        cap = page_indices.shape[1] * ps
        self.u_old = u_old = jnp.clip(st - ns, 0, cap)  # block positions held before this write
        self.u_new = u_new = jnp.clip(st + lengths - ns, 0, cap)  # ... and after it
        self.w = w = cfg.open_window
        self.b0 = b0 = cfg.sealed_blocks(u_old)  # the old open region's first block: the first this write can seal
        self.sealed_new = sealed_new = cfg.sealed_blocks(u_new)
        if chunked:  # (b0 % C) P + (u_old - b0 P) + T <= T + (C - 1) P + W - 1 stream positions
            ng = -(-(self.t_len + (c - 1) * p + w - 1) // (c * p))
            self.ustart = (b0 // c) * (c * p)
        else:
            ng = max(1, -(-(self.t_len - ns) // (c * p)))  # packing groups covering the prompt (>= 1: shapes)
            self.ustart = jnp.zeros_like(lengths)
        self.ng, self.nb, self.nu = ng, c * ng, c * ng * p
        self.u = u = self.ustart[:, None] + jnp.arange(self.nu)[None, :]  # [S, NU]
        self.gb = gb = (self.ustart // p)[:, None] + jnp.arange(self.nb)[None, :]  # [S, NB] block index
        in_new_blocks = (u >= (b0 * p)[:, None]) & (u < (sealed_new * p)[:, None])
        self.tok_sealed = written[:, None] & in_new_blocks
        self.tok_new = written[:, None] & (u >= u_old[:, None]) & (u < u_new[:, None])
        self.blk_sealed = written[:, None] & (gb >= b0[:, None]) & (gb < sealed_new[:, None])

    def stream(self, x, old_open):
        """x f32[S, H, T, D] (+ the old open region bf16[S, H, W, D], or None) -> f32[S, H, NU, D]."""
        ns, nu, t_len, p = self.ns, self.nu, self.t_len, self.p
        if not self.chunked:
            return jnp.pad(x[:, :, ns:], ((0, 0), (0, 0), (0, nu - max(t_len - ns, 0)), (0, 0)))
        u = self.u
        row = jnp.clip(u + ns - self.st[:, None], 0, t_len - 1)  # k/v row of the new token at u
        new = jnp.take_along_axis(x, row[:, None, :, None], axis=2)
        old_row = jnp.clip(u - (self.b0 * p)[:, None], 0, self.w - 1)
        old = 0.0 if old_open is None else jnp.take_along_axis(
            old_open.astype(jnp.float32), old_row[:, None, :, None], axis=2)
        return jnp.where((u < self.u_old[:, None])[:, None, :, None], old, new)

    def keep(self, u_keep):
        """The planes to keep in put_codes: tokens u < u_keep, or None for a fresh (empty) slot."""
        return u_keep if self.chunked else None

    def put_blocks(self, a, x, ok):
        """Per-block values x [S, H, NB, X] into their page slots (gb // bpp, gb % bpp) where ok."""
        pages = page_ids(self.page_indices, self.gb // self.bpp, ok, self.n)
        return put(a, (pages, ALL, self.gb % self.bpp), jnp.swapaxes(x, 1, 2))

    def put_tokens(self, a, x, ok):
        """Per-token values x [S, H, NU, X] into their page rows u % page_size where ok."""
        pages = page_ids(self.page_indices, self.u // self.ps, ok, self.n)
        return put(a, (pages, ALL, self.u % self.ps), jnp.swapaxes(x, 1, 2))

    def put_codes(self, a, codes, ok, u_keep, token_major=False):
        """Packs codes u8[S, H, NU, D] per packing group (zero where not ok) and writes every group
        holding an ok token into `a` (token_major: kivi v_codes, else channel-major); planes of
        tokens u < u_keep (stored before) are kept (None: the slot was empty, no old plane needs
        keeping)."""
        s, h, ng, p, d, n, bpp, c = self.s, self.h, self.ng, self.p, self.d, self.n, self.bpp, self.c
        codes = jnp.where(ok[:, None, :, None], codes, 0).reshape(s, h, ng, c * p, d)
        packed = jnp.moveaxis(packing.pack_codes(codes, 3, self.bits), 1, 3)  # [S, NG, P, H, D]
        gg = (self.ustart // (c * p))[:, None] + jnp.arange(ng)[None, :]  # [S, NG] packing group in the seq
        g_ok = ok.reshape(s, ng, c * p).any(-1)
        pages = page_ids(self.page_indices, gg // (bpp // c), g_ok, n)
        rows = (gg % (bpp // c))[:, :, None] * p + jnp.arange(p)  # [S, NG, P]
        if u_keep is not None:
            j = jnp.arange(c)[:, None]  # [C, 1] plane = block of the packing group
            uu = (gg * c * p)[:, :, None, None] + j * p + jnp.arange(p)  # [S, NG, C, P]
            keep = uu < u_keep[:, None, None, None]
            mask = jnp.sum(jnp.where(keep, packing.plane_mask(j, self.bits), 0), axis=2).astype(jnp.uint8)
            old = a[code_index(jnp.minimum(pages, n - 1)[:, :, None], rows, token_major)]  # [S, NG, P, H, D]
            packed = (old & mask[..., None, None]) | packed
        return put(a, code_index(pages[:, :, None], rows, token_major), packed)

    def open_block(self, x, old):
        """The new open region (positions sealed_new * P + i, i < u_new % W; zero beyond) taken from
        the stream x f32[S, H, NU, D]; slots not written keep `old` [S, H, W, D]."""
        i = jnp.arange(self.w)
        src = jnp.clip((self.sealed_new * self.p - self.ustart)[:, None] + i[None, :], 0, self.nu - 1)
        ok = (i[None, :] < (self.u_new - self.sealed_new * self.p)[:, None])[:, None, :, None]
        blk = jnp.take_along_axis(x, src[:, None, :, None], axis=2)  # [S, H, W, D]
        return jnp.where(self.written[:, None, None, None], jnp.where(ok, blk, 0), old).astype(old.dtype)

    def sinks(self, x, old):
        """Sink rows from x f32[S, H, T, D]: t < start kept, [start, start + lengths) new, zero beyond."""
        if self.ns == 0:
            return old
        st = self.st
        t = jnp.arange(self.ns)[None, :]
        row = jnp.clip(t - st[:, None], 0, self.t_len - 1)  # [S, ns]
        new_rows = jnp.take_along_axis(x, row[:, None, :, None], axis=2)  # [S, H, ns, D]
        is_new = ((t >= st[:, None]) & (t < (st + self.lengths)[:, None]))[:, None, :, None]
        kept = (t < st[:, None])[:, None, :, None]
        rows = jnp.where(is_new, new_rows, jnp.where(kept, old.astype(jnp.float32), 0.0))
        return jnp.where(self.written[:, None, None, None], rows, old).astype(old.dtype)


# ----------------------------------------------------------------------------- append


class AppendStep:
    """Targets of one appended token per slot (token kv_lens[s] of slot s, `active` slots only):
    its sink row or its open-region row u % W, and, for a slot whose open region it fills (`seal`),
    the page slots of the region's W // P blocks: block j's targets are those of `block(j)` (this
    step itself is block 0's)."""

    def __init__(self, layer, kv_lens, active, page_indices):
        cfg = layer.config
        self.p, self.pc, self.np_, self.bpp = geometry(cfg, layer.head_dim)
        self.ps, self.n = cfg.page_size, layer.num_pages
        self.bits, self.c = cfg.bits, cfg.codes_per_byte  # C blocks per packing group
        p, bpp, ps, n, ns = self.p, self.bpp, self.ps, self.n, cfg.num_sink_tokens
        self.page_indices = page_indices
        self.is_sink = active & (kv_lens < ns)
        self.in_pages = in_pages = active & (kv_lens >= ns) & (
            kv_lens < ns + page_indices.shape[1] * ps)  # else dropped
        self.u = u = jnp.maximum(kv_lens - ns, 0)
        self.w = w = cfg.open_window
        self.num_blocks = w // p  # blocks a seal writes
        self.pos = u % w  # the open-region row
        self.seal = in_pages & (self.pos == w - 1)
        self.kv_lens, self._ns = kv_lens, ns
        self._first = cfg.sealed_blocks(u)  # the open region's first block
        self._at_block(0)

    def block(self, j):
        """A copy of this step whose block targets (slot, seal_pages, blk_rows, tok_rows,
        block_positions) are those of the open region's block j (sealed with rows j P .. j P + P - 1
        of the region)."""
        other = copy.copy(self)
        other._at_block(j)
        return other

    def _at_block(self, j):
        p, bpp, n = self.p, self.bpp, self.n
        blk = self._first + j
        self.slot = slot = blk % bpp
        self.seal_pages = page_ids(self.page_indices, blk // bpp, self.seal, n)  # [S]
        i = jnp.arange(p)
        self.blk_rows = (slot // self.c)[:, None] * p + i[None, :]  # [S, P] packed rows of the block
        self.tok_rows = slot[:, None] * p + i[None, :]  # [S, P] token rows of the block
        self.block_positions = self._ns + blk[:, None] * p + i[None, :]  # [S, P] its tokens' positions

    def put_row(self, a, x, ok, row, layer_index=None):
        """Row `row` i32[S] of per-sequence buffer a [S, H, R, D] set to x [S, H, D] where ok; with
        layer_index i, a is stacked [L, S, H, R, D] and layer i's rows are set (in place)."""
        index = (jnp.arange(row.shape[0]), ALL, jnp.where(ok, row, a.shape[-2]))
        return put(a, index if layer_index is None else (layer_index,) + index, x)

    def sinks(self, layer, k, v, layer_index=None, write=True):
        """The sink arrays with each sink token's rows set; write=False (kv_cache.append's sinks=False,
        the host knows no token is a sink): {} (no scatter: sink_k / sink_v stay the arrays they are)."""
        if not write:
            return {}
        return dict(sink_k=self.put_row(layer.sink_k, k, self.is_sink, self.kv_lens, layer_index),
                    sink_v=self.put_row(layer.sink_v, v, self.is_sink, self.kv_lens, layer_index))

    def put_open(self, a, x, layer_index=None):
        return self.put_row(a, x, self.in_pages, self.pos, layer_index)

    def put_block_codes(self, a, codes, token_major=False):
        """Clears the sealed block's plane in its packing group and ORs the new codes u8[S, H, P, D]
        (token_major: kivi v_codes, else channel-major)."""
        n = self.n
        old = a[code_index(jnp.minimum(self.seal_pages, n - 1)[:, None], self.blk_rows, token_major)]
        new_bytes = set_plane(old, jnp.swapaxes(codes, 1, 2), (self.slot % self.c)[:, None, None, None], self.bits)
        return put(a, code_index(self.seal_pages[:, None], self.blk_rows, token_major), new_bytes)

    def put_block(self, a, x):
        """Per-block values x [S, H, X] into the sealed block's slot."""
        return put(a, (self.seal_pages, ALL, self.slot), x)

    def put_block_tokens(self, a, x):
        """Per-token values x [S, H, P, X] into the sealed block's token rows."""
        return put(a, (self.seal_pages[:, None], ALL, self.tok_rows), jnp.swapaxes(x, 1, 2))

    def zero_sealed(self, x):
        """Open regions [S, H, W, D] zeroed in the slots that seal."""
        return jnp.where(self.seal[:, None, None, None], 0, x).astype(x.dtype)


# ----------------------------------------------------------------------------- reading


class HackBlocks(NamedTuple):
    """Every sealed block of every sequence of a 2-bit layer, read through page_indices and
    unpacked (NB = pages_per_seq * page_size // P blocks per sequence, in token order).

    Entries beyond a sequence's length are zeroed (codes, metadata and sums), so stale or NaN page
    contents cannot leak. Metadata as stored (f16), sums as i32 (a kivi layer without stored sums,
    QuantConfig.code_sums False: derived from the codes, the same integers); per-layout meaning as in
    KiviPages / SeedPages with the page axes replaced by [S, NB]:
      kivi: k_scale/k_min [S, NB, H, D], k_sums [S, NB, H, P, NP],
            v_scale/v_min [S, NB, H, P, NP], v_sums [S, NB, H, D]
      seed: k_scale/k_min/k_sums [S, NB, H, P, NP], v_scale/v_min/v_sums [S, NB, H, D]
      k_codes, v_codes u8[S, NB, H, P, D] in [0, 2**config.bits - 1].
    seed: K of the tokens in the open block is in block num_sealed (valid rows < num_open).
    """

    k_codes: jax.Array
    k_scale: jax.Array
    k_min: jax.Array
    k_sums: jax.Array
    v_codes: jax.Array
    v_scale: jax.Array
    v_min: jax.Array
    v_sums: jax.Array
    num_sealed: jax.Array  # i32[S] complete blocks
    num_open: jax.Array  # i32[S] tokens in the open region (< config.open_window)
    num_sinks: jax.Array  # i32[S] sink tokens held


class BlockReader:
    """Gathers a 2-bit layer's pages for all sequences as [S, NB, ...] blocks, with the masks that
    zero what lies beyond each length (kv_lens clipped to the capacity; ids outside [0, num_pages)
    read the null page)."""

    def __init__(self, layer, page_indices, kv_lens):
        cfg = layer.config
        self.p, _, _, self.bpp = geometry(cfg, layer.head_dim)
        self.bits, self.c = cfg.bits, cfg.codes_per_byte
        p, bpp = self.p, self.bpp
        ns = cfg.num_sink_tokens
        self.kv_lens = kv_lens = jnp.asarray(kv_lens, jnp.int32)
        self.ids = ids = safe_ids(page_indices, layer.num_pages)
        self.s, self.pps = s, pps = ids.shape
        self.nb = nb = pps * bpp
        n_u = jnp.clip(kv_lens - ns, 0, pps * cfg.page_size)  # lengths beyond capacity are clipped
        self.num_sealed = cfg.sealed_blocks(n_u)
        self.num_open = n_u - self.num_sealed * p  # < W = config.open_window
        self.num_sinks = jnp.minimum(kv_lens, ns)
        self.blk_ok = jnp.arange(nb)[None, :] < self.num_sealed[:, None]  # [S, NB]
        self.tok_ok = (jnp.arange(nb * p) < n_u[:, None]).reshape(s, nb, p)  # [S, NB, P]

    def codes(self, a, token_major=False):
        """u8[N, H, ps//C, D] (token_major [N, H, D, ps//C]) -> u8[S, NB, H, P, D]."""
        s, pps, bpp, p, nb, c = self.s, self.pps, self.bpp, self.p, self.nb, self.c
        g = a[self.ids]  # [S, pps, H, ps//C, D] (token_major: [S, pps, H, D, ps//C])
        if token_major:
            g = jnp.swapaxes(g, 3, 4)  # the gathered pages only, never the pool
        g = g.reshape(s, pps, g.shape[2], bpp // c, p, g.shape[-1])
        g = packing.unpack_codes(g, 4, self.bits).reshape(s, pps, g.shape[2], bpp // c, c, p, g.shape[-1])
        return jnp.moveaxis(g, 2, 4).reshape(s, nb, g.shape[2], p, g.shape[-1])

    def per_block(self, a):  # [N, H, bpp, X] -> [S, NB, H, X]
        g = jnp.swapaxes(a[self.ids], 2, 3)
        return g.reshape(self.s, self.nb, g.shape[3], g.shape[4])

    def per_token(self, a):  # [N, H, ps, X] -> [S, NB, H, P, X]
        g = a[self.ids].reshape(self.s, self.pps, a.shape[1], self.bpp, self.p, a.shape[-1])
        return jnp.swapaxes(g, 2, 3).reshape(self.s, self.nb, a.shape[1], self.p, a.shape[-1])

    def blk_mask(self, x):  # zero beyond the sealed blocks
        return jnp.where(self.blk_ok.reshape(self.s, self.nb, *([1] * (x.ndim - 2))), x, 0)

    def tok_mask(self, x):  # zero beyond the tokens held
        return jnp.where(self.tok_ok.reshape(self.s, self.nb, 1, self.p, *([1] * (x.ndim - 4))), x, 0)

    def blocks(self, k_parts, v_parts) -> HackBlocks:
        return HackBlocks(*k_parts, *v_parts, num_sealed=self.num_sealed, num_open=self.num_open,
                          num_sinks=self.num_sinks)


def deq_over_tokens(codes, scale, minimum):
    """Per (block, channel) metadata: u8[..., P, D], f16[..., D] -> (x, step) f32[..., P, D]."""
    f = lambda x: x.astype(jnp.float32)
    x = f(codes) * f(scale)[..., None, :] + f(minimum)[..., None, :]
    return x, jnp.broadcast_to(scale[..., None, :], codes.shape)


def deq_over_channels(codes, scale, minimum):
    """Per (token, channel group) metadata: u8[..., D], f16[..., NP] -> (x, step) f32[..., D]."""
    np_ = scale.shape[-1]
    c = codes.astype(jnp.float32).reshape(codes.shape[:-1] + (np_, -1))
    out = c * scale.astype(jnp.float32)[..., None] + minimum.astype(jnp.float32)[..., None]
    return out.reshape(codes.shape), jnp.repeat(scale, codes.shape[-1] // np_, axis=-1)


def assemble(layer, blocks: HackBlocks, k, v, open_k):
    """(k, v, k_step, v_step) f32[S, capacity, H, D] from dequantized blocks k, v
    (x, step) pairs of [S, NB, H, P, D]: the open region (V always, K when open_k is not None) laid
    over its positions with step 0, the sinks in front with step 0."""
    cfg = layer.config
    p = cfg.partition_size
    s, nb, h, _, d = blocks.k_codes.shape
    flat = lambda x: jnp.swapaxes(x, 2, 3).reshape(s, nb * p, h, d).astype(jnp.float32)  # [S, U, H, D]
    (kq, kst), (vq, vst) = (tuple(map(flat, k)), tuple(map(flat, v)))
    u = jnp.arange(nb * p)
    in_open = (u[None, :] >= (blocks.num_sealed * p)[:, None]) & (
        u[None, :] < (blocks.num_sealed * p + blocks.num_open)[:, None])  # [S, U]
    j = jnp.clip(u[None, :] - (blocks.num_sealed * p)[:, None], 0, layer.open_v.shape[2] - 1)

    def overlay(quant, step, open_):  # open_ [S, H, W, D] placed at the open region's positions
        o = jnp.take_along_axis(jnp.swapaxes(open_, 1, 2).astype(jnp.float32), j[:, :, None, None], 1)
        m = in_open[:, :, None, None]
        return jnp.where(m, o, quant), jnp.where(m, 0.0, step)

    if open_k is not None:
        kq, kst = overlay(kq, kst, open_k)
    vq, vst = overlay(vq, vst, layer.open_v)
    sink = lambda x: jnp.swapaxes(x, 1, 2).astype(jnp.float32)  # [S, ns, H, D]
    zeros = jnp.zeros((s, cfg.num_sink_tokens, h, d), jnp.float32)
    kk = jnp.concatenate([sink(layer.sink_k), kq], axis=1)
    vv = jnp.concatenate([sink(layer.sink_v), vq], axis=1)
    return kk, vv, jnp.concatenate([zeros, kst], 1), jnp.concatenate([zeros, vst], 1)
