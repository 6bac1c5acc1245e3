"""kv_format="hack", layout="kivi" (the default 2-bit format): K quantized per (block, channel),
V per (token, channel group); both go through the 16-bit open block (HACK.md §4 "kivi")."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from hack_jax.config import QuantConfig
from hack_jax.kv_cache import hack
from hack_jax.kv_cache.common import (STATIC, FormatOps, Pages, geometry, pytree_dataclass,
                                      quant_blocks_over_tokens, quant_tokens_over_channels, token_noise,
                                      sums_dtype)


# The page arrays the writers scatter into (k_sums / v_sums only where config.code_sums).
PAGE_FIELDS = ("k_codes", "k_scale", "k_min", "k_sums", "v_codes", "v_scale", "v_min", "v_sums")


@pytree_dataclass
class KiviPages(Pages):
    """P = partition_size, Pc = min(config.channel_group, head_dim) (v_group, default P),
    NP = head_dim // Pc, bpp = page_size // P, b = config.bits, C = 8 // b (codes per byte),
    S = max_seqs, ns = num_sink_tokens, sums u8 when (2**b - 1) * (codes summed: Pc or P) <= 255
    else u16 (shown for b = 2, C = 4):
      k_codes  u8[num_pages, num_kv_heads, page_size // 4, head_dim]  packed per packing group of C blocks
      k_scale, k_min  f16[num_pages, num_kv_heads, bpp, head_dim]      per (block, channel)
      k_sums   u8[num_pages, num_kv_heads, page_size, NP]              kappa, per (token, channel group)
      v_codes  u8[num_pages, num_kv_heads, head_dim, page_size // 4]  token-major: bits bj..bj+b-1
               of byte [page, h, c, g * P + r] hold the code of page row (Cg + j) P + r (in-block
               token r of block slot Cg + j: block j of packing group g), channel c, j = 0..C-1
      v_scale, v_min  f16[num_pages, num_kv_heads, page_size, NP]      per (token, channel group)
      v_sums   u8[num_pages, num_kv_heads, bpp, head_dim]              omega, per (block, channel)
      open_k, open_v  bf16[S, num_kv_heads, W, head_dim]               open region, per sequence
               (W = config.open_window: P, or the 16-bit recent window)
      sink_k, sink_v  bf16[S, num_kv_heads, ns, head_dim]
    With config.code_sums False, k_sums and v_sums are None (nothing allocated or written; readers
    derive the sums from the codes: `read_blocks`).
    """

    k_codes: jax.Array
    k_scale: jax.Array
    k_min: jax.Array
    k_sums: jax.Array | None
    v_codes: jax.Array
    v_scale: jax.Array
    v_min: jax.Array
    v_sums: jax.Array | None
    open_k: jax.Array
    open_v: jax.Array
    sink_k: jax.Array
    sink_v: jax.Array
    config: QuantConfig = dataclasses.field(metadata=STATIC)


def init(config, n, h, d, s):
    p, pc, np_, bpp = geometry(config, d)
    ps, meta, res, ns = config.page_size, config.meta_dtype, config.residual_dtype, config.num_sink_tokens
    z, c = jnp.zeros, config.codes_per_byte
    sums = z if config.code_sums else (lambda shape, dtype: None)
    return KiviPages(
        k_codes=z((n, h, ps // c, d), jnp.uint8), k_scale=z((n, h, bpp, d), meta),
        k_min=z((n, h, bpp, d), meta), k_sums=sums((n, h, ps, np_), sums_dtype(pc, config.bits)),
        v_codes=z((n, h, d, ps // c), jnp.uint8), v_scale=z((n, h, ps, np_), meta),
        v_min=z((n, h, ps, np_), meta), v_sums=sums((n, h, bpp, d), sums_dtype(p, config.bits)),
        open_k=z((s, h, config.open_window, d), res), open_v=z((s, h, config.open_window, d), res),
        sink_k=z((s, h, ns, d), res), sink_v=z((s, h, ns, d), res), config=config)


def write_prefill(layer, k, v, lengths, page_indices, start, key):
    """The blocks before the last (partial) window quantized at once and scattered into their page
    slots with code sums (config.code_sums), the remainder into the open region, sinks in 16 bits."""
    cfg = layer.config
    st = hack.PrefillStream(layer, k, v, lengths, page_indices, start)
    s, h, nb, nu, p, d = st.s, st.h, st.nb, st.nu, st.p, st.d
    noise_k, noise_v = (token_noise(cfg, key, i, st.ns + st.u, h, d) for i in (0, 1))  # [S, H, NU, D]
    ku = st.stream(st.kt, layer.open_k)
    vu = st.stream(st.vt, layer.open_v)
    kc, ksc, kmn, _ = quant_blocks_over_tokens(ku.reshape(s, h, nb, p, d), cfg,
                                               None if noise_k is None else noise_k.reshape(s, h, nb, p, d))
    kc = kc.reshape(s, h, nu, d)
    vc, vsc, vmn, _ = quant_tokens_over_channels(vu, cfg, st.pc, noise_v)
    sealed, blk, keep = st.tok_sealed, st.blk_sealed, st.keep(st.b0 * p)
    sums = {} if not cfg.code_sums else dict(
        k_sums=st.put_tokens(layer.k_sums, hack.channel_sums(kc, st.np_, st.pc), sealed),
        v_sums=st.put_blocks(layer.v_sums, vc.reshape(s, h, nb, p, d).astype(jnp.int32).sum(3), blk))
    return dataclasses.replace(
        layer, **sums,
        k_codes=st.put_codes(layer.k_codes, kc, sealed, keep),
        k_scale=st.put_blocks(layer.k_scale, ksc, blk),
        k_min=st.put_blocks(layer.k_min, kmn, blk),
        v_codes=st.put_codes(layer.v_codes, vc, sealed, keep, token_major=True),
        v_scale=st.put_tokens(layer.v_scale, vsc, sealed),
        v_min=st.put_tokens(layer.v_min, vmn, sealed),
        open_k=st.open_block(ku, layer.open_k), open_v=st.open_block(vu, layer.open_v),
        sink_k=st.sinks(st.kt, layer.sink_k), sink_v=st.sinks(st.vt, layer.sink_v))


def append(layer, k, v, kv_lens, active, page_indices, key, seal, sinks):
    """The token into its sink (sinks=True only) or open-region row; with seal="always", a slot whose
    open region fills is sealed, block by block (W // P consecutive blocks): K per channel over the
    block's tokens, V per token over channel groups ("never" / "after": the rows only)."""
    step = hack.AppendStep(layer, kv_lens, active, page_indices)
    layer = dataclasses.replace(layer, **step.sinks(layer, k, v, write=sinks), open_k=step.put_open(layer.open_k, k),
                                open_v=step.put_open(layer.open_v, v))
    return _seal_filled(layer, step, key) if seal == "always" else layer


def seal(layer, kv_lens, active, page_indices, key):
    """The sealing half of append(seal="always") on its own: the slots whose open region the token
    at position kv_lens[s] (an append(seal="after") already wrote its rows) filled are sealed."""
    return _seal_filled(layer, hack.AppendStep(layer, kv_lens, active, page_indices), key)


def _seal_filled(layer, step, key):
    """layer with the open regions of step's sealing slots quantized into their W // P block slots
    (with code sums: config.code_sums) and zeroed."""
    out = {name: getattr(layer, name) for name in PAGE_FIELDS if getattr(layer, name) is not None}
    p = step.p
    for j in range(step.num_blocks):
        rows = slice(j * p, (j + 1) * p)
        out.update(_seal_block(layer.config, out, step.block(j), layer.open_k[:, :, rows],
                               layer.open_v[:, :, rows], key, layer.num_kv_heads, layer.head_dim))
    return dataclasses.replace(layer, **out, open_k=step.zero_sealed(layer.open_k),
                               open_v=step.zero_sealed(layer.open_v))


def _seal_block(cfg, a, step, open_k, open_v, key, h, d):
    """The page arrays of `a` with the block of 16-bit rows open_k / open_v [S, H, P, D] sealed
    into step's block slot (the slots that do not seal drop their writes)."""
    noise_k, noise_v = (token_noise(cfg, key, i, step.block_positions, h, d) for i in (0, 1))  # [S, H, P, D]
    kc, ksc, kmn, _ = quant_blocks_over_tokens(open_k.astype(jnp.float32)[:, :, None], cfg,
                                               None if noise_k is None else noise_k[:, :, None])
    kc = kc[:, :, 0]  # [S, H, P, D]
    vc, vsc, vmn, _ = quant_tokens_over_channels(open_v.astype(jnp.float32), cfg, step.pc, noise_v)
    sums = {} if not cfg.code_sums else dict(
        k_sums=step.put_block_tokens(a["k_sums"], hack.channel_sums(kc, step.np_, step.pc)),
        v_sums=step.put_block(a["v_sums"], vc.astype(jnp.int32).sum(2)))
    return dict(
        sums,
        k_codes=step.put_block_codes(a["k_codes"], kc),
        k_scale=step.put_block(a["k_scale"], ksc[:, :, 0]),
        k_min=step.put_block(a["k_min"], kmn[:, :, 0]),
        v_codes=step.put_block_codes(a["v_codes"], vc, token_major=True),
        v_scale=step.put_block_tokens(a["v_scale"], vsc),
        v_min=step.put_block_tokens(a["v_min"], vmn))


def read_blocks(layer, page_indices, kv_lens) -> hack.HackBlocks:
    """HackBlocks (hack.py); without stored sums (config.code_sums False) they are derived from the
    codes read: kappa = the channel-group sums of each token's K codes, omega = the sums of each
    block's V codes over its tokens, the integers the writers would have stored (both zero beyond the
    sealed blocks, as the masked stored sums)."""
    r = hack.BlockReader(layer, page_indices, kv_lens)
    i32 = lambda x: x.astype(jnp.int32)
    k_codes = r.blk_mask(r.codes(layer.k_codes))  # [S, NB, H, P, D]
    v_codes = r.blk_mask(r.codes(layer.v_codes, token_major=True))
    if layer.k_sums is None:
        _, pc, np_, _ = geometry(layer.config, layer.head_dim)
        k_sums = hack.channel_sums(k_codes, np_, pc)  # [S, NB, H, P, NP]
    else:
        k_sums = i32(r.blk_mask(r.per_token(layer.k_sums)))
    v_sums = (v_codes.astype(jnp.int32).sum(3) if layer.v_sums is None  # [S, NB, H, D]
              else i32(r.blk_mask(r.per_block(layer.v_sums))))
    return r.blocks(
        (k_codes, r.blk_mask(r.per_block(layer.k_scale)), r.blk_mask(r.per_block(layer.k_min)), k_sums),
        (v_codes, r.blk_mask(r.per_token(layer.v_scale)), r.blk_mask(r.per_token(layer.v_min)), v_sums))


def dequantize(layer, page_indices, kv_lens):
    b = read_blocks(layer, page_indices, kv_lens)
    return hack.assemble(layer, b, hack.deq_over_tokens(b.k_codes, b.k_scale, b.k_min),
                         hack.deq_over_channels(b.v_codes, b.v_scale, b.v_min), open_k=layer.open_k)


OPS = FormatOps(pages=KiviPages, blocked=True, init=init, write_prefill=write_prefill, append=append,
                dequantize=dequantize, read_blocks=read_blocks, seal=seal)
