"""hack_jax.config.QuantConfig: defaults, validation, immutability."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from hack_jax.config import QuantConfig


def test_defaults():
    config = QuantConfig()
    assert (config.kv_format, config.layout, config.rounding) == ("hack", "kivi", "nearest")
    assert (config.partition_size, config.page_size, config.num_sink_tokens) == (64, 256, 4)
    assert config.meta_dtype == jnp.float16 and config.residual_dtype == jnp.bfloat16


@pytest.mark.parametrize(
    "kwargs",
    [
        {"partition_size": 16, "page_size": 64},
        {"partition_size": 128, "page_size": 512, "num_sink_tokens": 0},
        {"partition_size": 32, "page_size": 384},
        {"kv_format": "int8", "layout": "seed", "rounding": "stochastic"},
        {"kv_format": "bf16"},
        {"kv_format": "float32"},
        {"v_rotation": 64},
        {"kv_format": "int8", "v_rotation": 2},
    ],
)
def test_valid(kwargs):
    config = QuantConfig(**kwargs)
    assert all(getattr(config, k) == v for k, v in kwargs.items())


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"partition_size": 8}, "p=8"),
        ({"partition_size": 0}, "p=0"),
        ({"partition_size": -64}, "p=-64"),
        ({"partition_size": 48, "page_size": 192}, "p=48"),
        ({"partition_size": 64.0}, "64.0"),
        ({"partition_size": True}, "True"),
        ({"page_size": 128}, "page_size=128"),
        ({"page_size": 320}, "page_size=320"),
        ({"page_size": 0}, "page_size=0"),
        ({"num_sink_tokens": -1}, "-1"),
        ({"kv_format": "int3"}, "'int3'"),
        ({"layout": "channel"}, "'channel'"),
        ({"rounding": "floor"}, "'floor'"),
        ({"v_rotation": 1}, "v_rotation=1"),
        ({"v_rotation": 48}, "v_rotation=48"),
        ({"v_rotation": -64}, "v_rotation=-64"),
        ({"v_rotation": 64.0}, "64.0"),
        ({"v_rotation": True}, "True"),
    ],
)
def test_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantConfig(**kwargs)


def test_frozen_hashable_and_static():
    config = QuantConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.partition_size = 32
    assert hash(config) == hash(QuantConfig()) and config != QuantConfig(partition_size=32)
    smaller = dataclasses.replace(config, partition_size=32)
    assert smaller.partition_size == 32 and config.partition_size == 64
    # Usable as a static jit argument (the cache pytree keeps it as metadata).
    assert jax.jit(lambda c: c.partition_size * 2, static_argnums=0)(config) == 128
