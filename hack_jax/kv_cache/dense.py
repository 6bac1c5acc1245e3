"""kv_format="bf16" | "float32": unquantized K/V pages, token t in page column t // page_size."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from hack_jax.config import QuantConfig
from hack_jax.kv_cache.common import (ALL, STATIC, FormatOps, Pages, flat_tokens, page_ids, put,
                                      pytree_dataclass, safe_ids, token_targets)


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


def write_prefill(layer, k, v, lengths, page_indices, start, key):
    pages, rows = token_targets(layer, lengths, page_indices, k.shape[1], start)
    return dataclasses.replace(layer, k=put(layer.k, (pages, ALL, rows), k),
                               v=put(layer.v, (pages, ALL, rows), v))


def append(layer, k, v, kv_lens, active, page_indices, key, seal):
    ps = layer.config.page_size
    pages = page_ids(page_indices, kv_lens // ps, active, layer.num_pages)  # [S]
    index = (pages, ALL, kv_lens % ps)
    return dataclasses.replace(layer, k=put(layer.k, index, k), v=put(layer.v, index, v))


def dequantize(layer, page_indices, kv_lens):
    ids = safe_ids(page_indices, layer.num_pages)
    k, v = flat_tokens(layer.k, ids), flat_tokens(layer.v, ids)
    return k, v, jnp.zeros_like(k), jnp.zeros_like(v)


OPS = FormatOps(pages=DensePages, blocked=False, init=init, write_prefill=write_prefill,
                append=append, dequantize=dequantize)
