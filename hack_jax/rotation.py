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


SIGN_SEED = 20250425  # the fixed seed of the turbo formats' random signs (TurboQuant, arXiv 2504.19874)


@functools.lru_cache(maxsize=None)
def kv_rotation(head_dim: int, block: int, signed: bool) -> np.ndarray:
    """The orthogonal M f32[head_dim, head_dim] of the int4 / turbo caches (QuantConfig.rotation):
    M = diag(s) (I_(D/B) (x) H_B / sqrt(B)), s = +-1 drawn once from SIGN_SEED when signed, else 1;
    block 0 means B = head_dim. K and V rows are stored as x M, q is multiplied by M (q.k = qM.kM)
    and the attention output by M^T. ValueError when B is not a power of two dividing head_dim."""
    b = block or head_dim
    if b < 1 or b & (b - 1) or head_dim % b:
        what = f"rotation={block}" + (f" (= head_dim {head_dim})" if not block else "")
        raise ValueError(f"{what} must be a power of two dividing head_dim={head_dim}")
    m = np.kron(np.eye(head_dim // b), hadamard(b).astype(np.float64))
    if signed:
        m = np.random.default_rng(SIGN_SEED).choice([-1.0, 1.0], head_dim)[:, None] * m
    return m.astype(np.float32)


def apply(x, m):
    """x float[..., D] @ m f32[D, D] in float32 (full precision); m None returns x unchanged."""
    if m is None:
        return x
    return jnp.einsum("...i,ij->...j", jnp.asarray(x, jnp.float32), jnp.asarray(m),
                      precision=jax.lax.Precision.HIGHEST)
