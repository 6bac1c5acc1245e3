"""kv_format="kivi2": KIVI-2 (Liu et al. 2024, arXiv:2402.02750) as a paged cache.

Numerics (the official code's, jy-yuan/KIVI models/llama_kivi.py, group_size G = 32, residual
R = 128 = 4 G; `GROUP`, `RESIDUAL`): 2-bit asymmetric codes with an f16 scale and minimum
(hack_jax.quantization.quantize, nearest rounding), K per channel over groups of G tokens, V per
token over groups of G channels. The newest tokens stay 16-bit (bf16 here), and which ones depends
on L = the tokens held (kv_lens, the new token included):
  K: tokens t >= R * nk(L), nk(L) = (L - 1) // R: KIVI keeps a K residual of 1..R tokens at a decode
     step's attention and flushes it, R tokens at once, when it is full (we flush lazily, at the
     append of the next token, which is the same state at every attention);
  V: tokens t >= nq(L) = max(L - 1 - R, 0): the newest R + 1 tokens (KIVI quantizes the oldest
     full-precision V token after the attention of the step that made them R + 1).
Prompt tokens follow the same rule (KIVI's prefill leaves L % R K tokens and R V tokens 16-bit; the
next decode step then sees the states above).

Layout (token t in page column t // page_size, page row u = t % page_size; page_size a multiple of R):
- a page holds page_size / R chunks of R tokens; chunk m's codes are packed rows [m G, (m + 1) G),
  byte row m G + i holding 4 codes, plane j (bits 2j..2j+1) = token m R + j G + i (the 4 G-token
  groups of a chunk are the 4 planes of one [G, head_dim] byte tile).
- K scale/min per (G-token group u // G, channel); V scale/min per (channel group, token).
- open_k: the K residual, token t at row t % R; open_v: a ring of the newest 2 R tokens' V, token t at
  row t % (2 R). V codes are written when a token arrives (per-token quantization does not depend on
  its neighbours), K codes when its chunk is flushed.
Bits per element (head_dim 64, f16 metadata): 2 + 32 / G = 3 for K and V, plus the per-sequence
residual. No sinks, no open-block sealing; `seal` is ignored; rounding is always nearest.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from hack_jax.config import QuantConfig
from hack_jax.kv_cache.common import (ALL, STATIC, FormatOps, Pages, page_ids, put, pytree_dataclass,
                                      safe_ids, token_targets)
from hack_jax.quantization import quantize

GROUP = 32
RESIDUAL = 4 * GROUP  # KIVI's R = 128: one chunk = the 4 code planes of one [GROUP, D] byte tile
RING = 2 * RESIDUAL  # rows of open_v


@pytree_dataclass
class Kivi2Pages(Pages):
    """KIVI-2 pages (module docstring):
      k_codes, v_codes  u8[num_pages, num_kv_heads, page_size // 4, head_dim]
      k_scale, k_min    f16[num_pages, num_kv_heads, page_size // GROUP, head_dim]
      v_scale, v_min    f16[num_pages, num_kv_heads, head_dim // GROUP, page_size]
      open_k            bf16[max_seqs, num_kv_heads, RESIDUAL, head_dim]
      open_v            bf16[max_seqs, num_kv_heads, 2 * RESIDUAL, head_dim]
    """

    k_codes: jax.Array
    k_scale: jax.Array
    k_min: jax.Array
    v_codes: jax.Array
    v_scale: jax.Array
    v_min: jax.Array
    open_k: jax.Array
    open_v: jax.Array
    config: QuantConfig = dataclasses.field(metadata=STATIC)


def k_sealed_chunks(kv_lens):
    """nk(L) = max(L - 1, 0) // RESIDUAL: K chunks held in 2 bits (tokens < RESIDUAL * nk)."""
    return jnp.maximum(kv_lens - 1, 0) // RESIDUAL


def v_quantized_len(kv_lens):
    """nq(L) = max(L - 1 - RESIDUAL, 0): V tokens read from their 2-bit codes."""
    return jnp.maximum(kv_lens - 1 - RESIDUAL, 0)


def init(config, n, h, d, s):
    ps = config.page_size
    if ps % RESIDUAL or d % GROUP:
        raise ValueError(f"kivi2 needs page_size a multiple of {RESIDUAL} and head_dim a multiple of "
                         f"{GROUP}: page_size={ps} head_dim={d}")
    z, meta = jnp.zeros, config.meta_dtype
    return Kivi2Pages(
        k_codes=z((n, h, ps // 4, d), jnp.uint8), k_scale=z((n, h, ps // GROUP, d), meta),
        k_min=z((n, h, ps // GROUP, d), meta), v_codes=z((n, h, ps // 4, d), jnp.uint8),
        v_scale=z((n, h, d // GROUP, ps), meta), v_min=z((n, h, d // GROUP, ps), meta),
        open_k=z((s, h, RESIDUAL, d), config.residual_dtype),
        open_v=z((s, h, RING, d), config.residual_dtype), config=config)


def _pack(codes):
    """codes u8[..., 4, GROUP, H, D] (plane j = group j of a chunk) -> bytes u8[..., GROUP, H, D]."""
    return sum(codes[..., j, :, :, :] << (2 * j) for j in range(4)).astype(jnp.uint8)


def _write(layer, k, v, lengths, page_indices, start):
    """write_prefill for both writers: k, v [S, T, H, D], token start[s] + t for t < lengths[s]."""
    cfg = layer.config
    s_n, t_len, h, d = k.shape
    ps, n = cfg.page_size, layer.num_pages
    cpp = ps // RESIDUAL  # chunks per page
    start = jnp.zeros_like(lengths) if start is None else start
    end = start + lengths
    on = lengths > 0
    rd = cfg.residual_dtype
    k, v = k.astype(rd).astype(jnp.float32), v.astype(rd).astype(jnp.float32)
    seq = jnp.arange(s_n)[:, None]

    def rows_of(t):  # input rows of tokens t int[S, ...] (clipped; callers mask)
        return k[seq.reshape((s_n,) + (1,) * (t.ndim - 1)), jnp.clip(t - start.reshape(
            (s_n,) + (1,) * (t.ndim - 1)), 0, t_len - 1)]

    # K: flush the chunks [nk(start), nk(end)), their older tokens taken from the residual.
    nk0, nk1 = k_sealed_chunks(start), k_sealed_chunks(end)
    c = nk0[:, None] + jnp.arange(t_len // RESIDUAL + 1)[None, :]  # [S, NC]
    tok = c[:, :, None] * RESIDUAL + jnp.arange(RESIDUAL)[None, None, :]  # [S, NC, R]
    old = jnp.swapaxes(layer.open_k, 1, 2)[seq[:, :, None], tok % RESIDUAL].astype(jnp.float32)
    b = lambda x: x.reshape(x.shape + (1, 1))
    src = jnp.where(b(tok < start[:, None, None]), old, rows_of(tok))  # [S, NC, R, H, D]
    q = quantize(src.reshape(s_n, -1, 4, GROUP, h, d), bits=2, axis=3, partition_size=GROUP,
                 meta_dtype=cfg.meta_dtype)
    pages = page_ids(page_indices, c // cpp, on[:, None] & (c < nk1[:, None]), n)  # [S, NC]
    byte_rows = (c % cpp)[:, :, None] * GROUP + jnp.arange(GROUP)  # [S, NC, G]
    groups = (c % cpp)[:, :, None] * 4 + jnp.arange(4)  # [S, NC, 4]
    k_codes = put(layer.k_codes, (pages[:, :, None], ALL, byte_rows), _pack(q.codes))
    k_scale = put(layer.k_scale, (pages[:, :, None], ALL, groups), q.scale[:, :, :, 0])
    k_min = put(layer.k_min, (pages[:, :, None], ALL, groups), q.minimum[:, :, :, 0])

    # K residual: the new tokens t >= RESIDUAL * nk(end), row t % RESIDUAL.
    t_new = start[:, None] + jnp.arange(t_len)[None, :]  # [S, T]
    new = jnp.arange(t_len)[None, :] < lengths[:, None]
    slot = lambda ok: jnp.where(ok, seq, s_n)  # out-of-range slot: the write is dropped
    open_k = put(layer.open_k, (slot(new & (t_new >= nk1[:, None] * RESIDUAL)), ALL, t_new % RESIDUAL), k)
    open_v = put(layer.open_v, (slot(new & (t_new >= end[:, None] - RING)), ALL, t_new % RING), v)

    # V codes, per token over GROUP channels: every chunk holding a new token gets its byte tile
    # rewritten, the planes of tokens not written here kept from the page.
    qv = quantize(v.reshape(s_n, t_len, h, d // GROUP, GROUP), bits=2, axis=4, partition_size=GROUP,
                  meta_dtype=cfg.meta_dtype)
    tpages, trows = token_targets(layer, lengths, page_indices, t_len, start)
    v_scale = put(layer.v_scale, (tpages, ALL, ALL, trows), qv.scale[..., 0])
    v_min = put(layer.v_min, (tpages, ALL, ALL, trows), qv.minimum[..., 0])
    cv = (start // RESIDUAL)[:, None] + jnp.arange(t_len // RESIDUAL + 2)[None, :]  # [S, NCV]
    tok = cv[:, :, None] * RESIDUAL + jnp.arange(RESIDUAL)[None, None, :]  # [S, NCV, R]
    is_new = (tok >= start[:, None, None]) & (tok < end[:, None, None])
    vcodes = qv.codes.reshape(s_n, t_len, h, d)
    vt = vcodes[seq[:, :, None], jnp.clip(tok - start[:, None, None], 0, t_len - 1)]  # [S, NCV, R, H, D]
    rpages = safe_ids(page_ids(page_indices, cv // cpp, on[:, None], n), n)  # reading: n -> null page
    vrows = (cv % cpp)[:, :, None] * GROUP + jnp.arange(GROUP)
    old = layer.v_codes[rpages[:, :, None], :, vrows]  # [S, NCV, G, H, D]
    planes = jnp.stack([(old >> (2 * j)) & 3 for j in range(4)], axis=2)  # [S, NCV, 4, G, H, D]
    vt = jnp.where(b(is_new).reshape(is_new.shape[:2] + (4, GROUP, 1, 1)),
                   vt.reshape(planes.shape), planes)
    wpages = page_ids(page_indices, cv // cpp, on[:, None] & is_new.any(-1), n)
    v_codes = put(layer.v_codes, (wpages[:, :, None], ALL, vrows), _pack(vt))
    return dataclasses.replace(layer, k_codes=k_codes, k_scale=k_scale, k_min=k_min, v_codes=v_codes,
                               v_scale=v_scale, v_min=v_min, open_k=open_k, open_v=open_v)


def write_prefill(layer, k, v, lengths, page_indices, start, key):
    return _write(layer, k, v, lengths, page_indices, start)


def append(layer, k, v, position, active, page_indices, key, seal, sinks):
    return _write(layer, k[:, None], v[:, None], active.astype(jnp.int32), page_indices, position)


def _unpack(codes):
    """u8[..., ps // 4, D] page rows -> codes f32[..., ps, D] in token order (module docstring)."""
    g = codes.reshape(codes.shape[:-2] + (-1, 1, GROUP, codes.shape[-1]))  # [..., cpp, 1, G, D]
    planes = (g >> (2 * jnp.arange(4, dtype=jnp.uint8))[:, None, None]) & 3  # [..., cpp, 4, G, D]
    return planes.reshape(codes.shape[:-2] + (-1, codes.shape[-1])).astype(jnp.float32)


def dequantize(layer, page_indices, kv_lens):
    ids = safe_ids(page_indices, layer.num_pages)
    s_n, pps = ids.shape
    ps, h, d = layer.config.page_size, layer.num_kv_heads, layer.head_dim
    tokens = lambda x: jnp.swapaxes(x, 2, 3).reshape(s_n, pps * ps, h, d)  # [S, pps, H, ps, D] -> [S, C, H, D]
    per_group = lambda x: jnp.repeat(x[ids].astype(jnp.float32), GROUP, axis=3)  # [S, pps, H, ps, D]
    ks, km = per_group(layer.k_scale), per_group(layer.k_min)
    k_hat = tokens(_unpack(layer.k_codes[ids]) * ks + km)
    vsc = lambda x: jnp.swapaxes(jnp.repeat(x[ids].astype(jnp.float32), GROUP, axis=3), 3, 4)
    vs, vm = vsc(layer.v_scale), vsc(layer.v_min)
    v_hat = tokens(_unpack(layer.v_codes[ids]) * vs + vm)
    t = jnp.arange(pps * ps)
    k16 = jnp.swapaxes(layer.open_k, 1, 2)[:, t % RESIDUAL].astype(jnp.float32)  # [S, C, H, D]
    v16 = jnp.swapaxes(layer.open_v, 1, 2)[:, t % RING].astype(jnp.float32)
    k_q = (t[None, :] < (k_sealed_chunks(kv_lens) * RESIDUAL)[:, None])[:, :, None, None]
    v_q = (t[None, :] < v_quantized_len(kv_lens)[:, None])[:, :, None, None]
    k = jnp.where(k_q, k_hat, k16)
    v = jnp.where(v_q, v_hat, v16)
    return (k, v, jnp.where(k_q, tokens(ks), 0.0), jnp.where(v_q, tokens(vs), 0.0))


OPS = FormatOps(pages=Kivi2Pages, blocked=False, init=init, write_prefill=write_prefill,
                append=append, dequantize=dequantize)
