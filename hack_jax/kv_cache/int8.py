"""kv_format="int8": per (token, kv head) asymmetric 8-bit K/V over head_dim (HACK.md §8), token t
in page column t // page_size, always round-to-nearest."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from hack_jax.config import QuantConfig
from hack_jax.kv_cache.common import (STATIC, FormatOps, Pages, flat_tokens, per_token_writers,
                                      pytree_dataclass, safe_ids)
from hack_jax.quantization import quantize


@pytree_dataclass
class Int8Pages(Pages):
    """x ~ scale * code + min per (token, kv head):
      k_codes, v_codes  i8[num_pages, num_kv_heads, page_size, head_dim]  (q - 128)
      k_scale, k_min, v_scale, v_min  f16[num_pages, num_kv_heads, page_size]  (min folded, §2)
    """

    k_codes: jax.Array
    k_scale: jax.Array
    k_min: jax.Array
    v_codes: jax.Array
    v_scale: jax.Array
    v_min: jax.Array
    config: QuantConfig = dataclasses.field(metadata=STATIC)


def init(config, n, h, d, s):
    ps, meta = config.page_size, config.meta_dtype
    z = jnp.zeros
    return Int8Pages(
        k_codes=z((n, h, ps, d), jnp.int8), k_scale=z((n, h, ps), meta), k_min=z((n, h, ps), meta),
        v_codes=z((n, h, ps, d), jnp.int8), v_scale=z((n, h, ps), meta), v_min=z((n, h, ps), meta),
        config=config)


def _encode(layer, x):
    """x float[..., head_dim] -> codes i8[..., D], scale f16[...], min f16[...] per token."""
    q = quantize(x, bits=8, axis=-1, partition_size=x.shape[-1])
    return {"_codes": q.codes, "_scale": q.scale[..., 0], "_min": q.minimum[..., 0]}


write_prefill, append = per_token_writers(_encode)


def dequantize(layer, page_indices, kv_lens):
    ids = safe_ids(page_indices, layer.num_pages)
    f = lambda a: flat_tokens(a, ids)
    ks, vs = f(layer.k_scale)[..., None], f(layer.v_scale)[..., None]
    k = f(layer.k_codes) * ks + f(layer.k_min)[..., None]
    v = f(layer.v_codes) * vs + f(layer.v_min)[..., None]
    return k, v, jnp.broadcast_to(ks, k.shape), jnp.broadcast_to(vs, v.shape)


OPS = FormatOps(pages=Int8Pages, blocked=False, init=init, write_prefill=write_prefill,
                append=append, dequantize=dequantize)
