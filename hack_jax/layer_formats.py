"""Per-layer cache formats: some layers of a model cached in another format than the rest.

What vLLM / SGLang / llama.cpp users ask for: the first and last few layers (the ones most sensitive
to KV quantization) kept in int8 or bf16 while every other layer uses HACK 2-bit, or any QuantConfig
per layer. `LayerFormats(base, rules)` says it without knowing the model's depth:

    LayerFormats(QuantConfig(), ((("first2", "last2"), QuantConfig(kv_format="int8")),))
    parse_layer_formats("0,-1:bf16;first2:int8", base)     # the CLI / eval spelling
    keep_layers("2:int8", base)                            # = first2,last2:int8

Layer selectors: an index i (negative counts from the end, as in Python), `firstN`, `lastN`. A rule's
format is a kv_format name ("int8", "bf16", "float32", "fp8", "kivi2", "hack"; the base config
itself when it names the base's kv_format), that name with QuantConfig fields changed
(`NAME:FIELD=VALUE[,/]...`, e.g. "18:hack:bits=4,partition_size=64": the base's hack cache with 4-bit
codes and 64-token blocks in layer 18), or, from Python, a QuantConfig. Every layer a rule does not
name uses `base`. `configs(num_layers)` resolves the rules to one QuantConfig per layer
(ValueError for an index beyond the model or a layer named by two rules).

Every format shares the base's page_size: all layers read one page table (hack_jax.paging), whose
allocator counts the fewest sinks of the formats (`kv_cache.sink_tokens`), so a format with sinks
gets the pages it needs and at most one more. hack_jax.kv_cache accepts a LayerFormats wherever
it takes a QuantConfig for a whole model (init_cache, sink_tokens, seals_block, bytes_per_token,
cache_bytes_report); the cache it builds is kv_cache.mixed's.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, get_args

from hack_jax.config import KVFormat, QuantConfig

_SELECTOR = re.compile(r"first\d+|last\d+|-?\d+")


def _count(selector: str) -> int:
    """N of 'firstN' / 'lastN'."""
    return int(selector[5:] if selector.startswith("first") else selector[4:])


def _selectors(layers: Any) -> tuple[str, ...]:
    """'0,-1' / 'first2last2' / (0, 'last2') -> ('0', '-1') / ('first2', 'last2') / ('0', 'last2')."""
    if isinstance(layers, (int, str)) and not isinstance(layers, bool):
        layers = (layers,)
    out = []
    for item in layers:
        if isinstance(item, bool) or not isinstance(item, (int, str)):
            raise ValueError(f"a layer selector must be an int or a string such as '0', '-1', 'first2', "
                             f"'last2', got {item!r}")
        text = str(item).strip().replace(" ", "")
        tokens = _SELECTOR.findall(text)
        if not tokens or re.sub(r"[,/]", "", text) != "".join(tokens):
            raise ValueError(f"layer selector {item!r} is not a list of indices (negative from the end), "
                             f"firstN or lastN, e.g. '0,-1' or 'first2,last2'")
        for t in tokens:
            if t.startswith(("first", "last")) and _count(t) < 1:
                raise ValueError(f"layer selector {t!r}: N must be >= 1")
        out += tokens
    return tuple(dict.fromkeys(out))


def _field_value(text: str):
    """A FIELD=VALUE value: an int, true / false, a float, else the string."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def layer_config(kv_format: str, base: QuantConfig) -> QuantConfig:
    """The QuantConfig a rule names: "NAME" is `base` itself for the base's kv_format, else that
    format's defaults with the base's page_size; "NAME:FIELD=VALUE,..." (items separated by ',' or '/')
    is that config with those QuantConfig fields replaced. ValueError naming an unknown format, an
    unknown field, or values QuantConfig rejects."""
    name, _, fields = kv_format.strip().partition(":")
    name = name.strip()
    if name not in get_args(KVFormat):
        raise ValueError(f"unknown layer format {name!r}; one of {get_args(KVFormat)}")
    known = {f.name for f in dataclasses.fields(QuantConfig)} - {"kv_format"}
    changes = {}
    for item in filter(None, (x.strip() for x in re.split(r"[,/]", fields))):
        key, eq, value = (x.strip() for x in item.partition("="))
        if not eq or key not in known or not value:
            raise ValueError(f"layer format {kv_format!r}: {item!r} is not FIELD=VALUE with FIELD one of "
                             f"{sorted(known)}")
        changes[key] = _field_value(value)
    if fields.strip() and not changes:
        raise ValueError(f"layer format {kv_format!r} names no FIELD=VALUE after ':'")
    try:
        if name == base.kv_format:
            return dataclasses.replace(base, **changes) if changes else base
        # partition_size only so that the base's page_size passes QuantConfig's check (the formats
        # without blocks ignore it): the base's, halved while the page holds no 2-bit packing group of it
        # (a 4-bit hack base's page may hold 2 blocks only); the fields are applied in the same call
        p = base.partition_size
        while p > 16 and base.page_size % (4 * p):
            p //= 2
        return QuantConfig(**{"kv_format": name, "page_size": base.page_size, "partition_size": p, **changes})
    except ValueError as e:
        raise ValueError(f"layer format {kv_format!r}: {e}") from None


@dataclasses.dataclass(frozen=True)
class LayerFormats:
    """Per-layer cache formats (module docstring). Frozen and hashable (a jit static).

    base: QuantConfig of every layer no rule names.
    rules: ((selectors, config), ...): selectors a tuple of '3', '-1', 'firstN', 'lastN' (a string
      '0,-1' or ints are accepted and normalized), config a QuantConfig or a kv_format name.
    Raises ValueError for a bad selector, an unknown format name, or a rule's page_size that is not
    the base's.
    """
    base: QuantConfig
    rules: tuple = ()

    def __post_init__(self):
        if not isinstance(self.base, QuantConfig):
            raise ValueError(f"LayerFormats.base must be a QuantConfig, got {self.base!r}")
        rules = []
        for rule in self.rules:
            if not isinstance(rule, (tuple, list)) or len(rule) != 2:
                raise ValueError(f"a LayerFormats rule is (layers, format), got {rule!r}")
            layers, config = rule
            selectors = _selectors(layers)  # first: 'hack:bits=4' names its missing LAYERS, not 'bits=4'
            if isinstance(config, str):
                config = layer_config(config, self.base)
            if not isinstance(config, QuantConfig):
                raise ValueError(f"a rule's format must be a QuantConfig or a kv_format name, got {config!r}")
            if config.page_size != self.base.page_size:
                raise ValueError(f"every layer format must share the base's page_size={self.base.page_size} "
                                 f"(one page table): layers {layers!r} have page_size={config.page_size}")
            rules.append((selectors, config))
        object.__setattr__(self, "rules", tuple(rules))

    @property
    def page_size(self) -> int:
        return self.base.page_size

    @property
    def distinct(self) -> tuple[QuantConfig, ...]:
        """The base and every rule's config, each once (first appearance first)."""
        return tuple(dict.fromkeys([self.base] + [c for _, c in self.rules]))

    def configs(self, num_layers: int) -> tuple[QuantConfig, ...]:
        """One QuantConfig per layer. ValueError for a selector outside the model's num_layers layers
        or a layer two rules name."""
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be an int >= 1, got {num_layers!r}")
        out: list[QuantConfig] = [self.base] * num_layers
        named: dict[int, tuple[int, str]] = {}  # layer -> (rule, selector) that named it
        for rule, (selectors, config) in enumerate(self.rules):
            for sel in selectors:
                if sel.startswith(("first", "last")):
                    n = _count(sel)
                    if n > num_layers:
                        raise ValueError(f"layer selector {sel!r} names more than the model's {num_layers} layers")
                    layers = range(n) if sel.startswith("first") else range(num_layers - n, num_layers)
                else:
                    i = int(sel)
                    if not -num_layers <= i < num_layers:
                        raise ValueError(f"layer {i} is outside a model of {num_layers} layers (0 to {num_layers - 1}, "
                                         f"or -{num_layers} to -1 from the end)")
                    layers = (i % num_layers,)
                for i in layers:
                    if named.setdefault(i, (rule, sel))[0] != rule:
                        raise ValueError(f"layer {i} is named by two rules ({named[i][1]!r} and {sel!r}) "
                                         f"in {self.spec!r}")
                    out[i] = config
        return tuple(out)

    @property
    def spec(self) -> str:
        """The rules in parse_layer_formats' spelling (a config as its kv_format and the fields that
        differ from what that name alone gives)."""
        def name(c):
            start = layer_config(c.kv_format, self.base)
            if start == c:
                return c.kv_format
            changed = [f"{f.name}={getattr(c, f.name)}" for f in dataclasses.fields(c)
                       if getattr(c, f.name) != getattr(start, f.name)]
            return f"{c.kv_format}:{'/'.join(changed)}"
        return ";".join(f"{','.join(sel)}:{name(c)}" for sel, c in self.rules)

    def __str__(self):
        return f"{self.base.kv_format} + {self.spec}" if self.rules else self.base.kv_format


def parse_layer_formats(spec: str, base: QuantConfig) -> LayerFormats:
    """'LAYERS:FORMAT[;LAYERS:FORMAT...]' (rules also separated by '+') -> LayerFormats over base.
    LAYERS: indices, firstN, lastN separated by ',' or '/' (or written together: 'first2last2');
    FORMAT: a kv_format name, optionally with fields ('hack:bits=4/partition_size=64', layer_config).
    ValueError naming the bad part."""
    rules = []
    for part in filter(None, (p.strip() for p in re.split(r"[;+]", spec))):
        layers, colon, fmt = part.partition(":")
        if not colon or not layers.strip() or not fmt.strip():
            raise ValueError(f"layer formats {spec!r}: {part!r} is not LAYERS:FORMAT (e.g. '0,-1:bf16' or "
                             f"'first2,last2:int8')")
        rules.append((layers, fmt))
    if not rules:
        raise ValueError(f"layer formats {spec!r} name no rule (LAYERS:FORMAT)")
    return LayerFormats(base, tuple(rules))


def keep_layers(spec: str, base: QuantConfig) -> LayerFormats:
    """'N:FORMAT' -> the first N and last N layers in FORMAT, the others in base (CLI --keep-layers)."""
    n, colon, fmt = spec.partition(":")
    if not colon or not n.strip().isdigit() or int(n) < 1:
        raise ValueError(f"keep layers {spec!r} must be N:FORMAT with N >= 1, e.g. '2:int8'")
    return LayerFormats(base, (((f"first{int(n)}", f"last{int(n)}"), fmt),))


def with_layer_formats(quant: QuantConfig | LayerFormats, layer_formats: str | LayerFormats | None
                       ) -> QuantConfig | LayerFormats:
    """A driver's cache config from its `quant` and `layer_formats` arguments (models.generate.Generator,
    models.engine.Engine): None -> quant; a spec string -> parse_layer_formats(spec, quant); a
    LayerFormats as it is. ValueError when both name per-layer formats."""
    if layer_formats is None:
        return quant
    if isinstance(quant, LayerFormats):
        raise ValueError(f"quant is already per-layer ({quant}); layer_formats={layer_formats!r} would override it")
    if isinstance(layer_formats, str):
        return parse_layer_formats(layer_formats, quant)
    if not isinstance(layer_formats, LayerFormats):
        raise ValueError(f"layer_formats must be None, a spec such as 'first2,last2:int8' or a LayerFormats, "
                         f"got {layer_formats!r}")
    return layer_formats
