"""Keras's global dtype policy: `set_global_policy("mixed_bfloat16")` once, every later `compile` uses it.

`Model.compile(dtype_policy=...)` wins where it is given; where it is not,
the model computes under the global policy (default "float32"). The policies
are `meshfit.core.precision`'s, by Keras's names.

Example:
    >>> meshfit.mixed_precision.set_global_policy("mixed_bfloat16")
    >>> model.compile(optimizer="adam", loss="mse")  # bfloat16 compute, float32 weights
    >>> meshfit.mixed_precision.set_global_policy(None)  # back to "float32"
"""

from __future__ import annotations

from meshfit.core import precision
from meshfit.core.precision import DTypePolicy

__all__ = ["DTypePolicy", "Policy", "get", "global_policy", "set_global_policy"]

#: Keras's older name for a dtype policy.
Policy = DTypePolicy

_global: DTypePolicy | None = None


def set_global_policy(policy: str | DTypePolicy | None) -> None:
    """Sets the policy `compile` uses when it is given no `dtype_policy` (Keras's function).

    Args:
        policy: a policy name ("float32", "mixed_bfloat16", "mixed_float16",
            "bfloat16"; see `meshfit.core.precision.names()`), a `DTypePolicy`, or
            None for the default, "float32".

    Raises:
        ValueError: an unknown name, listing the known ones; the global is unchanged.
    """
    global _global
    if policy is not None and not isinstance(policy, (str, DTypePolicy)):
        raise ValueError(
            f"Expected a policy name such as 'mixed_bfloat16' ({precision.names()}), a DTypePolicy or None. "
            f"Received: policy={policy!r} of type {type(policy).__name__}."
        )
    _global = None if policy is None else precision.get(policy)


def global_policy() -> DTypePolicy:
    """The policy `compile` uses when it is given no `dtype_policy` ("float32" unless set)."""
    return precision.get(_global)


def get(policy: str | DTypePolicy | None) -> DTypePolicy:
    """The policy of a name ("mixed_bfloat16"), a `DTypePolicy` as it is, or None for "float32" (as
    `keras.dtype_policies.get`); an unknown name is a ValueError listing the known ones."""
    return precision.get(policy)
