"""Small helpers on pytrees shared across the package."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax


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


def encode(tree):
    """Replaces typed PRNG keys by their raw data (what Orbax can store)."""
    return jax.tree.map(lambda leaf: jax.random.key_data(leaf) if is_key(leaf) else leaf, tree)


def decode(restored, template):
    """Wraps raw key data back into typed keys where the template has keys."""
    return jax.tree.map(
        lambda new, old: jax.random.wrap_key_data(new, impl=jax.random.key_impl(old)) if is_key(old) else new,
        restored,
        template,
    )
