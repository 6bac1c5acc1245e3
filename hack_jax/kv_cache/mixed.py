"""A cache whose layers use different formats (hack_jax.layer_formats.LayerFormats).

Two forms, as for one format (KVCache.layers):
- a tuple of one LayerCache per layer, each with its own config (init_cache(stacked=False)): the
  unrolled model's per-layer loop reads it unchanged;
- `LayerGroups`: one stacked LayerCache per distinct format (leading axis: that format's layers, in
  model order) plus the static `layer_map`, layer i -> (group g, index j in group g). The unrolled
  model hands layer i to its backend as kv_cache.stacked.StackedLayer(groups[g], j); the layer scan
  runs one scan per run of consecutive layers of one group (`runs`). Either way the kernels and
  writers see exactly the arrays of a one-format stacked cache, so a layer's bytes are those it would
  have in a cache of its format alone (tests/test_layer_formats.py).

init_cache(group_layers=n) cuts each format's layers into groups of at most n consecutive ones, one
format then owning several groups; for one format too, when its stack would be a pool the kernels
cannot address whole (models.llama.cache_layout).

A one-format stacked cache is the LayerGroups of one group with layer_map ((0, 0), (0, 1), ...):
`groups_of` / `with_groups` let one code path (models/llama.py, models/stepper.py) serve both.
All page arrays of all groups share one page table and num_pages (the page_size is common).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from hack_jax.kv_cache.common import STATIC, array_fields, pytree_dataclass
from hack_jax.kv_cache.stacked import is_paged
from hack_jax.layer_formats import LayerFormats


@pytree_dataclass
class LayerGroups:
    """groups: stacked LayerCaches (arrays [L_g, ...]), one per distinct format or per run of at most
    group_layers layers of one (module docstring); layer_map (static):
    ((g, j), ...) per model layer, layer i is index j of groups[g]."""
    groups: tuple
    layer_map: tuple = dataclasses.field(metadata=STATIC)

    @property
    def num_layers(self) -> int:
        return len(self.layer_map)


def group_map(configs, max_layers: int | None = None) -> tuple[tuple, tuple[tuple[int, int], ...]]:
    """Per-layer configs -> (each group's config, layer_map). One group per distinct config, in
    first-appearance order; with max_layers, each config's layers cut into consecutive groups of at
    most max_layers (a config may then own several groups)."""
    keys, seen = [], {}
    for c in configs:
        rank = seen[c] = seen.get(c, -1) + 1
        keys.append((c, 0 if max_layers is None else rank // max_layers))
    distinct = tuple(dict.fromkeys(keys))
    count = [0] * len(distinct)
    layer_map = []
    for key in keys:
        g = distinct.index(key)
        layer_map.append((g, count[g]))
        count[g] += 1
    return tuple(c for c, _ in distinct), tuple(layer_map)


def groups_of(layers) -> tuple[list, tuple[tuple[int, int], ...]]:
    """A stacked KVCache.layers (one stacked LayerCache, or LayerGroups) -> (list of stacked
    LayerCaches, layer_map)."""
    if isinstance(layers, LayerGroups):
        return list(layers.groups), layers.layer_map
    return [layers], tuple((0, j) for j in range(num_stacked(layers)))


def num_stacked(group) -> int:
    """Layers of a stacked LayerCache (its leading axis)."""
    return jax.tree.leaves(group)[0].shape[0]


def with_groups(layers, groups):
    """`layers` (as groups_of took it apart) rebuilt from the written groups."""
    if isinstance(layers, LayerGroups):
        return dataclasses.replace(layers, groups=tuple(groups))
    (only,) = groups
    return only


def map_groups(fn: Callable, layers, *more):
    """fn applied to each stacked LayerCache of a stacked KVCache.layers (and of `more`, alike)."""
    groups = [groups_of(x)[0] for x in (layers, *more)]
    return with_groups(layers, [fn(*gs) for gs in zip(*groups)])


def runs(layer_map) -> list[tuple[int, int, int, int]]:
    """Maximal runs of consecutive layers in one group: [(group, first layer, stop, first index)]."""
    out: list[list[int]] = []
    for i, (g, j) in enumerate(layer_map):
        if out and out[-1][0] == g and out[-1][2] == i and out[-1][3] + (i - out[-1][1]) == j:
            out[-1][2] = i + 1
        else:
            out.append([g, i, i + 1, j])
    return [tuple(r) for r in out]


def layer_list(layers) -> list:
    """KVCache.layers as one LayerCache per model layer, in order (slices of stacked arrays)."""
    if isinstance(layers, tuple):
        return list(layers)
    groups, layer_map = groups_of(layers)
    return [jax.tree.map(lambda a, j=j: a[j], groups[g]) for g, j in layer_map]


def _nbytes(a) -> int:
    return math.prod(a.shape) * jnp.dtype(a.dtype).itemsize


def array_bits(cache) -> dict:
    """Bits per K/V element of a KVCache, read from its own arrays (every layer, every format):
      total_bytes         all arrays of all layers (pages incl. the null page, open blocks, sinks,
                          KIVI-2 residuals), the page table and lengths not counted;
      bits_per_element    8 * total_bytes / (K and V elements of every slot filled to capacity);
      page_bits_per_element  8 * bytes of the page arrays / (K and V elements those pages hold):
                          the long-sequence rate;
      per_layer           each layer's (kv_format, page_bits_per_element).
    Works on a tuple of layers, a stacked LayerCache or LayerGroups (arrays or ShapeDtypeStructs)."""
    total = paged = paged_elems = elems = 0
    per_layer = []
    for layer in jax.eval_shape(layer_list, cache.layers):
        layer_paged = 0
        for name in array_fields(layer):
            a = getattr(layer, name)
            total += _nbytes(a)
            if is_paged(name):
                layer_paged += _nbytes(a)
        heads, dim = layer.num_kv_heads, layer.head_dim
        ps, num_pages = layer.config.page_size, layer.num_pages
        held = 2 * heads * dim * num_pages * ps
        sinks = layer.sink_k.shape[2] if hasattr(layer, "sink_k") else 0  # [S, H, ns, D]
        capacity = sinks + cache.pages_per_seq * ps
        elems += 2 * heads * dim * cache.max_seqs * capacity
        paged += layer_paged
        paged_elems += held
        per_layer.append((layer.config.kv_format, 8 * layer_paged / held))
    return dict(total_bytes=total, bits_per_element=8 * total / elems,
                page_bits_per_element=8 * paged / paged_elems, per_layer=tuple(per_layer))


def formats_of(config: Any) -> tuple:
    """The distinct QuantConfigs a model-wide cache config (QuantConfig or LayerFormats) uses."""
    return config.distinct if isinstance(config, LayerFormats) else (config,)
