"""The V rotation of QuantConfig.v_rotation: a block-diagonal normalized Hadamard matrix.

R = I_(D/B) (x) H_B / sqrt(B) (Sylvester's H_B, B a power of two) is orthonormal and symmetric, so
R^-1 = R^T = R: the same `rotate_v` rotates V before it is written (kv_cache.write_prefill /
append) and rotates the attention output back (hack_jax.attention), since the output is a convex
combination of V rows: sum_j w_j (v_j R) R = sum_j w_j v_j. Rotating spreads a token's outlier
channels over its block before the per-(token, channel group) 2-bit rounding; it stores no extra
byte. Every cache format applies it the same way (the 16-bit parts store rotated V too), so
a cache's V contents (kv_cache.dequantize_cache) are in the rotated basis.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


@functools.lru_cache(maxsize=None)
def hadamard(block: int) -> np.ndarray:
    """Normalized Sylvester Hadamard matrix f32[block, block] (block a power of two >= 1)."""
    if block < 1 or block & (block - 1):
        raise ValueError(f"a Hadamard block must be a power of two >= 1, got {block}")
    h = np.ones((1, 1))
    while h.shape[0] < block:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(block)).astype(np.float32)


def rotate_v(x, block: int):
    """x float[..., D] -> f32[..., D] times the block-diagonal Hadamard(block) R (its own inverse);
    block 0 returns x unchanged (its own dtype). Raises ValueError when D % block != 0."""
    if not block:
        return x
    d = x.shape[-1]
    if d % block:
        raise ValueError(f"v_rotation={block} must divide head_dim={d}")
    xb = jnp.asarray(x, jnp.float32).reshape(x.shape[:-1] + (d // block, block))
    out = jnp.einsum("...gi,ij->...gj", xb, jnp.asarray(hadamard(block)),
                     precision=jax.lax.Precision.HIGHEST)
    return out.reshape(x.shape)
