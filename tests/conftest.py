"""Shared pytest setup: the `gpu` marker's auto-skip, float32 JAX, fast deterministic hypothesis, and
faster XLA compiles where there is no NVIDIA GPU (below)."""

import atexit
import importlib.util
import os
import shutil
import tempfile

# Compilation dominates the CPU suite. Where there is no NVIDIA GPU (no nvidia-smi, no jax CUDA plugin:
# the CPU machines and CI), set before any backend starts: XLA's CPU backend at LLVM optimization level 0
# with its expensive passes off (the same HLO passes and IEEE arithmetic, no fast-math either way; the
# tests' programs are small), and a persistent compilation cache for this session, so a program compiled
# again in a later test module (the fixture below clears jax's in-memory caches per module) is loaded
# instead. Measured on 2 cores, tests/test_layer_formats.py + test_deferred_seal.py: 349 s -> 194 s
# (bench/NOTES_reliability.md). HACK_JAX_TEST_XLA_DEFAULTS=1 keeps XLA's defaults.

def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


_GPU = shutil.which("nvidia-smi") or any(map(_installed, (
    "jax_cuda12_plugin", "jax_cuda13_plugin", "jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")))
if not _GPU and not os.environ.get("HACK_JAX_TEST_XLA_DEFAULTS"):
    os.environ["XLA_FLAGS"] = " ".join(filter(None, [
        os.environ.get("XLA_FLAGS"), "--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]))
    _CACHE = tempfile.mkdtemp(prefix="hack_jax_xla_cache_")
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
else:
    _CACHE = None

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# Production code runs with 32-bit JAX; the tests' float64 references are NumPy, never JAX.
jax.config.update("jax_enable_x64", False)
if _CACHE:
    jax.config.update("jax_compilation_cache_dir", _CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

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
