"""Small models, data and assertions shared by the tests."""

import jax
import numpy as np
from flax import nnx


class MLP(nnx.Module):
    """A small MLP used across tests (optionally with dropout)."""

    def __init__(self, din=4, hidden=16, dout=3, *, dropout=0.0, seed=0):
        rngs = nnx.Rngs(seed)
        self.hidden = nnx.Linear(din, hidden, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs) if dropout else None
        self.out = nnx.Linear(hidden, dout, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.hidden(x))
        if self.dropout is not None:
            x = self.dropout(x)
        return self.out(x)


def classification_data(n=64, din=4, classes=3, seed=0):
    """Linearly separable-ish data: labels from a fixed random projection."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, din)).astype(np.float32)
    w = rng.standard_normal((din, classes)).astype(np.float32)
    y = np.argmax(x @ w, axis=-1).astype(np.int32)
    return x, y


def assert_trees_close(a, b, rtol=1e-6, atol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def device_bytes(device=None):
    """What lives on `device` (default: device 0): `(bytes, shapes of whole arrays held there)`.

    Every live array's buffer on the device is counted once (a shard of a
    sharded array, a replicated array's copy, a single-device array); a shard
    read through `.data` is the same buffer as its array's and is not counted
    again. "Whole" arrays are those the device holds entirely while they span
    several devices (replicated) or live on it alone.
    """
    import gc

    gc.collect()
    device = device or jax.devices()[0]
    arrays = [a for a in jax.live_arrays() if not a.is_deleted()]
    buffers, whole = {}, []
    for array in arrays:
        if len(array.sharding.device_set) > 1:
            for shard in array.addressable_shards:
                if shard.device == device:
                    pointer = shard.data.unsafe_buffer_pointer()
                    if pointer not in buffers and shard.data.size == array.size:
                        whole.append(array.shape)
                    buffers[pointer] = shard.data.nbytes
    for array in arrays:
        if array.sharding.device_set == {device}:
            pointer = array.unsafe_buffer_pointer()
            if pointer not in buffers:
                buffers[pointer] = array.nbytes
                whole.append(array.shape)
    return sum(buffers.values()), whole
