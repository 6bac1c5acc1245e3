"""Shared pytest setup: the `gpu` marker's auto-skip, float32 JAX, fast deterministic hypothesis, and on the
CPU one compilation cache per test run and cheap XLA compiles outside the `optimized_xla` modules."""

import os
import shutil
import tempfile

import jax
import numpy as np
import pytest
from hypothesis import settings

import models  # noqa: F401  (sets its XLA flag before pytest_configure below starts jax's backend)

# Production code runs with 32-bit JAX; the tests' float64 references are NumPy, never JAX.
jax.config.update("jax_enable_x64", False)

# Derandomized so CI is reproducible; no example database written into the work tree.
settings.register_profile("hack", max_examples=20, deadline=None, derandomize=True, database=None)
settings.load_profile("hack")


_CACHE_ENV = "HACK_JAX_TEST_COMPILE_CACHE"


def pytest_configure(config):
    """On the CPU, one persistent compilation cache for this run, in a fresh temporary directory shared by
    pytest-xdist's workers (and subprocess tests) through an environment variable, removed when the run
    ends. Many modules compile the same programs (the tiny models' steps, the kernels' configs), and
    _free_compiled_executables below drops the in-memory executables after each module: in a full run about
    a fifth of the compiles are then read back instead (4461 distinct programs of 5641 compiles, 2026-12-05).
    Never reused across runs, so every run compiles each program at least once; HACK_JAX_TEST_COMPILE_CACHE=""
    (empty) runs without it. An xdist controller only makes the directory: it runs no test, and touching jax
    there would take a GPU the workers need."""
    if _CACHE_ENV not in os.environ:
        os.environ[_CACHE_ENV] = config._hack_jax_cache = tempfile.mkdtemp(prefix="hack-jax-xla-cache-")
    xdist = getattr(config.option, "numprocesses", None) or getattr(config.option, "tx", None)
    controller = bool(xdist) and not hasattr(config, "workerinput")
    if controller or jax.devices()[0].platform != "cpu":
        return
    jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
    path = getattr(config, "_hack_jax_cache", None)
    if path:
        shutil.rmtree(path, ignore_errors=True)
        os.environ.pop(_CACHE_ENV, None)


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


_FAST_COMPILE_ENV = "HACK_JAX_TEST_FAST_COMPILE"
_DISABLE_ENV = "JAX_DISABLE_MOST_OPTIMIZATIONS"  # jax's own variable for the flag, read by subprocesses


@pytest.fixture(autouse=True, scope="module")
def _cheap_cpu_compiles(request):
    """On the CPU, each test module compiles with jax_disable_most_optimizations (XLA's backend at LLVM -O0,
    without its expensive passes) unless the module is marked `optimized_xla` (a module-level pytestmark;
    marks on single tests are not seen here), which compiles with it off, as users' programs do. The suite is
    compile-bound: thousands of small programs, the Pallas kernels' interpret mode above all, whose LLVM
    optimization costs more than running them unoptimized (bench/NOTES_reliability.md: about a quarter off the
    suite's time). Marked: the modules that run the real 135M model's programs long enough for -O0 code to
    cost more than it saves (1.5-1.7x slower there), and those whose exact checks need the optimized code
    (its fused multiply-adds: a value rounded once; two programs bit for bit, which -O0's unfused arithmetic
    makes easier to meet than users' code does). A new exact comparison of two programs belongs in a marked
    module, or is checked with HACK_JAX_TEST_FAST_COMPILE=0, which leaves every module to the environment's
    setting. The module's subprocesses inherit the module's setting (jax reads JAX_DISABLE_MOST_OPTIMIZATIONS).
    The flag is part of the persistent cache's key, and _free_compiled_executables drops the in-memory
    executables between modules."""
    if jax.devices()[0].platform != "cpu" or os.environ.get(_FAST_COMPILE_ENV, "1") == "0":
        yield
        return
    cheap = request.node.get_closest_marker("optimized_xla") is None
    before = jax.config.values["jax_disable_most_optimizations"], os.environ.get(_DISABLE_ENV)
    jax.config.update("jax_disable_most_optimizations", cheap)
    os.environ[_DISABLE_ENV] = "1" if cheap else "0"
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before[0])
        if before[1] is None:
            os.environ.pop(_DISABLE_ENV, None)
        else:
            os.environ[_DISABLE_ENV] = before[1]


@pytest.fixture
def rng():
    return np.random.default_rng(0)
