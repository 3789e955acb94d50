"""Marking values inside the pipeline's `shard_map` as varying over its manual axes."""

from __future__ import annotations

import jax
from jax import lax


def vary(a: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """`a` marked as varying over `axes` (only those it does not already vary over), as a loop carry must be."""
    missing = tuple(axis for axis in axes if axis not in jax.typeof(a).manual_axis_type.varying)
    return lax.pcast(a, missing, to="varying") if missing else a
