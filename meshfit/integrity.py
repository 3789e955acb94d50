"""Fingerprints and finiteness of a saved state, to catch altered bytes and NaN states.

A checkpoint records one fingerprint per array when it is written and the
restore compares them, so bytes changed on disk (a flipped bit, a bad block)
are caught instead of training on garbage. Device arrays are fingerprinted on
the devices, in one compiled call, with integer sums that do not depend on
the order of addition: the value is the same under any sharding, so a
checkpoint written under one strategy verifies under another, and no array is
gathered onto one device. Host (numpy) arrays are hashed with BLAKE2b.

The same pass says which floating arrays hold NaN or Inf, so a saver can
refuse to write a non-finite state.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from meshfit.trees import path_name

_GOLDEN = 0x9E3779B9


class Report(NamedTuple):
    """Per array path: its fingerprint (hex) and whether it is finite (always True for integers)."""

    fingerprints: dict[str, str]
    finite: dict[str, bool]

    def non_finite(self) -> list[str]:
        return [path for path, ok in self.finite.items() if not ok]


def _mix(h):
    """murmur3's 32-bit finaliser: a bijection, so distinct words stay distinct."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _words(x):
    """The array's bits as uint32 words, in its own shape (8-byte types get a trailing axis of 2)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = np.dtype(x.dtype).itemsize
    if size in (4, 8):
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    unsigned = {2: jnp.uint16, 1: jnp.uint8}[size]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _fingerprint(x):
    """Two order-independent uint32 sums of mixed (word, position) pairs.

    No reshape: a sharded array stays sharded and is reduced where it lies.
    Changing one word always changes the first sum (`_mix` is a bijection).
    """
    w = _words(x)
    index = jnp.zeros(w.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(w.ndim)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, w.shape, axis) * jnp.uint32(stride & 0xFFFFFFFF)
        stride *= w.shape[axis]
    h = _mix(w ^ _mix(index + jnp.uint32(_GOLDEN)))
    return jnp.stack([jnp.sum(h, dtype=jnp.uint32), jnp.sum(h * (index * 2 + 1), dtype=jnp.uint32)])


def _finite(x):
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.all(jnp.isfinite(x))
    return jnp.bool_(True)


@jax.jit
def _device_report(leaves):
    """All fingerprints as one (n, 2) array and all flags as one (n,) array: two transfers, not 2n."""
    return jnp.stack([_fingerprint(x) for x in leaves]), jnp.stack([_finite(x) for x in leaves])


def _scalar(value) -> np.ndarray:
    """A small result as numpy: from this process's copy when replicated (the usual case), else gathered."""
    local = value.addressable_data(0)
    if local.shape == value.shape:
        return np.asarray(local)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(value, tiled=True))


def _host_fingerprint(x: np.ndarray) -> str:
    x = np.ascontiguousarray(x)
    digest = hashlib.blake2b(x.view(np.uint8).reshape(-1).data, digest_size=8)
    digest.update(f"{x.dtype.str}{x.shape}".encode())
    return digest.hexdigest()


def report(tree) -> Report:
    """Fingerprints and finiteness of every array in `tree`.

    Device arrays are reduced on their devices (a short sync); in a
    multi-process job every process must call this with the same tree.
    """
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    device = [(path_name(p), x) for p, x in leaves if isinstance(x, jax.Array)]
    host = [(path_name(p), np.asarray(x)) for p, x in leaves if not isinstance(x, jax.Array)]
    fingerprints, finite = {}, {}
    if device:
        prints, flags = (_scalar(a) for a in _device_report([x for _, x in device]))
        for (name, _), fp, ok in zip(device, prints, flags, strict=True):
            fingerprints[name] = "".join(f"{int(v):08x}" for v in fp)
            finite[name] = bool(ok)
    for name, x in host:
        fingerprints[name] = _host_fingerprint(x)
        finite[name] = not np.issubdtype(x.dtype, np.inexact) or bool(np.isfinite(x).all())
    return Report(fingerprints, finite)


def mismatched(saved: dict[str, str], restored: dict[str, str]) -> list[str]:
    """Paths whose restored fingerprint differs from the saved one (paths saved without one are skipped)."""
    return [path for path, value in restored.items() if path in saved and saved[path] != value]
