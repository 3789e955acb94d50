"""Small helpers on pytrees shared across the package."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax

from meshfit.core import compat


def path_name(path: Iterable[Any]) -> str:
    """'layers/0/kernel' for a pytree key path: the same for dict keys, attributes and sequence indices."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


def is_key(leaf: Any) -> bool:
    """Whether `leaf` is a typed PRNG key array."""
    return hasattr(leaf, "dtype") and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def on_devices(leaf: Any) -> bool:
    """Whether a restore template's leaf is read onto devices: an array, or a template of one (a
    `jax.ShapeDtypeStruct` with a sharding: a state not created yet); anything else is a host value."""
    return isinstance(leaf, jax.Array) or (isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding is not None)


def encode(tree):
    """Replaces typed PRNG keys by their raw data (what Orbax can store); a template's keys
    (`jax.ShapeDtypeStruct`s) by the shape of their data, laid out as the key."""
    return jax.tree.map(lambda leaf: _key_data(leaf) if is_key(leaf) else leaf, tree)


def _key_data(key):
    if isinstance(key, jax.ShapeDtypeStruct):
        data = jax.eval_shape(jax.random.key_data, key)
        return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=key.sharding)
    return jax.random.key_data(key)


def decode(restored, template):
    """Wraps raw key data back into typed keys where the template has keys."""
    return jax.tree.map(
        lambda new, old: jax.random.wrap_key_data(new, impl=compat.key_impl(old)) if is_key(old) else new,
        restored,
        template,
    )
