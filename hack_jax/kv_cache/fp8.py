"""kv_format="fp8": float8 e4m3 K/V with one float32 scale per (token, kv head), vLLM's `fp8` style.

Token t lives in page column t // page_size, row t % page_size (no sinks, no open block). Per
(token, kv head): scale = amax(|x|) / 448 over head_dim (448 = the largest finite e4m3fn value;
scale 1 for an all-zero row), codes = float8_e4m3fn(x / scale) (round to nearest even, no
saturation needed: |x / scale| <= 448). x_hat = float32(code) * scale. Always round-to-nearest.
Bits per element: 8 + 32 / head_dim (the scale), 8.5 at head_dim 64.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from hack_jax.config import QuantConfig
from hack_jax.kv_cache.common import (STATIC, FormatOps, Pages, flat_tokens, per_token_writers,
                                      pytree_dataclass, safe_ids)

CODE_DTYPE = jnp.float8_e4m3fn
SCALE_DTYPE = jnp.float32
FP8_MAX = 448.0  # float(jnp.finfo(jnp.float8_e4m3fn).max)


@pytree_dataclass
class Fp8Pages(Pages):
    """x ~ float32(code) * scale per (token, kv head):
      k_codes, v_codes  float8_e4m3fn[num_pages, num_kv_heads, page_size, head_dim]
      k_scale, v_scale  f32[num_pages, num_kv_heads, page_size]
    """

    k_codes: jax.Array
    k_scale: jax.Array
    v_codes: jax.Array
    v_scale: jax.Array
    config: QuantConfig = dataclasses.field(metadata=STATIC)


def init(config, n, h, d, s):
    ps = config.page_size
    z = jnp.zeros
    return Fp8Pages(k_codes=z((n, h, ps, d), CODE_DTYPE), k_scale=z((n, h, ps), SCALE_DTYPE),
                    v_codes=z((n, h, ps, d), CODE_DTYPE), v_scale=z((n, h, ps), SCALE_DTYPE),
                    config=config)


def quantize_fp8(x):
    """x float[..., head_dim] -> (codes float8_e4m3fn[..., D], scale f32[...]) per row."""
    x = jnp.asarray(x, jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(SCALE_DTYPE)
    codes = jnp.clip(x / scale[..., None], -FP8_MAX, FP8_MAX).astype(CODE_DTYPE)
    return codes, scale


def _encode(layer, x):
    codes, scale = quantize_fp8(x)
    return {"_codes": codes, "_scale": scale}


write_prefill, append = per_token_writers(_encode)


def dequantize(layer, page_indices, kv_lens):
    ids = safe_ids(page_indices, layer.num_pages)
    f = lambda a: flat_tokens(a, ids)
    ks, vs = f(layer.k_scale)[..., None], f(layer.v_scale)[..., None]
    k, v = f(layer.k_codes) * ks, f(layer.v_codes) * vs
    # step: the e4m3 spacing at each value (3 mantissa bits: 2**(floor(log2|x|) - 3), subnormals 2**-9)
    step = lambda c, s: s * jnp.exp2(jnp.floor(jnp.log2(jnp.maximum(jnp.abs(c), 2.0 ** -6))) - 3)
    return k, v, step(f(layer.k_codes), ks), step(f(layer.v_codes), vs)


OPS = FormatOps(pages=Fp8Pages, blocked=False, init=init, write_prefill=write_prefill,
                append=append, dequantize=dequantize)
