"""Moving pytrees between hosts and global (possibly multi-process) arrays.

Shared by the strategies that lay arrays out over a `jax.sharding.Mesh`. In a
multi-process job every process calls these with the same values (state) or
with its own rows (batches); JAX assembles the global arrays.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils

from meshfit.core.trees import is_key


def put(tree, shardings):
    """Places a pytree with the given sharding (one, or a matching pytree of them).

    A `jax.ShapeDtypeStruct` leaf stays abstract: it comes back with the sharding, and nothing is created.

    In a multi-process job the values go through the host, since every process
    holds the same copy and JAX builds each process's shards from it.
    """
    if not isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(put, tree, shardings)
    multi = jax.process_count() > 1

    def put_leaf(leaf):
        if isinstance(leaf, jax.ShapeDtypeStruct):  # an abstract value (`Model(abstract=True)`): laid out, not made
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=shardings)
        if is_key(leaf):
            return jax.random.wrap_key_data(put_leaf(jax.random.key_data(leaf)), impl=jax.random.key_impl(leaf))
        if multi:
            host = np.asarray(leaf) if not isinstance(leaf, jax.Array) or leaf.is_fully_addressable else fetch(leaf)
            return jax.make_array_from_callback(host.shape, shardings, lambda index: host[index])
        return jax.device_put(leaf, shardings)

    return jax.tree.map(put_leaf, tree)


def put_local_rows(tree, sharding):
    """Builds global arrays from this process's rows of a batch (numpy pytree)."""
    if jax.process_count() == 1:
        return jax.device_put(tree, sharding)
    return jax.tree.map(lambda leaf: jax.make_array_from_process_local_data(sharding, leaf), tree)


def fetch(tree):
    """Pulls a pytree of (global) arrays to the host as numpy — a host sync.

    Replicated arrays are read from a local shard; sharded ones are gathered
    from all processes.
    """

    def fetch_leaf(leaf):
        if not isinstance(leaf, jax.Array):
            return np.asarray(leaf)
        if is_key(leaf):
            return fetch_leaf(jax.random.key_data(leaf))
        if leaf.is_fully_addressable:
            return np.asarray(leaf)
        if leaf.sharding.is_fully_replicated:
            return np.asarray(leaf.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))

    return jax.tree.map(fetch_leaf, tree)
