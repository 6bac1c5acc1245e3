"""kv_format="bf16" | "float32": unquantized K/V pages, token t in page column t // page_size."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from hack_jax.config import QuantConfig
from hack_jax.kv_cache.common import (STATIC, FormatOps, Pages, flat_tokens, per_token_writers,
                                      pytree_dataclass, safe_ids)


@pytree_dataclass
class DensePages(Pages):
    """k, v dtype[num_pages, num_kv_heads, page_size, head_dim], dtype bf16 or float32."""

    k: jax.Array
    v: jax.Array
    config: QuantConfig = dataclasses.field(metadata=STATIC)


def init(config, n, h, d, s):
    dt = jnp.bfloat16 if config.kv_format == "bf16" else jnp.float32
    ps = config.page_size
    return DensePages(k=jnp.zeros((n, h, ps, d), dt), v=jnp.zeros((n, h, ps, d), dt), config=config)


write_prefill, append = per_token_writers(lambda layer, x: {"": x})


def gather(layer, page_indices, kv_lens):
    """(k, v) [S, pps * page_size, H, D] in the pages' own dtype, 0 at positions >= kv_lens."""
    ids = safe_ids(page_indices, layer.num_pages)
    k, v = (flat_tokens(x, ids, x.dtype) for x in (layer.k, layer.v))
    valid = (jnp.arange(k.shape[1])[None, :] < jnp.asarray(kv_lens)[:, None])[:, :, None, None]
    return jnp.where(valid, k, 0), jnp.where(valid, v, 0)


def dequantize(layer, page_indices, kv_lens):
    k, v = (x.astype(jnp.float32) for x in gather(layer, page_indices, kv_lens))
    return k, v, jnp.zeros_like(k), jnp.zeros_like(v)


OPS = FormatOps(pages=DensePages, blocked=False, init=init, write_prefill=write_prefill,
                append=append, dequantize=dequantize)
