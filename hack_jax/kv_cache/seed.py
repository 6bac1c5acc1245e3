"""kv_format="hack", layout="seed" (the paper's layout, kept as a reference path: its perplexity
is x60 that of float32 KV on SmolLM2, HACK.md §4, so no Pallas kernel reads it): K quantized per
(token, channel group) as soon as a token arrives, written straight into its page row; only V goes
through the 16-bit open block and is quantized per (block, channel) when it seals."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from hack_jax.config import QuantConfig
from hack_jax.kv_cache import hack
from hack_jax.kv_cache.common import (STATIC, FormatOps, Pages, geometry, page_ids, put,
                                      pytree_dataclass, quant_blocks_over_tokens,
                                      quant_tokens_over_channels, token_noise, sums_dtype)


@pytree_dataclass
class SeedPages(Pages):
    """Names as in KiviPages (shown for 2 bits: page_size // C code rows in general), but both code
    arrays channel-major ([.., page_size // 4, head_dim],
    as KiviPages.k_codes) and no open_k:
      k_codes  u8[num_pages, num_kv_heads, page_size // 4, head_dim]
      k_scale, k_min  f16[num_pages, num_kv_heads, page_size, NP]
      k_sums   u8[num_pages, num_kv_heads, page_size, NP]
      v_codes  u8[num_pages, num_kv_heads, page_size // 4, head_dim]
      v_scale, v_min  f16[num_pages, num_kv_heads, bpp, head_dim]
      v_sums   u8[num_pages, num_kv_heads, bpp, head_dim]
      open_v   bf16[S, num_kv_heads, P, head_dim]
      sink_k, sink_v  bf16[S, num_kv_heads, ns, head_dim]
    """

    k_codes: jax.Array
    k_scale: jax.Array
    k_min: jax.Array
    k_sums: jax.Array
    v_codes: jax.Array
    v_scale: jax.Array
    v_min: jax.Array
    v_sums: jax.Array
    open_v: jax.Array
    sink_k: jax.Array
    sink_v: jax.Array
    config: QuantConfig = dataclasses.field(metadata=STATIC)


def init(config, n, h, d, s):
    p, pc, np_, bpp = geometry(config, d)
    ps, meta, res, ns = config.page_size, config.meta_dtype, config.residual_dtype, config.num_sink_tokens
    z, c = jnp.zeros, config.codes_per_byte
    return SeedPages(
        k_codes=z((n, h, ps // c, d), jnp.uint8), k_scale=z((n, h, ps, np_), meta),
        k_min=z((n, h, ps, np_), meta), k_sums=z((n, h, ps, np_), sums_dtype(pc, config.bits)),
        v_codes=z((n, h, ps // c, d), jnp.uint8), v_scale=z((n, h, bpp, d), meta),
        v_min=z((n, h, bpp, d), meta), v_sums=z((n, h, bpp, d), sums_dtype(p, config.bits)),
        open_v=z((s, h, p, d), res), sink_k=z((s, h, ns, d), res), sink_v=z((s, h, ns, d), res),
        config=config)


def write_prefill(layer, k, v, lengths, page_indices, start, key):
    cfg = layer.config
    st = hack.PrefillStream(layer, k, v, lengths, page_indices, start)
    s, h, nb, nu, p, d = st.s, st.h, st.nb, st.nu, st.p, st.d
    noise_k, noise_v = (token_noise(cfg, key, i, st.ns + st.u, h, d) for i in (0, 1))  # [S, H, NU, D]
    ku = st.stream(st.kt, None)  # K of earlier tokens is already in the pages
    vu = st.stream(st.vt, layer.open_v)
    kc, ksc, kmn, ksum = quant_tokens_over_channels(ku, cfg, st.pc, noise_k)
    vc, vsc, vmn, vsum = quant_blocks_over_tokens(vu.reshape(s, h, nb, p, d), cfg,
                                                  None if noise_v is None else noise_v.reshape(s, h, nb, p, d))
    new, blk = st.tok_new, st.blk_sealed
    return dataclasses.replace(
        layer,
        k_codes=st.put_codes(layer.k_codes, kc, new, st.keep(st.u_old)),
        k_scale=st.put_tokens(layer.k_scale, ksc, new),
        k_min=st.put_tokens(layer.k_min, kmn, new),
        k_sums=st.put_tokens(layer.k_sums, ksum, new),
        v_codes=st.put_codes(layer.v_codes, vc.reshape(s, h, nu, d), st.tok_sealed, st.keep(st.b0 * p)),
        v_scale=st.put_blocks(layer.v_scale, vsc, blk),
        v_min=st.put_blocks(layer.v_min, vmn, blk),
        v_sums=st.put_blocks(layer.v_sums, vsum, blk),
        open_v=st.open_block(vu, layer.open_v),
        sink_k=st.sinks(st.kt, layer.sink_k), sink_v=st.sinks(st.vt, layer.sink_v))


def append(layer, k, v, kv_lens, active, page_indices, key, seal, sinks):
    """K quantized at once into its page row and plane (every step); V into the open block, sealed
    per channel over its tokens when it fills (seal="always"); a sink token into its sink rows
    (sinks=True only)."""
    cfg = layer.config
    n = layer.num_pages
    step = hack.AppendStep(layer, kv_lens, active, page_indices)
    h, d = layer.num_kv_heads, layer.head_dim
    noise_k = token_noise(cfg, key, 0, kv_lens[:, None], h, d)  # the new token, at position kv_lens
    kc, ksc, kmn, ksum = quant_tokens_over_channels(k.astype(jnp.float32), cfg, step.pc,
                                                    None if noise_k is None else noise_k[:, :, 0])
    tok_pages = page_ids(page_indices, step.u // step.ps, step.in_pages, n)  # [S]
    prow = (step.slot // step.c) * step.p + step.pos
    old = layer.k_codes[jnp.minimum(tok_pages, n - 1), :, prow]  # [S, H, D]
    kbytes = hack.set_plane(old, kc, (step.slot % step.c)[:, None, None], step.bits)
    put_tok = lambda a, x: put(a, (tok_pages, slice(None), step.u % step.ps), x)
    out = dict(step.sinks(layer, k, v, write=sinks),
               k_codes=put(layer.k_codes, (tok_pages, slice(None), prow), kbytes),
               k_scale=put_tok(layer.k_scale, ksc), k_min=put_tok(layer.k_min, kmn),
               k_sums=put_tok(layer.k_sums, ksum), open_v=step.put_open(layer.open_v, v))
    if seal == "always":
        noise_v = token_noise(cfg, key, 1, step.block_positions, h, d)
        vc, vsc, vmn, vsum = quant_blocks_over_tokens(out["open_v"].astype(jnp.float32)[:, :, None], cfg,
                                                      None if noise_v is None else noise_v[:, :, None])
        out.update(v_codes=step.put_block_codes(layer.v_codes, vc[:, :, 0]),
                   v_scale=step.put_block(layer.v_scale, vsc[:, :, 0]),
                   v_min=step.put_block(layer.v_min, vmn[:, :, 0]),
                   v_sums=step.put_block(layer.v_sums, vsum[:, :, 0]),
                   open_v=step.zero_sealed(out["open_v"]))
    return dataclasses.replace(layer, **out)


def read_blocks(layer, page_indices, kv_lens) -> hack.HackBlocks:
    r = hack.BlockReader(layer, page_indices, kv_lens)
    i32 = lambda x: x.astype(jnp.int32)
    return r.blocks(
        (r.tok_mask(r.codes(layer.k_codes)), r.tok_mask(r.per_token(layer.k_scale)),
         r.tok_mask(r.per_token(layer.k_min)), i32(r.tok_mask(r.per_token(layer.k_sums)))),
        (r.blk_mask(r.codes(layer.v_codes)), r.blk_mask(r.per_block(layer.v_scale)),
         r.blk_mask(r.per_block(layer.v_min)), i32(r.blk_mask(r.per_block(layer.v_sums)))))


def dequantize(layer, page_indices, kv_lens):
    b = read_blocks(layer, page_indices, kv_lens)
    return hack.assemble(layer, b, hack.deq_over_channels(b.k_codes, b.k_scale, b.k_min),
                         hack.deq_over_tokens(b.v_codes, b.v_scale, b.v_min), open_k=None)


OPS = FormatOps(pages=SeedPages, blocked=True, init=init, write_prefill=write_prefill, append=append,
                dequantize=dequantize, read_blocks=read_blocks)
