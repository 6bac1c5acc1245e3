"""Shared pytest setup: the `gpu` marker's auto-skip, float32 JAX, fast deterministic hypothesis, a
per-session compilation cache."""

import os
import shutil
import tempfile

import jax
import numpy as np
import pytest
from hypothesis import settings

# Production code runs with 32-bit JAX; the tests' float64 references are NumPy, never JAX.
jax.config.update("jax_enable_x64", False)

# Derandomized so CI is reproducible; no example database written into the work tree.
settings.register_profile("hack", max_examples=20, deadline=None, derandomize=True, database=None)
settings.load_profile("hack")

# Every Stepper (so every Generator / Engine) compiles its own executables, and many tests build the same
# programs again (the same tiny model and cache geometry): a persistent compilation cache, fresh per session
# (nothing carries over between runs), turns those repeats into loads. It changes which compile runs, not
# what is compiled. Subprocesses (tests/test_sharding.py's pytest) find it in the environment and keep it.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
_COMPILE_CACHE = tempfile.mkdtemp(prefix="hack-jax-test-xla-") if _OWN_CACHE else os.environ["JAX_COMPILATION_CACHE_DIR"]
os.environ["JAX_COMPILATION_CACHE_DIR"] = _COMPILE_CACHE
jax.config.update("jax_compilation_cache_dir", _COMPILE_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
    if _OWN_CACHE:
        shutil.rmtree(_COMPILE_CACHE, ignore_errors=True)


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
