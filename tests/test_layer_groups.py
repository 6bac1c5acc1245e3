"""One format's stacked cache cut into groups of consecutive layers (kv_cache.init_cache(group_layers=n),
kv_cache.mixed.LayerGroups), the layout models.llama.cache_layout picks where the whole stack would be a
1-byte pool of (2**31, 2**32] bytes, which the Pallas kernels cannot address (kv_cache.stacked).

- init_cache: the groups' sizes and layer_map, each layer the zero arrays of init_layer, per-layer
  formats cut per format, bad group_layers rejected by name.
- cache_layout at Llama-3.1-8B shapes (shapes only, nothing allocated): the code pools' sizes computed
  here from the format's definition (2-bit codes: page_size * head_dim / 4 bytes per page and kv head).
- The model over a grouped cache writes the tuple form's bytes: tests/test_models.py
  (_scan_vs_unrolled's "stacked" form); Backend.finish over groups: tests/test_deferred_seal.py.
"""

import dataclasses

import jax
import numpy as np
import pytest

from hack_jax import kv_cache, paging
from hack_jax.config import QuantConfig
from hack_jax.kv_cache import mixed, stacked
from hack_jax.layer_formats import parse_layer_formats
from models import llama
from models.config import preset

SIZES = dict(num_kv_heads=2, head_dim=16, num_pages=5, max_seqs=2, pages_per_seq=2)
QUANT = QuantConfig(partition_size=16, page_size=64)


def _fields(layer):
    return [f.name for f in dataclasses.fields(layer) if f.name != "config"]


def test_init_cache_cuts_a_format_into_groups_of_layers():
    cache = kv_cache.init_cache(QUANT, num_layers=5, **SIZES, stacked=True, group_layers=2)
    layers = cache.layers
    assert isinstance(layers, kv_cache.LayerGroups) and cache.config == QUANT
    assert [mixed.num_stacked(g) for g in layers.groups] == [2, 2, 1]
    assert layers.layer_map == ((0, 0), (0, 1), (1, 0), (1, 1), (2, 0))
    assert cache.num_layers == 5 and cache.num_pages == 5 and cache.stacked
    one = kv_cache.init_layer(QUANT, **{k: v for k, v in SIZES.items() if k != "pages_per_seq"})
    for layer in mixed.layer_list(layers):
        assert layer.config == QUANT
        for name in _fields(one):
            a, b = getattr(layer, name), getattr(one, name)
            assert a.shape == b.shape and a.dtype == b.dtype and not np.asarray(a).any(), name
    # group_layers >= num_layers, or None: one stack as before
    for n in (None, 5, 9):
        whole = kv_cache.init_cache(QUANT, num_layers=5, **SIZES, stacked=True, group_layers=n).layers
        assert not isinstance(whole, kv_cache.LayerGroups) and mixed.num_stacked(whole) == 5


def test_init_cache_groups_per_layer_formats_per_format():
    lf = parse_layer_formats("0,-1:int8", QUANT)  # int8, hack x 4, int8
    layers = kv_cache.init_cache(lf, num_layers=6, **SIZES, stacked=True, group_layers=3).layers
    formats = [g.config.kv_format for g in layers.groups]
    assert formats == ["int8", "hack", "hack"]
    assert [mixed.num_stacked(g) for g in layers.groups] == [2, 3, 1]
    assert layers.layer_map == ((0, 0), (1, 0), (1, 1), (1, 2), (2, 0), (0, 1))
    assert [layer.config.kv_format for layer in mixed.layer_list(layers)] == [c.kv_format for c in lf.configs(6)]


@pytest.mark.parametrize("value,error", [(0, ValueError), (-2, ValueError), (2.0, TypeError), ("2", TypeError)])
def test_init_cache_rejects_bad_group_layers(value, error):
    with pytest.raises(error, match="group_layers"):
        kv_cache.init_cache(QUANT, num_layers=4, **SIZES, stacked=True, group_layers=value)


def _llama_sizes(batch, context, quant):
    pps = paging.pages_needed(context, page_size=quant.page_size, num_sink_tokens=quant.num_sink_tokens)
    return dict(num_pages=1 + batch * pps, max_seqs=batch, pages_per_seq=pps)


@pytest.mark.parametrize("batch,context", [(8, 16384 + 64), (8, 32768 + 64), (4, 65536 + 64), (8, 65536 + 64),
                                           (32, 32768 + 64), (1, 4096 + 64)])
def test_cache_layout_at_llama_shapes(batch, context):
    """A 2-bit code pool of L layers holds L * num_pages * kv_heads * page_size * head_dim / 4 bytes; the
    kernels address it whole unless that is in (2**31, 2**32]; then the fewest groups of ceil(L / g)
    layers that are <= 2**31 bytes each."""
    config = preset("llama-3.1-8b", scan_layers=False, stack_cache=True)
    quant = QuantConfig()
    sizes = _llama_sizes(batch, context, quant)
    pool = sizes["num_pages"] * config.num_kv_heads * quant.page_size * config.head_dim // 4  # one layer
    whole = config.num_layers * pool
    if not 2**31 < whole <= 2**32:
        want = None
    else:
        want = next(-(-32 // g) for g in range(2, 33) if -(-32 // g) * pool <= 2**31)
    assert llama.cache_layout(config, quant, **sizes) == (True, want)
    if want is not None:  # the groups the layout makes are what the kernels can address
        layer = jax.eval_shape(lambda: kv_cache.init_layer(
            quant, num_kv_heads=8, head_dim=128, num_pages=sizes["num_pages"], max_seqs=batch))
        assert not stacked._addressable(layer, 32) and stacked._addressable(layer, want)
    unrolled = dataclasses.replace(config, stack_cache=False)
    assert llama.cache_layout(unrolled, quant, **sizes) == (False, None)


def test_cache_layout_cases_are_hit():
    """The parametrization above covers both outcomes (guards against shapes that all stay whole)."""
    config = preset("llama-3.1-8b", scan_layers=False, stack_cache=True)
    seen = {llama.cache_layout(config, QuantConfig(), **_llama_sizes(b, c, QuantConfig()))[1]
            for b, c in [(8, 16384 + 64), (8, 32768 + 64)]}
    assert seen == {None, 16}
    # per-layer formats: each format's stack counts its own layers. int8 on 4 layers (1 byte per element:
    # 4 * 1033 pages * 8 heads * 256 * 128 = 1.08e9 bytes) and 2-bit hack on 28 (28 / 32 of 2.17e9 = 1.9e9):
    # both addressable whole, though hack's pool over all 32 layers would not be
    sizes = _llama_sizes(8, 32768 + 64, QuantConfig())
    pool = sizes["num_pages"] * 8 * 256 * 128 // 4
    assert 28 * pool <= 2**31 < 32 * pool and 4 * 4 * pool <= 2**31
    lf = parse_layer_formats("0,1,-2,-1:int8", QuantConfig())
    assert llama.cache_layout(config, lf, **sizes) == (True, None)
    scanned = preset("llama-3.1-8b", scan_layers=True)  # a scan runs once per group
    assert llama.cache_layout(scanned, QuantConfig(), **_llama_sizes(8, 32768 + 64, QuantConfig())) == (True, 16)
