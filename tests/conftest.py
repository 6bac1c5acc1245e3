"""Shared pytest setup: the `gpu` marker's auto-skip, float32 JAX, fast deterministic hypothesis."""

import jax
import numpy as np
import pytest
from hypothesis import settings

# Production code runs with 32-bit JAX; the tests' float64 references are NumPy, never JAX.
jax.config.update("jax_enable_x64", False)

# Derandomized so CI is reproducible; no example database written into the work tree.
settings.register_profile("hack", max_examples=20, deadline=None, derandomize=True, database=None)
settings.load_profile("hack")


def pytest_collection_modifyitems(config, items):
    platform = jax.devices()[0].platform
    if platform == "gpu":
        return
    skip = pytest.mark.skip(reason=f"needs an NVIDIA GPU; jax's first device is {platform!r}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_executables():
    """Drops jax's compiled executables after each test module. Each XLA CPU executable holds ~3 memory
    mappings of JIT code (300 small compiles: +964 mappings, all freed by jax.clear_caches), and the whole
    suite compiles enough of them to pass the kernel's vm.max_map_count (65530): a run on 2026-12-02
    segfaulted inside XLA's compile at ~96% (tests/test_window.py, which passes alone)."""
    yield
    jax.clear_caches()


@pytest.fixture
def rng():
    return np.random.default_rng(0)
