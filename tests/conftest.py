"""Shared test setup: 8 simulated CPU devices, set once before JAX starts."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Full float32 matmuls where a backend would round them (TF32 on NVIDIA GPUs): the tests compare
# numbers against references to float32 tolerance. Inherited by the processes the tests start.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")

import sys  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _compilation_cache_released():
    """A fit whose backups were kept leaves JAX caching in them (as a user's process would); tests start without."""
    yield
    cache = sys.modules.get("meshfit.compilation_cache")
    if cache is not None and cache.directory() is not None:
        cache.release(cache.directory())
