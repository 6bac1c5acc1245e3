"""kv_format="turbo3" | "turbo4": TurboQuant style (arXiv 2504.19874, its MSE quantizer) K/V, token t
in page column t // page_size.

Each K and V row x (one token, one kv head, head_dim D) is multiplied by M = diag(s) H (H the
block-diagonal normalized Hadamard of QuantConfig.rotation, s fixed random signs:
hack_jax.rotation.kv_rotation), which makes its coordinates close to i.i.d. with the density of one
coordinate of a random unit vector times |x|. Stored per row: scale = |x| / sqrt(D) (the RMS, f16:
never above max |x|, so inside f16 wherever x is) and per coordinate the index of the nearest
centroid of `codebook(bits, D)`: the Lloyd-Max quantizer of z = sqrt(D) y, y one coordinate of a
uniform unit vector in R^D (density ~ (1 - z^2 / D)^((D - 3) / 2), close to N(0, 1)), computed once
in NumPy. x M ~ scale * codebook[code]; attention rotates q by M and the output by M^T
(hack_jax.attention). An all-zero row stores scale 0. The QJL 1-bit residual of TurboQuant_prod is
not implemented (the MSE quantizer's inner products are slightly biased toward 0).

Codes are 4-bit slots packed two per byte, half-planar like int4 (hack_jax.kv_cache.int4.pack_nibbles),
for both bit widths: "turbo3" uses 8 of the 16 slot values, so it stores 4 + 16 / D bits per element
(4.25 at head_dim 64), not 3 + 16 / D; only its accuracy is 3-bit. "turbo4": 4 + 16 / D.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from hack_jax import rotation
from hack_jax.config import QuantConfig
from hack_jax.kv_cache.common import (STATIC, FormatOps, Pages, flat_tokens, per_token_writers,
                                      pytree_dataclass, safe_ids)
from hack_jax.kv_cache.int4 import pack_nibbles, unpack_nibbles

BITS = {"turbo3": 3, "turbo4": 4}


@functools.lru_cache(maxsize=None)
def codebook(bits: int, head_dim: int, iterations: int = 300) -> np.ndarray:
    """Lloyd-Max centroids f32[2**bits], ascending and symmetric, of z = sqrt(D) y, y a coordinate of
    a uniform random unit vector in R^D (D = head_dim >= 3): on a grid of z, alternately cells = the
    midpoints between centroids and centroids = the cells' conditional means, from equal-mass cells."""
    if bits not in (3, 4) or head_dim < 3:
        raise ValueError(f"codebook needs bits 3 or 4 and head_dim >= 3, got {bits=} {head_dim=}")
    d, n = head_dim, 2**bits
    z = np.linspace(-min(np.sqrt(d), 12.0), min(np.sqrt(d), 12.0), 400_001)
    w = np.clip(1 - z * z / d, 0, None) ** ((d - 3) / 2)
    cw, czw = np.cumsum(w), np.cumsum(w * z)
    cdf = cw / cw[-1]
    c = np.interp((np.arange(n) + 0.5) / n, cdf, z)
    for _ in range(iterations):
        edges = np.searchsorted(z, (c[1:] + c[:-1]) / 2)
        lo, hi = np.concatenate([[0], edges]), np.concatenate([edges, [len(z)]]) - 1
        mass = cw[hi] - np.where(lo > 0, cw[lo - 1], 0)
        c = (czw[hi] - np.where(lo > 0, czw[lo - 1], 0)) / mass
    c = (c - c[::-1]) / 2  # exactly symmetric
    return c.astype(np.float32)


@pytree_dataclass
class TurboPages(Pages):
    """x M ~ scale * codebook[code] per (token, kv head), M = hack_jax.rotation.kv_rotation(signed):
      k_codes, v_codes  u8[num_pages, num_kv_heads, page_size, head_dim // 2]  (int4.pack_nibbles)
      k_scale, v_scale  f16[num_pages, num_kv_heads, page_size]  (|x| / sqrt(head_dim))
    """

    k_codes: jax.Array
    k_scale: jax.Array
    v_codes: jax.Array
    v_scale: jax.Array
    config: QuantConfig = dataclasses.field(metadata=STATIC)

    @property
    def head_dim(self) -> int:
        return 2 * self.k_codes.shape[-1]

    @property
    def codebook(self) -> np.ndarray:
        return codebook(BITS[self.config.kv_format], self.head_dim)


def matrix(config, head_dim):
    return rotation.kv_rotation(head_dim, config.rotation, signed=True)


def init(config, n, h, d, s):
    matrix(config, d)  # ValueError now for a rotation block that does not divide head_dim
    if d % 2 or d < 4:
        raise ValueError(f"kv_format={config.kv_format!r} packs two codes per byte: head_dim must be even "
                         f"and >= 4, got {d}")
    ps, meta = config.page_size, config.meta_dtype
    z = jnp.zeros
    return TurboPages(k_codes=z((n, h, ps, d // 2), jnp.uint8), k_scale=z((n, h, ps), meta),
                      v_codes=z((n, h, ps, d // 2), jnp.uint8), v_scale=z((n, h, ps), meta), config=config)


def quantize_rows(x, m, centroids, meta_dtype):
    """x float[..., D] -> (packed u8[..., D // 2], scale meta_dtype[...]) of x m (module docstring)."""
    y = rotation.apply(x, m)
    d = y.shape[-1]
    fmax = float(jnp.finfo(meta_dtype).max)
    rms = jnp.minimum(jnp.sqrt(jnp.sum(y * y, axis=-1) / d), fmax)  # [...]
    z = y / jnp.where(rms > 0, rms, 1.0)[..., None]
    c = jnp.asarray(centroids)
    codes = jnp.searchsorted((c[1:] + c[:-1]) / 2, z)  # the nearest centroid (ties: the lower one)
    return pack_nibbles(codes.astype(jnp.uint8)), rms.astype(meta_dtype)


def _encode(layer, x):
    codes, scale = quantize_rows(x, matrix(layer.config, x.shape[-1]), layer.codebook, layer.config.meta_dtype)
    return {"_codes": codes, "_scale": scale}


write_prefill, append = per_token_writers(_encode)


def dequantize(layer, page_indices, kv_lens):
    """(k M, v M, steps) as stored (the rotated basis). step: scale times the gap between the code's
    neighbouring centroids (the cell width of inner cells; an error scale, not a bound: the two outer
    cells are unbounded)."""
    ids = safe_ids(page_indices, layer.num_pages)
    c = np.asarray(layer.codebook, np.float64)
    gap = np.diff(np.concatenate([[2 * c[0] - c[1]], c, [2 * c[-1] - c[-2]]]))
    width = jnp.asarray(((gap[:-1] + gap[1:]) / 2).astype(np.float32))
    codes = lambda a: unpack_nibbles(a[ids]).swapaxes(2, 3).reshape(ids.shape[0], -1, a.shape[1], 2 * a.shape[3])
    kc, vc = codes(layer.k_codes), codes(layer.v_codes)
    ks, vs = flat_tokens(layer.k_scale, ids)[..., None], flat_tokens(layer.v_scale, ids)[..., None]
    table = jnp.asarray(layer.codebook)
    return table[kc] * ks, table[vc] * vs, width[kc] * ks, width[vc] * vs


OPS = FormatOps(pages=TurboPages, blocked=False, init=init, write_prefill=write_prefill,
                append=append, dequantize=dequantize, rotation=matrix)
