"""Dtype policies (Keras's names) and dynamic loss scaling for float16.

A policy says which dtype the weights are kept in (`variable_dtype`) and
which the forward and backward passes run in (`compute_dtype`). Under a mixed
policy the weights and optimizer state stay float32 (master weights); each
step casts the parameters and the floating inputs to the compute dtype, and
casts the outputs back to float32 before the loss and the metrics, so
gradients come back float32. What is not cast: integer inputs (labels, token
ids), the module's non-trainable state (BatchNorm statistics keep their dtype),
and the loss, metrics and softmax inside the loss (float32).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

#: Keras's initial loss scale and the finite steps after which it doubles (`LossScaleOptimizer`).
INITIAL_LOSS_SCALE = 2.0**15
LOSS_SCALE_GROWTH_STEPS = 2000


@dataclasses.dataclass(frozen=True)
class DTypePolicy:
    """A named pair of dtypes: where weights live and what the steps compute in."""

    name: str
    variable_dtype: np.dtype
    compute_dtype: np.dtype

    @property
    def mixed(self) -> bool:
        return self.variable_dtype != self.compute_dtype

    @property
    def loss_scaling(self) -> bool:
        """float16 computation needs a loss scale: small gradients underflow its range."""
        return self.compute_dtype == np.dtype(jnp.float16)

    def cast_to_compute(self, tree: Any) -> Any:
        """Floating leaves of `tree` in the compute dtype (others unchanged)."""
        return _cast_floating(tree, self.compute_dtype)

    def cast_to_variable(self, tree: Any) -> Any:
        """Floating leaves of `tree` in the variable dtype: the weights as the state keeps them."""
        return _cast_floating(tree, self.variable_dtype)

    def __repr__(self) -> str:
        return f"DTypePolicy({self.name!r})"


_POLICIES = {
    "float32": (jnp.float32, jnp.float32),
    "mixed_bfloat16": (jnp.float32, jnp.bfloat16),
    "mixed_float16": (jnp.float32, jnp.float16),
    "bfloat16": (jnp.bfloat16, jnp.bfloat16),
}


def names() -> list[str]:
    """The policy names `get` accepts."""
    return list(_POLICIES)


def get(identifier: str | DTypePolicy | None) -> DTypePolicy:
    """A policy by Keras name ("float32", "mixed_bfloat16", "mixed_float16", "bfloat16"), or passed through."""
    if identifier is None:
        identifier = "float32"
    if isinstance(identifier, DTypePolicy):
        return identifier
    if isinstance(identifier, str) and identifier in _POLICIES:
        variable, compute = _POLICIES[identifier]
        return DTypePolicy(identifier, np.dtype(variable), np.dtype(compute))
    raise ValueError(f"Unknown dtype policy {identifier!r}. Expected one of {names()}.")


def to_float32(tree: Any) -> Any:
    """Floating leaves below float32 (bfloat16, float16) cast up, for the loss and the metrics."""
    return jax.tree.map(lambda a: a.astype(jnp.float32) if _low_precision(a) else a, tree)


def _low_precision(a: jax.Array) -> bool:
    return jnp.issubdtype(a.dtype, jnp.floating) and jnp.finfo(a.dtype).bits < 32


def _cast_floating(tree: Any, dtype: Any) -> Any:
    return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


class LossScale(NamedTuple):
    """Dynamic loss scaling with Keras's `LossScaleOptimizer` rules, kept in the train state.

    The loss is multiplied by `scale` before the backward pass and the
    gradients divided by it after. A step with non-finite gradients is
    skipped (no update) and halves the scale; after `LOSS_SCALE_GROWTH_STEPS`
    finite steps in a row the scale doubles.
    """

    scale: jax.Array  # float32 scalar
    good_steps: jax.Array  # int32 scalar: finite steps since the scale last changed

    @classmethod
    def initial(cls) -> LossScale:
        return cls(jnp.asarray(INITIAL_LOSS_SCALE, jnp.float32), jnp.zeros((), jnp.int32))

    def next(self, finite: jax.Array) -> LossScale:
        grown = self.good_steps + 1 >= LOSS_SCALE_GROWTH_STEPS
        scale = jnp.where(finite, jnp.where(grown, self.scale * 2.0, self.scale), self.scale / 2.0)
        good_steps = jnp.where(finite & ~grown, self.good_steps + 1, 0)
        return LossScale(scale.astype(jnp.float32), good_steps.astype(jnp.int32))


def all_finite(tree: Any) -> jax.Array:
    """True if every element of every leaf is finite (a scalar bool)."""
    leaves = [jnp.all(jnp.isfinite(a)) for a in jax.tree.leaves(tree)]
    return jnp.stack(leaves).all() if leaves else jnp.asarray(True)
