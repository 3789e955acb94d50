"""Optimizers by Keras name, built on optax with an injectable learning rate.

`get("adam")` returns `optax.inject_hyperparams(optax.adam)(...)` with Keras's
defaults, so the learning rate lives in the optimizer state as an array and
callbacks can change it between steps without recompiling. The other
hyperparameters are static: each array in the state is one more buffer every
compiled step call passes, which costs host time on small models.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import optax
from optax import tree_utils as otu

from meshfit.strategies import placement

# name -> (optax factory, Keras's default keyword arguments)
_FACTORIES: dict[str, tuple[Callable[..., optax.GradientTransformation], dict[str, Any]]] = {
    "adam": (optax.adam, dict(learning_rate=1e-3, b1=0.9, b2=0.999, eps=1e-7)),
    "adamw": (optax.adamw, dict(learning_rate=1e-3, b1=0.9, b2=0.999, eps=1e-7, weight_decay=0.004)),
    "adamax": (optax.adamax, dict(learning_rate=1e-3, b1=0.9, b2=0.999, eps=1e-7)),
    "nadam": (optax.nadam, dict(learning_rate=1e-3, b1=0.9, b2=0.999, eps=1e-7)),
    "sgd": (optax.sgd, dict(learning_rate=1e-2)),
    "rmsprop": (optax.rmsprop, dict(learning_rate=1e-3, decay=0.9, eps=1e-7)),
    "adagrad": (optax.adagrad, dict(learning_rate=1e-3, initial_accumulator_value=0.1, eps=1e-7)),
    "adadelta": (optax.adadelta, dict(learning_rate=1e-3, rho=0.95, eps=1e-7)),
    "adafactor": (optax.adafactor, dict(learning_rate=1e-3)),
    "lion": (optax.lion, dict(learning_rate=1e-3, b1=0.9, b2=0.99)),
    "lamb": (optax.lamb, dict(learning_rate=1e-3, b1=0.9, b2=0.999, eps=1e-6)),
}


def names() -> list[str]:
    """The optimizer names `get` accepts."""
    return sorted(_FACTORIES)


def get(identifier, **overrides) -> optax.GradientTransformation:
    """Returns an optax transform for a Keras optimizer name or passes one through.

    Args:
        identifier: a name such as "adam" (case-insensitive), or an
            `optax.GradientTransformation`, returned unchanged.
        **overrides: keyword arguments for the optax factory, e.g. `learning_rate=3e-4`.
    """
    if isinstance(identifier, optax.GradientTransformation):
        return identifier
    if isinstance(identifier, str):
        key = identifier.lower()
        if key not in _FACTORIES:
            raise ValueError(
                f"Unknown optimizer name {identifier!r}. Expected one of {names()}, or an optax.GradientTransformation."
            )
        factory, defaults = _FACTORIES[key]
        kwargs = {**defaults, **overrides}
        static = tuple(k for k in kwargs if k != "learning_rate" and not callable(kwargs[k]))
        return optax.inject_hyperparams(factory, static_args=static)(**kwargs)
    raise TypeError(
        "`optimizer` must be an optimizer name (one of "
        f"{names()}) or an optax.GradientTransformation. Received: {identifier!r} "
        f"of type {type(identifier).__name__}."
    )


class Optimizer:
    """The model's optimizer as Keras callbacks see it: `model.optimizer.learning_rate`.

    Reads and writes the learning rate held in the optimizer state (see
    `optax.inject_hyperparams`); writing keeps the array's dtype and placement,
    so the compiled step is reused.
    """

    def __init__(self, transform: optax.GradientTransformation, session):
        self.transform = transform
        self._session = session  # the model's `meshfit.session.Session`: holds the optimizer state

    def _lr_leaf(self):
        opt_state = self._session.state.opt_state
        found = otu.tree_get(opt_state, "learning_rate", default=None)
        if found is None:
            raise AttributeError(
                "The optimizer has no learning rate held in its state, so it cannot be read "
                "or changed while training. Build it with optax.inject_hyperparams, e.g. "
                "optax.inject_hyperparams(optax.adam)(learning_rate=1e-3), or pass a name like 'adam'."
            )
        return found

    @property
    def learning_rate(self) -> float:
        """The current learning rate (reads one value from the device)."""
        return float(self._session.strategy.to_host(self._lr_leaf()))

    @learning_rate.setter
    def learning_rate(self, value) -> None:
        old = self._lr_leaf()
        new = placement.put(np.asarray(value, dtype=old.dtype), old.sharding)
        state = self._session.state
        self._session.state = state._replace(opt_state=otu.tree_set(state.opt_state, learning_rate=new))

    @property
    def iterations(self) -> int:
        """Number of optimizer steps taken (reads one value from the device)."""
        return int(self._session.strategy.to_host(self._session.state.step))

    def __repr__(self):
        return f"Optimizer({self.transform!r})"
