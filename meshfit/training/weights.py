"""A model's weights as Keras lists them: trainable parameters, then non-trainable weights, by path.

`Weights`, a base class of `meshfit.Model`, is its Keras face for them (`get_weights`, `set_weights`,
`weight_names`, the `*weights` properties, `params`, `module`, `count_params`); the functions below read and
replace the state's arrays: the trainable parameters in `jax.tree.leaves` order (sorted module paths), then the
non-trainable ones (frozen parameters, BatchNorm statistics).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from meshfit.core.state import TrainState
from meshfit.core.trees import path_name
from meshfit.pipeline import layer_stacks
from meshfit.strategies import placement
from meshfit.training.session import Session


def trees(state: TrainState, adapter: Any) -> tuple[Any, Any]:
    """The trainable parameters and the non-trainable weights of `state` (`adapter`: the module's adapter), as
    the state stores them (a circular pipeline's layer stacks repeat-major: `meshfit.pipeline.layer_stacks`)."""
    return state.params, adapter.non_trainable_weights(state.model_state)


def natural_trees(state: TrainState, adapter: Any) -> tuple[Any, Any]:
    """`trees`, every layer stack in its natural (layers, ...) form: the weights as a user sees them."""
    return layer_stacks.natural(trees(state, adapter))


def names(state: TrainState, adapter: Any) -> list[str]:
    """Each weight's path (`"dense/kernel"`), trainable ones first, in `get_weights` order."""
    return [
        path_name(path) for tree in trees(state, adapter) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]


def replaced(state: TrainState, adapter: Any, weights: Sequence[np.ndarray]) -> TrainState:
    """`state` with every weight replaced by `weights` (in `get_weights` order and natural form), each placed
    as the one it replaces.

    Raises:
        ValueError: the count or a shape differs, naming the weight; nothing changes.
    """
    params, non_trainable = trees(state, adapter)
    leaves = jax.tree.leaves(params) + jax.tree.leaves(non_trainable)
    shown = jax.tree.leaves(layer_stacks.natural((params, non_trainable)))
    weights = list(weights)
    if len(weights) != len(leaves):
        raise ValueError(
            f"set_weights expected a list of {len(leaves)} arrays (see model.weight_names()). Received {len(weights)}."
        )
    for name, old, new in zip(names(state, adapter), shown, weights, strict=True):
        if tuple(np.shape(new)) != tuple(old.shape):
            raise ValueError(
                f"Weight '{name}' has shape {tuple(old.shape)}. Received an array of shape {np.shape(new)}."
            )
    placed = [
        placement.put(layer_stacks.stored(np.asarray(new, dtype=old.dtype), old), old.sharding)
        for old, new in zip(leaves, weights, strict=True)
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


class Weights:
    """The weights of `meshfit.Model` (its base class), read from and written to its session's state.

    The class using it sets `session` (the model's `Session`), `strategy` and `_adapter` (the module's
    adapter, `meshfit.steps.modules.ModuleAdapter`).
    """

    session: Session
    strategy: Any
    _adapter: Any

    @property
    def params(self) -> Any:
        """The trainable parameters as a nested dict of `jax.Array` (on device: the live arrays, except a
        circular pipeline's layer stacks, shown in their natural (layers, ...) form)."""
        return layer_stacks.natural(self.session.latest.params)

    @property
    def module(self) -> Any:
        """The user's module, holding the current weights."""
        state = self.session.latest
        return self._adapter.sync_module(state.params, state.model_state)

    def weight_names(self) -> list[str]:
        """Names of `get_weights()` entries: trainable paths, then non-trainable ones."""
        return names(self.session.state, self._adapter)

    @property
    def trainable_weights(self) -> list[jax.Array]:
        """The trainable parameters as live device arrays, in `get_weights()` order (sorted module paths;
        `weight_names()[:len(model.trainable_weights)]` names them). Keras returns Variables; here
        arrays, which `set_weights` replaces (layer stacks in their natural form, as `params`)."""
        return jax.tree.leaves(layer_stacks.natural(self.session.state.params))

    @property
    def non_trainable_weights(self) -> list[jax.Array]:
        """The non-trainable weights (frozen parameters, BatchNorm statistics) as live device arrays,
        after the trainable ones in `get_weights()` and `weight_names()` order."""
        return jax.tree.leaves(natural_trees(self.session.state, self._adapter)[1])

    @property
    def weights(self) -> list[jax.Array]:
        """`trainable_weights + non_trainable_weights`, named by `weight_names()`, in that order."""
        return self.trainable_weights + self.non_trainable_weights

    def get_weights(self) -> list[np.ndarray]:
        """All weights as numpy arrays: the trainable parameters in `jax.tree.leaves`
        order (sorted module paths), then the non-trainable ones (e.g. BatchNorm
        statistics) in the same order. `weight_names()` names them."""
        both = natural_trees(self.session.state, self._adapter)
        return [a for tree in both for a in jax.tree.leaves(self.strategy.to_host(tree))]

    def set_weights(self, weights: Sequence[np.ndarray]) -> None:
        """Sets all weights from a list in `get_weights()` order; shapes must match."""
        self.session.state = replaced(self.session.state, self._adapter, weights)

    def count_params(self) -> int:
        return sum(int(np.prod(a.shape)) for a in jax.tree.leaves(self.session.latest.params))
