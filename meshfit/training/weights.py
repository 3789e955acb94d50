"""A model's weights as Keras lists them: trainable parameters, then non-trainable weights, by path.

`get_weights`, `set_weights`, `weight_names` and the `*weights` properties of
`meshfit.Model` read and replace the state's arrays through these functions:
the trainable parameters in `jax.tree.leaves` order (sorted module paths),
then the non-trainable ones (frozen parameters, BatchNorm statistics).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from meshfit.core.state import TrainState
from meshfit.core.trees import path_name
from meshfit.strategies import placement


def trees(state: TrainState, adapter: Any) -> tuple[Any, Any]:
    """The trainable parameters and the non-trainable weights of `state` (`adapter`: the module's adapter)."""
    return state.params, adapter.non_trainable_weights(state.model_state)


def names(state: TrainState, adapter: Any) -> list[str]:
    """Each weight's path (`"dense/kernel"`), trainable ones first, in `get_weights` order."""
    return [
        path_name(path) for tree in trees(state, adapter) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]


def replaced(state: TrainState, adapter: Any, weights: Sequence[np.ndarray]) -> TrainState:
    """`state` with every weight replaced by `weights` (in `get_weights` order), each placed as the one it replaces.

    Raises:
        ValueError: the count or a shape differs, naming the weight; nothing changes.
    """
    params, non_trainable = trees(state, adapter)
    leaves = jax.tree.leaves(params) + jax.tree.leaves(non_trainable)
    weights = list(weights)
    if len(weights) != len(leaves):
        raise ValueError(
            f"set_weights expected a list of {len(leaves)} arrays (see model.weight_names()). Received {len(weights)}."
        )
    for name, old, new in zip(names(state, adapter), leaves, weights, strict=True):
        if tuple(np.shape(new)) != tuple(old.shape):
            raise ValueError(
                f"Weight '{name}' has shape {tuple(old.shape)}. Received an array of shape {np.shape(new)}."
            )
    placed = [
        placement.put(np.asarray(new, dtype=old.dtype), old.sharding) for old, new in zip(leaves, weights, strict=True)
    ]
    n_params = len(jax.tree.leaves(params))
    new_params = jax.tree.unflatten(jax.tree.structure(params), placed[:n_params])
    new_non_trainable = jax.tree.unflatten(jax.tree.structure(non_trainable), placed[n_params:])
    model_state = state.model_state
    if non_trainable is not model_state:  # NNX keeps RNG streams beside the weights
        model_state = {**model_state, "weights": new_non_trainable}
    else:
        model_state = new_non_trainable
    return state._replace(params=new_params, model_state=model_state)
