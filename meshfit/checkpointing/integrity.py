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

from meshfit.core.trees import path_name

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


def _report_values(leaves):
    return jnp.stack([_fingerprint(x) for x in leaves]), jnp.stack([_finite(x) for x in leaves])


@jax.jit
def _device_report(leaves):
    """All fingerprints as one (n, 2) array and all flags as one (n,) array: two transfers, not 2n."""
    return _report_values(leaves)


@jax.jit
def _device_snapshot(leaves):
    """Copies of the arrays (new buffers, laid out as the originals) and their report, in one program.

    One program rather than a copy per array: a backend that runs a single cheap operation as it is
    dispatched (the CPU) runs this one asynchronously too.
    """
    copies = [jnp.copy(x) for x in leaves]
    return copies, _report_values(copies)


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


class PendingReport:
    """A `Report` whose device part is still being computed (`start_report`); `result` fetches it."""

    def __init__(self, device: list[str], values, host: list[tuple[str, np.ndarray]]):
        self._device, self._values, self._host = device, values, host
        self._flags = None

    def non_finite(self) -> list[str]:
        """Paths of the arrays holding NaN or Inf: fetches only the flags (waits for the reduction)."""
        return self.result().non_finite() if self._values is None else self._non_finite_only()

    def _non_finite_only(self) -> list[str]:
        if self._flags is None:
            self._flags = _scalar(self._values[1])
        host = [name for name, x in self._host if not _host_finite(x)]
        return [name for name, ok in zip(self._device, self._flags, strict=True) if not ok] + host

    def result(self) -> Report:
        """The fingerprints and flags (a host sync: waits for the device reduction)."""
        fingerprints, finite = {}, {}
        if self._values is not None:
            prints, flags = (_scalar(a) for a in self._values)
            for name, fp, ok in zip(self._device, prints, flags, strict=True):
                fingerprints[name] = "".join(f"{int(v):08x}" for v in fp)
                finite[name] = bool(ok)
        for name, x in self._host:
            fingerprints[name] = _host_fingerprint(x)
            finite[name] = _host_finite(x)
        return Report(fingerprints, finite)


def _host_finite(x: np.ndarray) -> bool:
    return not np.issubdtype(x.dtype, np.inexact) or bool(np.isfinite(x).all())


def start_report(tree) -> PendingReport:
    """Dispatches the fingerprints of `tree`'s device arrays without waiting for them (`PendingReport.result`).

    In a multi-process job every process must call this with the same tree.
    """
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    device = [(path_name(p), x) for p, x in leaves if isinstance(x, jax.Array)]
    host = [(path_name(p), np.asarray(x)) for p, x in leaves if not isinstance(x, jax.Array)]
    values = _device_report([x for _, x in device]) if device else None
    return PendingReport([name for name, _ in device], values, host)


def snapshot(tree):
    """A copy of `tree` and its `PendingReport`, dispatched, not waited for.

    The copy's device arrays are new buffers, computed after everything already
    dispatched that writes `tree`: later steps that donate (overwrite) `tree`'s
    buffers leave it intact. Host (numpy) arrays are copied on the host. In a
    multi-process job every process must call this with the same tree.
    """
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    device = [i for i, (_, x) in enumerate(leaves) if isinstance(x, jax.Array)]
    values = [x for _, x in leaves]
    report_values = None
    if device:
        copies, report_values = _device_snapshot([values[i] for i in device])
        for i, copy in zip(device, copies, strict=True):
            values[i] = copy
    host = []
    for i, (path, x) in enumerate(leaves):
        if not isinstance(x, jax.Array):
            values[i] = np.array(x, copy=True) if isinstance(x, np.ndarray) else x
            host.append((path_name(path), np.asarray(values[i])))
    pending = PendingReport([path_name(leaves[i][0]) for i in device], report_values, host)
    return jax.tree_util.tree_unflatten(treedef, values), pending


def report(tree) -> Report:
    """Fingerprints and finiteness of every array in `tree`.

    Device arrays are reduced on their devices (a short sync); in a
    multi-process job every process must call this with the same tree.
    """
    return start_report(tree).result()


def mismatched(saved: dict[str, str], restored: dict[str, str]) -> list[str]:
    """Paths whose restored fingerprint differs from the saved one (paths saved without one are skipped)."""
    return [path for path, value in restored.items() if path in saved and saved[path] != value]
