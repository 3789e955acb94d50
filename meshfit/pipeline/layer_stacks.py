"""Layer stacks on the `stage` axis: the contiguous layout, and the repeat-major one of a circular pipeline.

A `meshfit.pipeline.Stages` stack keeps its L layers' parameters on a leading
layer axis split over the `stage` mesh axis. GPipe and 1F1B run each stage's
layers as one contiguous block: the stack is stored (L, ...) and laid out
("stage", ...). A circular pipeline with v repeats runs layer block r * P + s
on stage s in round r; stored contiguously, a stage's blocks would lie on other
stages and every step would move them there (and their gradients back). So
under it the stack is stored repeat-major, (v, L / v, ...) laid out
(None, "stage", ...): row r holds round r's blocks and the stage axis splits
each row, so stage s holds blocks r * P + s of every round (MaxText keeps its
circular pipelines' weights the same way). Read row by row, the layers are in
their own order: the two forms differ by a reshape.

What a user sees and what is saved is the natural (L, ...) form, whatever the
schedule: `natural` gives it, and `stored` puts a natural value back into a
live stack's form, so weights and checkpoints move between schedules, layouts
and one device unchanged.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshfit.pipeline.settings import STAGE_AXIS


def layer_axes(spec: Any) -> int:
    """How many leading axes of an array laid out by `spec` hold a stack's layers: 1 for ("stage", ...),
    2 for the repeat-major (None, "stage", ...), 0 for an array that is no stack."""
    if spec is None or not len(spec):
        return 0
    if spec[0] == STAGE_AXIS:
        return 1
    return 2 if len(spec) > 1 and spec[0] is None and spec[1] == STAGE_AXIS else 0


def stack_layers(shape: tuple[int, ...], spec: Any) -> int | None:
    """The number of layers of a stack of `shape` laid out by `spec`; None for an array that is no stack."""
    lead = layer_axes(spec)
    return int(np.prod(shape[:lead])) if lead and len(shape) >= lead else None


def repeat_major(leaf: Any) -> bool:
    """Whether `leaf` (an array or `jax.ShapeDtypeStruct` with a `NamedSharding`) is a repeat-major stack."""
    return layer_axes(getattr(getattr(leaf, "sharding", None), "spec", None)) == 2


def natural(tree: Any) -> Any:
    """`tree` with every repeat-major stack in the natural (L, ...) form, laid out ("stage", ...); other leaves
    as they are. Arrays are reshaped on their devices (one program, as a save or a read of the weights needs);
    `jax.ShapeDtypeStruct`s (restore targets) get the natural shape and layout."""
    return jax.tree.map(_natural_leaf, tree)


def stored(tree: Any, like: Any) -> Any:
    """`tree` (natural values: arrays, host arrays or restored ones) with each leaf where `like` holds a
    repeat-major stack reshaped to that stack's form (device arrays laid out as it is; host arrays reshaped
    only, for the caller to place). Leaves already of `like`'s shape are kept."""
    return jax.tree.map(_stored_leaf, tree, like)


def _natural_leaf(leaf: Any) -> Any:
    if not repeat_major(leaf):
        return leaf
    shape = (leaf.shape[0] * leaf.shape[1], *leaf.shape[2:])
    sharding = NamedSharding(leaf.sharding.mesh, P(STAGE_AXIS, *leaf.sharding.spec[2:]))
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(shape, leaf.dtype, sharding=sharding)
    return _reshape(leaf, shape, sharding)


def _stored_leaf(value: Any, like: Any) -> Any:
    if not repeat_major(like) or tuple(np.shape(value)) == tuple(like.shape):
        return value
    if isinstance(value, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(like.shape, like.dtype, sharding=like.sharding)
    if isinstance(value, jax.Array):
        return _reshape(value, tuple(like.shape), like.sharding)
    return np.reshape(value, like.shape)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _reshape(array: jax.Array, shape: tuple[int, ...], sharding: NamedSharding) -> jax.Array:
    return jax.lax.with_sharding_constraint(array.reshape(shape), sharding)
