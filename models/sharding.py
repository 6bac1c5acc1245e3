"""Tensor parallelism over KV heads: a 1-D device mesh, the parameter / cache shardings, and the
attention backend that runs every layer's cache write + attention per shard.

Megatron-style, with jit + NamedShardings (XLA partitions the einsums) and shard_map around the
attention backend (Pallas custom calls are not auto-partitioned):
  q / k / v projections and their biases  sharded on the head axis (columns);
  o_proj                                  sharded on its q-head input axis (rows) -> one all-reduce;
  MLP gate / up                           sharded on hidden_dim (columns);
  MLP down                                sharded on hidden_dim (rows)            -> one all-reduce;
  lm_head                                 sharded on the vocabulary when it divides, else replicated;
  embed, norms                            replicated.
Shard i holds kv heads [i K/tp, (i + 1) K/tp) and the q heads that read them (GQA groups are
contiguous: q head n reads kv head n // (N / K)), so the attention kernels run unchanged on their
local heads and no K/V crosses devices. The cache is sharded the same way: every LayerCache array
has its kv-head axis at 1 (axis 2 when the layers are stacked), page table and lengths replicated.

Numerics: the shards compute the q / k / v rows of their heads exactly as one device does; the two
all-reduces sum partial products in another order (float reassociation), and nothing else differs.
With rounding="stochastic" each shard folds its index into the step key, so its rounding noise
differs from a one-device run (nearest rounding is the same on every shard).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXIS = "tp"

# Parameter name (the attribute holding it in models/llama.py) -> its sharded axis, counted from
# the end so a stacked leading num_layers axis (scan_layers) changes nothing.
_PARAM_AXIS = {"q": -2, "k": -2, "v": -2, "q_bias": -2, "k_bias": -2, "v_bias": -2, "o": -3,
               "gate": -1, "up": -1, "down": -2, "lm_head": -1}


def make_mesh(tp: int, devices: Sequence[Any] | None = None) -> Mesh:
  """A 1-D mesh of the first tp devices (jax.devices() unless given), axis name "tp".

  Raises TypeError for a non-int tp, ValueError for tp < 1 or more than the devices there are."""
  if isinstance(tp, bool) or not isinstance(tp, int):
    raise TypeError(f"tp must be an int, got {tp!r}")
  devices = list(jax.devices() if devices is None else devices)
  if tp < 1 or tp > len(devices):
    raise ValueError(f"tp={tp} must be in [1, {len(devices)}] (the devices there are: "
                     f"{devices[0].platform} x {len(devices)})")
  return Mesh(devices[:tp], (AXIS,))


def tp_size(mesh: Mesh | None) -> int:
  return 1 if mesh is None else mesh.shape[AXIS]


def check_config(config: Any, mesh: Mesh) -> None:
  """ValueError unless the model's kv heads and MLP width divide over the mesh (q heads then do:
  num_q_heads is a multiple of num_kv_heads)."""
  if AXIS not in mesh.shape or len(mesh.shape) != 1:
    raise ValueError(f"the mesh must have the one axis {AXIS!r}, got {dict(mesh.shape)}")
  tp = mesh.shape[AXIS]
  if config.num_kv_heads % tp:
    raise ValueError(f"num_kv_heads={config.num_kv_heads} is not divisible by tp={tp}: tensor "
                     f"parallelism shards whole kv heads")
  if config.hidden_dim % tp:
    raise ValueError(f"hidden_dim={config.hidden_dim} is not divisible by tp={tp}")


def _spec(ndim: int, axis: int | None) -> P:
  names = [None] * ndim
  if axis is not None:
    names[axis] = AXIS
  return P(*names)


def param_shardings(state: Any, mesh: Mesh, config: Any) -> Any:
  """NamedShardings for a Llama's nnx.State (the module docstring's table), same tree."""
  tp = mesh.shape[AXIS]

  def one(path, x):
    names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    name = next((n for n in reversed(names) if isinstance(n, str) and n != "value"), None)
    axis = _PARAM_AXIS.get(name)
    if name == "lm_head" and config.vocab_size % tp:
      axis = None
    return NamedSharding(mesh, _spec(x.ndim, axis))

  return jax.tree_util.tree_map_with_path(one, state)


def _layer_axis(cache_layers: Any) -> int:
  return 1 if isinstance(cache_layers, tuple) else 2  # stacked: [num_layers, ...]


def cache_shardings(cache: Any, mesh: Mesh) -> Any:
  """NamedShardings for a kv_cache.KVCache: layer arrays on their kv-head axis, page table and
  lengths replicated. Raises ValueError when the cache's kv heads do not divide over the mesh."""
  axis = _layer_axis(cache.layers)
  heads = jax.tree.leaves(cache.layers)[0].shape[axis]
  if heads % mesh.shape[AXIS]:
    raise ValueError(f"the cache's num_kv_heads={heads} is not divisible by tp={mesh.shape[AXIS]}")
  layers = jax.tree.map(lambda a: NamedSharding(mesh, _spec(a.ndim, axis)), cache.layers)
  rep = NamedSharding(mesh, P())
  return dataclasses.replace(cache, layers=layers, page_indices=rep, kv_lens=rep)


def shard_cache(cache: Any, mesh: Mesh) -> Any:
  """The cache placed on the mesh (cache_shardings)."""
  return jax.device_put(cache, cache_shardings(cache, mesh))


@dataclasses.dataclass(frozen=True)
class ShardedBackend:
  """An attention backend run per shard: `inner` (a hack_jax.backend.Backend or any object with
  its prefill / decode methods) sees the local q heads [.., N / tp, H], k / v heads [.., K / tp, H]
  and the local LayerCache (its kv-head axis split), the Step replicated. Frozen and hashable (a
  jit static). The output keeps the q-head axis sharded; o_proj's contraction over it is the
  all-reduce."""
  inner: Any
  mesh: Mesh

  def prefill(self, q, k, v, layer, step, *, layer_index):
    """As Backend.prefill: q [S, T, N, H], k / v [S, T, K, H]."""
    return self._call("prefill", 2, q, k, v, layer, step, layer_index)

  def decode(self, q, k, v, layer, step, *, layer_index):
    """As Backend.decode: q [S, N, H], k / v [S, K, H]."""
    return self._call("decode", 1, q, k, v, layer, step, layer_index)

  @property
  def defers_seal(self) -> bool:
    """The inner backend's (Backend.defers_seal): decode steps may seal after the last layer."""
    return bool(getattr(self.inner, "defers_seal", False))

  def finish(self, cache, step):
    """As Backend.finish, per shard: every layer's filled open regions sealed on each device's kv heads
    (axis 1 of a layer's arrays, 2 of a stacked cache's), with the per-shard key the decode used."""
    if step.mode != "decode" or step.seal != "after":
      return cache
    spec = jax.tree.map(lambda a: _spec(a.ndim, 2 if cache.stacked else 1), cache.layers)
    configs = getattr(cache.config, "distinct", (cache.config,))  # per-layer formats: each distinct one
    stochastic = any(getattr(c, "rounding", "nearest") == "stochastic" for c in configs)

    def body(layers, page_indices, kv_lens, step):
      if stochastic:  # the key each shard's append would have rounded with (_call)
        step = dataclasses.replace(step, key=jax.random.fold_in(step.key, jax.lax.axis_index(AXIS)))
      local = dataclasses.replace(cache, layers=layers, page_indices=page_indices, kv_lens=kv_lens)
      return self.inner.finish(local, step).layers

    fn = jax.shard_map(body, mesh=self.mesh, in_specs=(spec, P(), P(), P()), out_specs=spec, check_vma=False)
    return dataclasses.replace(cache, layers=fn(cache.layers, cache.page_indices, cache.kv_lens, step))

  def _call(self, method, head_axis, q, k, v, layer, step, layer_index):
    heads = _spec(q.ndim, head_axis)
    layer_spec = jax.tree.map(lambda a: _spec(a.ndim, 1), layer)
    stochastic = getattr(layer.config, "rounding", "nearest") == "stochastic"

    def body(q, k, v, layer, step, layer_index):
      if stochastic:  # independent rounding noise per shard
        step = dataclasses.replace(step, key=jax.random.fold_in(step.key, jax.lax.axis_index(AXIS)))
      return getattr(self.inner, method)(q, k, v, layer, step, layer_index=layer_index)

    fn = jax.shard_map(body, mesh=self.mesh, in_specs=(heads, heads, heads, layer_spec, P(), P()),
                       out_specs=(layer_spec, heads), check_vma=False)
    return fn(q, k, v, layer, step, jnp.asarray(layer_index, jnp.int32))


def shard_model(model: Any, mesh: Mesh) -> Any:
  """A Llama with its weights placed sharded over `mesh` (param_shardings) and its
  config.attention wrapped in a ShardedBackend, so that model.run attends per shard; the
  Generator and the Engine find the mesh there (mesh_of). Raises ValueError as check_config."""
  from flax import nnx
  check_config(model.config, mesh)
  graphdef, state = nnx.split(model)
  model = nnx.merge(graphdef, jax.device_put(state, param_shardings(state, mesh, model.config)))
  attention = model.config.attention
  if not isinstance(attention, ShardedBackend):
    model.config = dataclasses.replace(model.config, attention=ShardedBackend(attention, mesh))
  return model


def mesh_of(model: Any) -> Mesh | None:
  """The mesh of a shard_model model (its config.attention's), else None."""
  attention = model.config.attention
  return attention.mesh if isinstance(attention, ShardedBackend) else None
