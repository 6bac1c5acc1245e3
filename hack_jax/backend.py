"""Backend: the attention a model runs over its cache, one object the model receives.

A model holds a `Backend` (frozen and hashable: a jit static) and calls its `prefill` / `decode`
once per layer with the layer's fresh q/k/v, its cache layer and the step record (hack_jax.step.Step,
unchanged). The backend writes the K/V into the cache and attends:
  prefill  hack_jax.prefill.prefill: the step's tokens attend to each other exactly on their 16-bit
           K/V (cuDNN / XLA / bf16 Pallas / jnp, `prefill_attention`), a chunk also to its cached
           prefix on the codes, and the cache is written once; or "homomorphic", the paper's numerics.
  decode   hack_jax.attention.decode_step: kv_cache.append then decode_attention, fused into one
           Pallas call on request (fuse=True); the HACK kernel with scale-folded
           f16 operands unless the options name dot_dtype / config.
  finish   once after the last layer: a decode step with Step.seal "after" (`defers_seal`) has every
           layer's filled open regions sealed at once (docs/DESIGN.md "Deferred sealing").
Evaluation variants and benchmark adapters are other objects with the same two methods
(models/eval.py, bench/bench_generate.py); nothing patches a module global.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from hack_jax import attention, kv_cache, prefill as hack_prefill
from hack_jax.kv_cache import mixed, stacked
from hack_jax.step import Step

# The HACK decode kernel's operands in a model (docs/DESIGN.md "Decode numerics"): scale-folded f16
# (Q*sigma and W*tau rounded to f16 against the exact codes) was faster than the paper's INT8
# requantization at batch 8 x 32K and at 128K tokens on the H200 and ~20x closer to the exact identity
# (bench/NOTES_decode.md, "H200 session 4"); the kernel-level default stays "int8", the paper's numerics.
DECODE_DOT_DTYPE = "folded_f16"
# Backend options that only the HACK decode kernels read: never passed to prefill. PALLAS_DECODE_ONLY are launch
# settings of the Pallas kernel (impl="pallas" only), not passed to the decode of other formats' layers either.
DECODE_ONLY = ("fuse", "interleaved", "denormal", "num_stages", "num_warps", "maxnreg")
PALLAS_DECODE_ONLY = ("interleaved", "denormal", "num_stages", "num_warps", "maxnreg")


def write(layer: kv_cache.LayerCache | stacked.StackedLayer, k, v, step: Step, *, layer_index):
    """Writes one step's fresh K/V into a layer without attending: kv_cache.write_prefill (step.mode
    "prefill" / "chunk": k, v float[max_seqs, T, num_kv_heads, head_dim], each active slot's new tokens
    after its step.start cached ones) or kv_cache.append ("decode": k, v float[max_seqs, num_kv_heads,
    head_dim], the token at kv_lens[s] - 1 of each active slot). Stochastic rounding uses
    fold_in(step.key, layer_index) (an int, or a traced i32 inside a scan over layers). A
    kv_cache.stacked.StackedLayer is taken out, written and put back (returns a StackedLayer)."""
    if isinstance(layer, stacked.StackedLayer):
        one, table = stacked.take(layer, step.page_indices)
        return stacked.give(layer, write(one, k, v, dataclasses.replace(step, page_indices=table),
                                         layer_index=layer_index))
    key = jax.random.fold_in(step.key, layer_index)
    if step.mode in ("prefill", "chunk"):
        return kv_cache.write_prefill(layer, k, v, lengths=step.write_lens, page_indices=step.page_indices,
                                      start=step.start if step.mode == "chunk" else None, key=key)
    return kv_cache.append(layer, k, v, kv_lens=step.kv_lens, active=step.active,
                           page_indices=step.page_indices, key=key, seal=step.seal, sinks=step.sinks)


@dataclasses.dataclass(frozen=True)
class Backend:
    """The attention a model runs over its cache (module docstring).

    Attributes:
      impl: hack_jax.attention's ("reference" | "pallas" | "pallas_dequant" | "triton" | "gluon").
      options: keyword options for the kernels as sorted (name, value) pairs (a dict is accepted and
        converted, so the backend stays hashable), e.g. {"interpret": True} to run them in Pallas
        interpret mode on the CPU; {"fuse": True}: the non-sealing decode steps through the fused append +
        attention kernel (attention.decode_step); {"interleaved": True}: the 2-bit HACK decode kernel's
        KernelConfig.interleaved (folded f16 planes without byte permutes); {"denormal": False / True}: its
        KernelConfig.denormal (the codes as f16 subnormals: the default, the fused kernel's at 2 bits only;
        False: the 1024 + 64c planes); {"num_stages": 3}: its loop's pipeline depth;
        {"num_warps": 8}: its warps per program; {"maxnreg": 0 / N}: its register cap (KernelConfig.maxnreg;
        0: none). These reach the decode of kivi layers only (DECODE_ONLY); interleaved, denormal,
        num_stages, num_warps and maxnreg need impl="pallas". Must be empty with
        impl="reference".
      prefill_attention: hack_jax.prefill's `attention` ("auto" | "cudnn" | "xla" | "pallas" |
        "reference": exact causal attention of the prompt on its 16-bit K/V; "homomorphic": the paper's
        numerics over the 2-bit cache, not causal within a block).
    Raises ValueError for an unknown impl / prefill_attention, options with impl="reference", or
    interleaved / denormal / num_stages / num_warps / maxnreg with an impl other than "pallas".
    """
    impl: attention.Impl = "reference"
    options: Any = ()
    prefill_attention: hack_prefill.PrefillAttention = "auto"
    # models.llama hands `prefill` / `decode` a kv_cache.stacked.StackedLayer (layer i of a stacked
    # cache, not sliced) only where the backend says it takes one
    takes_stacked_layers: ClassVar[bool] = True

    def __post_init__(self):
        options = self.options.items() if isinstance(self.options, dict) else self.options
        object.__setattr__(self, "options", tuple(sorted(options)))
        if self.impl not in attention.IMPLS:
            raise ValueError(f"impl must be one of {attention.IMPLS}, got {self.impl=}")
        if self.options and self.impl == "reference":
            raise ValueError(f"kernel options only apply to the kernel impls, got {self.options=} "
                             f"with impl='reference'")
        pallas_only = [name for name, _ in self.options if name in PALLAS_DECODE_ONLY]
        if pallas_only and self.impl != "pallas":
            raise ValueError(f"options {pallas_only} are the HACK Pallas decode kernel's: they need impl='pallas', "
                             f"got impl={self.impl!r}")
        if self.prefill_attention not in hack_prefill.PREFILL_ATTENTION:
            raise ValueError(f"prefill_attention must be one of {hack_prefill.PREFILL_ATTENTION}, "
                             f"got {self.prefill_attention=}")

    def prefill(self, q, k, v, layer, step: Step, *, layer_index):
        """q float[max_seqs, T, num_q_heads, head_dim], k, v float[max_seqs, T, num_kv_heads, head_dim]
        (the step's tokens, left-aligned) -> (new layer, f32[max_seqs, T, num_q_heads, head_dim]);
        rows at or past a slot's new tokens are 0. A StackedLayer is taken out and put back."""
        if isinstance(layer, stacked.StackedLayer):
            one, table = stacked.take(layer, step.page_indices)
            one, out = self.prefill(q, k, v, one, dataclasses.replace(step, page_indices=table),
                                    layer_index=layer_index)
            return stacked.give(layer, one), out
        return hack_prefill.prefill(
            q, k, v, layer, page_indices=step.page_indices, lengths=step.write_lens,
            q_start=step.start if step.mode == "chunk" else None,
            key=jax.random.fold_in(step.key, layer_index), attention=self.prefill_attention,
            impl=self.impl, **{name: value for name, value in self.options if name not in DECODE_ONLY})

    @property
    def defers_seal(self) -> bool:
        """Whether decode steps through this backend may seal after the last layer (Step.seal "after",
        then `finish`): the impls whose decode attends over a filled, unsealed open region (not the
        opt-in fused kernel)."""
        return self.impl in attention.AFTER_IMPLS and not dict(self.options).get("fuse")

    def finish(self, cache: kv_cache.KVCache, step: Step) -> kv_cache.KVCache:
        """The cache after a step's last layer. A decode step with seal="after": every layer's open regions
        that the step filled are sealed (kv_cache.seal_filled; formats without open regions are left as
        they are), a stacked cache's layers in one call per format vectorized over its layer axis (one
        compiled seal per stack, not one per layer; per-layer formats: each kv_cache.mixed.LayerGroups
        group); layer i rounds with fold_in(step.key, i), as its append(seal="always") would, so the
        bytes are the same. Other steps: the cache as it is."""
        if step.mode != "decode" or step.seal != "after":
            return cache

        def seal(layer, key):
            return kv_cache.seal_filled(layer, kv_lens=step.kv_lens, active=step.active,
                                        page_indices=step.page_indices, key=key)

        if not cache.stacked:
            layers = tuple(seal(layer, jax.random.fold_in(step.key, i)) for i, layer in enumerate(cache.layers))
            return dataclasses.replace(cache, layers=layers)
        groups, layer_map = mixed.groups_of(cache.layers)
        sealed = []
        for g, group in enumerate(groups):
            index = jnp.asarray([i for i, (h, _) in enumerate(layer_map) if h == g])  # its layers, in order
            keys = jax.vmap(lambda i: jax.random.fold_in(step.key, i))(index)
            sealed.append(jax.vmap(seal)(group, keys))
        return dataclasses.replace(cache, layers=mixed.with_groups(cache.layers, sealed))

    def decode(self, q, k, v, layer, step: Step, *, layer_index):
        """q float[max_seqs, num_q_heads, head_dim], k, v float[max_seqs, num_kv_heads, head_dim]
        -> (new layer, f32[max_seqs, num_q_heads, head_dim]); layer a LayerCache or a StackedLayer
        (attention.decode_step, with the Step's seal and sinks)."""
        options = dict(self.options)
        base = layer.stacked if isinstance(layer, stacked.StackedLayer) else layer
        if not isinstance(base, kv_cache.KiviPages):
            for name in PALLAS_DECODE_ONLY:
                options.pop(name, None)
        elif self.impl == "pallas" and not {"dot_dtype", "config"} & set(options):
            options["dot_dtype"] = DECODE_DOT_DTYPE
        if step.seal != "never":  # option fuse=True: the fused kernel serves the non-sealing steps only
            options.pop("fuse", None)
        # a format without open blocks stores the same bytes whatever the seal mode; "never" keeps the
        # in-place stacked path (a per-layer-format cache's bf16 layers in a seal="after" step)
        seal = step.seal if kv_cache.FORMATS[kv_cache.format_of(base.config)].blocked else "never"
        return attention.decode_step(q, k, v, layer, page_indices=step.page_indices, kv_lens=step.kv_lens,
                                     active=step.active, impl=self.impl, seal=seal, sinks=step.sinks,
                                     key=jax.random.fold_in(step.key, layer_index), **options)

