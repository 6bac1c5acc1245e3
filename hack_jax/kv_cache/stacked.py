"""A stacked cache seen one layer at a time without copying its pages (a model scanning its layers).

A stacked LayerCache (init_cache(stacked=True)) holds every array with a leading num_layers axis:
paged arrays [L, N, H, ...] (N = num_pages per layer) and per-sequence arrays (fields named open_*,
sink_*: open blocks, sinks) [L, S, H, ...]. Slicing layer i out of the paged arrays and writing it
back costs two copies of the layer's whole pool per layer per step (on the GPU, where a kernel's
operand must be its own buffer), so the scan works on the flat form instead:

  flat = flatten(stacked)            paged arrays reshaped to [L * N, H, ...] (free: contiguous):
                                     page p of layer i is flat page i * N + p; per-sequence arrays
                                     unchanged [L, S, ...]
  layer = layer_of(flat, i)          layer i as a LayerCache: the paged arrays WHOLE (L * N pages),
                                     the per-sequence arrays' slice i (small: S open blocks + sinks)
  table = layer_page_indices(page_indices, i, N)
                                     the page table mapped into layer i's pages: valid ids p in
                                     [1, N) -> i * N + p; the null page 0 and ids outside [0, N)
                                     -> 0 (layer 0's null page, which no write touches: the writers
                                     drop writes to page 0, and every read of it is masked)
  flat = put_layer(flat, layer, i)   the written layer back: paged arrays taken as they are (the
                                     writers scattered into the carry in place), per-sequence
                                     slice i updated
  stacked = unflatten(flat, L)

The writers (kv_cache.write_prefill / append) and the attention (hack_jax.attention, the Pallas
kernels) take `layer` and `table` like any layer and page table, so they read and scatter in place
into the flat arrays. Everything is exact: the same bytes are read and written as with the layer's
own arrays and the original table.

A non-sealing decode step does without the per-sequence slices and the mapped table: the unrolled
model hands its backend `StackedLayer(stacked, i)` (layer i, nothing sliced), and
hack_jax.attention.decode_step, where the format and impl allow it (`reads_in_place`), writes the new
token's rows into the stacked arrays with one scatter each (`append_in_place`) or inside the fused
kernel, and the kernel reads layer i through its `layer_index` operand (layer-local page ids). Every
other use takes the layer out in the flat form (`take`) and puts it back (`give`).

When the flat form does not pay (`use_flat` False: a caller keeps the per-layer slices, as
models/llama.py does):
- Pallas Triton lowering (jax 0.10 / 0.11): a kernel operand of at most 2**32 bytes is indexed with
  32-bit offsets, so a 1-byte array (u8 codes) of more than 2**31 and at most 2**32 bytes would be
  addressed past 2**31 with a 32-bit offset (a signed one in Triton's pointer arithmetic):
  `pallas_addressable`. models.llama.cache_layout cuts such a stack into groups of layers that are
  addressable (`addressable_depth`, kv_cache.mixed.LayerGroups), each group using the flat form.
- The CPU backend: there the slices are cheap (no kernel needs its own buffer) and the flat form was
  measured slower per step (bench/NOTES_generate.md, "Layer scan in place": hack 1.7x, bf16 2.5x,
  whose scatter XLA's CPU backend runs through an f32 copy of the WHOLE operand, every layer's
  pages; int8 on par). Tests force the flat form there to check it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from hack_jax import paging
from hack_jax.kv_cache import hack
from hack_jax.kv_cache.common import ALL, array_fields, page_ids, put
from hack_jax.kv_cache.dense import DensePages
from hack_jax.kv_cache.kivi import KiviPages

PER_SEQUENCE_PREFIXES = ("open", "sink")


def is_paged(name: str) -> bool:
    """Whether a LayerCache field has a leading num_pages axis (else: per sequence, [S, ...])."""
    return not name.startswith(PER_SEQUENCE_PREFIXES)


def _map(layer, paged, per_seq):
    return dataclasses.replace(layer, **{n: (paged if is_paged(n) else per_seq)(getattr(layer, n))
                                         for n in array_fields(layer)})


def pages_per_layer(stacked) -> int:
    """N of a stacked LayerCache (its paged arrays are [L, N, ...])."""
    return getattr(stacked, next(n for n in array_fields(stacked) if is_paged(n))).shape[1]


def flatten(stacked):
    """Stacked LayerCache -> flat form: paged arrays [L * N, ...], per-sequence arrays as they are."""
    return _map(stacked, lambda a: a.reshape((-1,) + a.shape[2:]), lambda a: a)


def unflatten(flat, num_layers: int):
    """Inverse of `flatten`."""
    return _map(flat, lambda a: a.reshape((num_layers, -1) + a.shape[1:]), lambda a: a)


def layer_of(flat, i):
    """Layer i (an int or a traced i32) of the flat form as a LayerCache over all L * N pages."""
    return _map(flat, lambda a: a, lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False))


def put_layer(flat, layer, i):
    """The flat form with layer i's written LayerCache (from `layer_of`, written) put back."""
    return dataclasses.replace(flat, **{
        n: (getattr(layer, n) if is_paged(n) else
            jax.lax.dynamic_update_index_in_dim(getattr(flat, n), getattr(layer, n), i, 0))
        for n in array_fields(flat)})


def layer_page_indices(page_indices, i, num_pages: int):
    """The page table i32[S, pages_per_seq] mapped into layer i's flat pages (module docstring)."""
    ids = jnp.asarray(page_indices, jnp.int32)
    ok = (ids > paging.NULL_PAGE) & (ids < num_pages)
    return jnp.where(ok, ids + jnp.asarray(i, jnp.int32) * num_pages, paging.NULL_PAGE)


def _addressable(stacked, depth: int = 1) -> bool:
    from pallas_kernels.common import misaddressed  # the kernels' own rule (their stacked_view refuses the rest)
    return not any(is_paged(n) and misaddressed(a.dtype, depth * a.size)
                   for n, a in ((n, getattr(stacked, n)) for n in array_fields(stacked)))


def pallas_addressable(stacked) -> bool:
    """False when some 1-byte paged array of `stacked` (a stacked LayerCache of arrays or
    ShapeDtypeStructs) holds more than 2**31 and at most 2**32 bytes (module docstring)."""
    return _addressable(stacked)


def addressable_depth(layer, num_layers: int) -> int | None:
    """The most layers n <= num_layers, among ceil(num_layers / g) for g = 1, 2, ..., that one
    layer's LayerCache `layer` (arrays or ShapeDtypeStructs) can be stacked n deep and stay
    `pallas_addressable`: num_layers when the whole stack is; None when not even one layer is.
    Groups of n consecutive layers (kv_cache.init_cache's group_layers) are then the fewest
    addressable ones of that form (a last, shorter group is too: the whole stack was <= 2**32 bytes)."""
    for g in range(1, num_layers + 1):
        n = -(-num_layers // g)
        if _addressable(layer, n):
            return n
    return None


def use_flat(stacked) -> bool:
    """Whether a layer scan should use the flat form for `stacked` (module docstring): off the CPU
    backend, where `pallas_addressable`."""
    return jax.default_backend() != "cpu" and pallas_addressable(stacked)


@dataclasses.dataclass(frozen=True)
class StackedLayer:
    """Layer `index` (an int, or a traced i32) of the stacked LayerCache `stacked` (every array with a
    leading num_layers axis), not sliced out (module docstring)."""
    stacked: Any
    index: Any

    @property
    def config(self):
        return self.stacked.config

    @property
    def num_layers(self) -> int:
        return getattr(self.stacked, array_fields(self.stacked)[0]).shape[0]

    def shapes(self):
        """One layer's LayerCache of jax.ShapeDtypeStructs (for checks and geometry)."""
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), self.stacked)


jax.tree_util.register_dataclass(StackedLayer, data_fields=["stacked", "index"], meta_fields=[])


def take(view: StackedLayer, page_indices):
    """(layer, table): view's layer in the flat form (`layer_of`) and page_indices mapped into its pages
    (`layer_page_indices`), for anything that takes a LayerCache and a page table."""
    flat = flatten(view.stacked)
    return (layer_of(flat, view.index),
            layer_page_indices(page_indices, view.index, pages_per_layer(view.stacked)))


def give(view: StackedLayer, layer) -> StackedLayer:
    """view with its layer replaced by `layer` (from `take`, written)."""
    flat = put_layer(flatten(view.stacked), layer, view.index)
    return StackedLayer(unflatten(flat, view.num_layers), view.index)


def reads_in_place(view: StackedLayer) -> bool:
    """Whether `append_in_place` and the kernels' layer_index serve view's format (kivi, bf16 / float32)."""
    return isinstance(view.stacked, (KiviPages, DensePages))


def append_in_place(view: StackedLayer, k, v, position, active, page_indices, sinks: bool = True) -> StackedLayer:
    """kv_cache.append(seal="never", sinks=sinks)'s writes (the same bytes) into layer view.index of the
    stacked arrays, one scatter per written array: kivi the token's sink (sinks=True only) / open-block
    rows, bf16 / float32 its page row (layer-local page ids, written only in [1, num_pages)). position
    i32[S] of the new token, active bool[S] (False where position < 0), k, v float[S, H, D] (v already
    rotated, as append does)."""
    stacked, i = view.stacked, view.index
    if isinstance(stacked, DensePages):
        ps = stacked.config.page_size
        pages = page_ids(page_indices, position // ps, active, stacked.k.shape[1])  # [S]; drop: num_pages
        index = (i, pages, ALL, position % ps)
        return StackedLayer(dataclasses.replace(stacked, k=put(stacked.k, index, k), v=put(stacked.v, index, v)), i)
    step = hack.AppendStep(view.shapes(), position, active, page_indices)
    return StackedLayer(dataclasses.replace(
        stacked, **step.sinks(stacked, k, v, layer_index=i, write=sinks), open_k=step.put_open(stacked.open_k, k, i),
        open_v=step.put_open(stacked.open_v, v, i)), i)
