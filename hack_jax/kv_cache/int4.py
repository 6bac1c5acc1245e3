"""kv_format="int4": SAW-INT4 style (arXiv 2604.19157) K/V, token t in page column t // page_size.

Each K and V row (one token, one kv head) is multiplied by the block-diagonal normalized Hadamard
matrix M of QuantConfig.rotation (hack_jax.rotation.kv_rotation, no signs) and then quantized
asymmetrically to 4 bits over head_dim: x M ~ scale * (code - 8) + min, code in 0..15, scale and min
f16 (hack_jax.quantization.quantize, bits=4, round to nearest; min is its minimum + 8 scale, folded as
int8 folds 128: the centred codes keep the kernel's bf16 rounding of p * scale from adding a coherent
error, which the inverse rotation would gather into one channel). The rotation spreads a row's outlier
channels over its block before the one per-row scale is fixed; attention rotates q by M and the
output by M^T (hack_jax.attention), so pages hold the rotated basis (dequantize returns it).
Asymmetric rather than symmetric: 16 levels over [min, max] instead of 15 over [-amax, amax], the
rotated rows of keys are not centred (K's mean spreads over the block), and the kernel's cost of the
minimum is one per-row add (the int8 kernel's identity); it costs 16 bits per row, 16 / head_dim bits
per element. Codes are packed two per byte, "half-planar": byte j of a row holds channel j in its low
nibble and channel j + head_dim / 2 in its high nibble, so a kernel unpacks two [tokens, head_dim / 2]
tiles with a mask and a shift (no interleave). Bits per element: 4 + 32 / head_dim (4.5 at 64).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from hack_jax import rotation
from hack_jax.config import QuantConfig
from hack_jax.kv_cache.common import (STATIC, FormatOps, Pages, flat_tokens, per_token_writers,
                                      pytree_dataclass, safe_ids)
from hack_jax.quantization import quantize


@pytree_dataclass
class Int4Pages(Pages):
    """x M ~ scale * (code - 8) + min per (token, kv head), M = hack_jax.rotation.kv_rotation:
      k_codes, v_codes  u8[num_pages, num_kv_heads, page_size, head_dim // 2]  (pack_nibbles)
      k_scale, k_min, v_scale, v_min  f16[num_pages, num_kv_heads, page_size]  (min folded)
    """

    k_codes: jax.Array
    k_scale: jax.Array
    k_min: jax.Array
    v_codes: jax.Array
    v_scale: jax.Array
    v_min: jax.Array
    config: QuantConfig = dataclasses.field(metadata=STATIC)

    @property
    def head_dim(self) -> int:
        return 2 * self.k_codes.shape[-1]


CENTER = 8  # stored codes c mean c - CENTER


def pack_nibbles(codes):
    """u8[..., D] codes < 16 -> u8[..., D // 2]: byte j = codes[j] | codes[j + D // 2] << 4."""
    half = codes.shape[-1] // 2
    return (codes[..., :half] | (codes[..., half:] << 4)).astype(jnp.uint8)


def unpack_nibbles(packed):
    """u8[..., D // 2] -> i32[..., D], pack_nibbles' inverse."""
    b = packed.astype(jnp.int32)
    return jnp.concatenate([b & 15, b >> 4], axis=-1)


def matrix(config, head_dim):
    return rotation.kv_rotation(head_dim, config.rotation, signed=False)


def init(config, n, h, d, s):
    matrix(config, d)  # ValueError now for a rotation block that does not divide head_dim
    if d % 2:
        raise ValueError(f"kv_format='int4' packs two codes per byte: head_dim must be even, got {d}")
    ps, meta = config.page_size, config.meta_dtype
    z = jnp.zeros
    return Int4Pages(
        k_codes=z((n, h, ps, d // 2), jnp.uint8), k_scale=z((n, h, ps), meta), k_min=z((n, h, ps), meta),
        v_codes=z((n, h, ps, d // 2), jnp.uint8), v_scale=z((n, h, ps), meta), v_min=z((n, h, ps), meta),
        config=config)


def _encode(layer, x):
    """x float[..., D] -> packed u8[..., D // 2], scale f16[...], min f16[...] of x M per row."""
    m = matrix(layer.config, x.shape[-1])
    q = quantize(rotation.apply(x, m), bits=4, axis=-1, partition_size=x.shape[-1])
    scale = q.scale[..., 0]
    folded = q.minimum[..., 0].astype(jnp.float32) + CENTER * scale.astype(jnp.float32)
    return {"_codes": pack_nibbles(q.codes), "_scale": scale, "_min": folded.astype(q.minimum.dtype)}


write_prefill, append = per_token_writers(_encode)


def dequantize(layer, page_indices, kv_lens):
    """(k M, v M, steps) as stored: the rotated basis."""
    ids = safe_ids(page_indices, layer.num_pages)
    f = lambda a: flat_tokens(a, ids)
    codes = lambda a: unpack_nibbles(a[ids]).swapaxes(2, 3).reshape(ids.shape[0], -1, a.shape[1], 2 * a.shape[3])
    ks, vs = f(layer.k_scale)[..., None], f(layer.v_scale)[..., None]
    k = (codes(layer.k_codes) - CENTER) * ks + f(layer.k_min)[..., None]
    v = (codes(layer.v_codes) - CENTER) * vs + f(layer.v_min)[..., None]
    return k, v, jnp.broadcast_to(ks, k.shape), jnp.broadcast_to(vs, v.shape)


OPS = FormatOps(pages=Int4Pages, blocked=False, init=init, write_prefill=write_prefill,
                append=append, dequantize=dequantize, rotation=matrix)
