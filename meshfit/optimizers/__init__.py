"""Optimizers by Keras name, built on optax with an injectable learning rate.

`get("adam")` returns `optax.inject_hyperparams(adam)(...)` with Keras's
defaults and Keras's own Adam step (`meshfit.optimizers.keras_adam`; optax's places
epsilon elsewhere), so the learning rate lives in the optimizer state as an array and
callbacks can change it between steps without recompiling. The other
hyperparameters are static: each array in the state is one more buffer every
compiled step call passes, which costs host time on small models.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax import tree_utils as otu

from meshfit import schedules
from meshfit.optimizers import keras_adam
from meshfit.strategies import placement

__all__ = [
    "Adam",
    "AdamW",
    "SGD",
    "RMSprop",
    "Adagrad",
    "get",
    "from_keras",
    "is_keras_optimizer",
    "names",
    "factory_of",
    "Optimizer",
    "OptimizerStateAccess",
    "LearningRateIsSchedule",
    "Recipe",
    "recipe_of",
    "schedule_of",
    "schedules",
]

# name -> (optax factory, Keras's default keyword arguments)
_FACTORIES: dict[str, tuple[Callable[..., optax.GradientTransformation], dict[str, Any]]] = {
    "adam": (keras_adam.adam, dict(learning_rate=1e-3, b1=0.9, b2=0.999, eps=1e-7)),
    "adamw": (keras_adam.adamw, dict(learning_rate=1e-3, b1=0.9, b2=0.999, eps=1e-7, weight_decay=0.004)),
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


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How `get` built a transform: `get(recipe.name, **recipe.config)` builds it again.

    `model.save` writes it down (when every value is JSON) so that
    `load_model` compiles with the same optimizer; the transform itself, two
    functions, cannot be written.

    Attributes:
        name: the optimizer name, lower case ("adam").
        config: every keyword argument: Keras's defaults, the overrides and the clipping.
    """

    name: str
    config: dict[str, Any]


#: The recipe of each transform `get` built from a name, keyed by its update function (a transform is
#: a NamedTuple, which cannot be keyed weakly itself; the function lives as long as the transform).
_RECIPES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class LearningRateIsSchedule(TypeError):
    """The learning rate follows an optax schedule, so it cannot be set."""


def recipe_of(transform: optax.GradientTransformation) -> Recipe | None:
    """How `get` built `transform` from a name, or None (a transform built another way)."""
    return _RECIPES.get(getattr(transform, "update", None))


def schedule_of(transform: optax.GradientTransformation) -> Callable | None:
    """The learning-rate schedule `get` built `transform` with, or None."""
    recipe = recipe_of(transform)
    learning_rate = None if recipe is None else recipe.config["learning_rate"]
    return learning_rate if callable(learning_rate) else None


def names() -> list[str]:
    """The optimizer names `get` accepts."""
    return sorted(_FACTORIES)


def factory_of(name: str) -> Callable[..., optax.GradientTransformation]:
    """The optax factory `get(name)` calls (`optax.sgd` for "sgd"): its signature says what `get` takes."""
    return _FACTORIES[name.lower()][0]


def get(
    identifier: str | optax.GradientTransformation | optax.MultiSteps,
    *,
    clipnorm: float | None = None,
    clipvalue: float | None = None,
    global_clipnorm: float | None = None,
    weight_decay: float | None = None,
    **overrides: Any,
) -> optax.GradientTransformation:
    """Returns an optax transform for a Keras optimizer name or passes one through.

    Args:
        identifier: a name such as "adam" (case-insensitive), an
            `optax.GradientTransformation` (returned unchanged unless clipping
            is asked for), an `optax.MultiSteps` (gradient accumulation), or a
            Keras optimizer object (`from_keras`).
        clipnorm: clip each gradient array to this L2 norm (Keras's `clipnorm`).
        clipvalue: clip each gradient element to `[-clipvalue, clipvalue]`.
        global_clipnorm: clip all gradients together to this global L2 norm.
        weight_decay: Keras's decoupled weight decay: each step also subtracts
            `learning_rate * weight_decay * param` from every parameter. For an
            optimizer whose optax factory takes `weight_decay` ("adamw",
            "lamb", ...) it is that argument. None: none (or the factory's default).
        **overrides: keyword arguments for the optax factory, e.g. `learning_rate=3e-4`.
    """
    if is_keras_optimizer(identifier) and not overrides and clipnorm is clipvalue is global_clipnorm is weight_decay:
        return from_keras(identifier)
    clipping = _clipping(clipnorm, clipvalue, global_clipnorm)
    if weight_decay is not None:
        if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)) or weight_decay < 0:
            raise ValueError(f"`weight_decay` must be a number >= 0. Received: weight_decay={weight_decay!r}.")
        if not isinstance(identifier, str):
            raise ValueError(
                "`weight_decay` applies to optimizer names; an optax transformation comes configured already "
                f"(add optax.add_decayed_weights to it). Received: weight_decay={weight_decay!r}."
            )
    if isinstance(identifier, optax.MultiSteps):
        if clipping:
            raise ValueError(
                "Clip inside an optax.MultiSteps (clip the mean gradient, as Keras does): pass the clipping "
                "to the optimizer it wraps, e.g. optax.MultiSteps(meshfit.optimizers.get('adam', clipnorm=1.0), 4), "
                "or use compile(gradient_accumulation_steps=4)."
            )
        identifier = identifier.gradient_transformation()
    if isinstance(identifier, optax.GradientTransformation):
        if overrides:
            raise ValueError(
                f"Keyword arguments {sorted(overrides)} apply to optimizer names; "
                "an optax transformation comes configured already."
            )
        return optax.chain(*clipping, identifier) if clipping else identifier
    if isinstance(identifier, str):
        key = identifier.lower()
        if key not in _FACTORIES:
            raise ValueError(
                f"Unknown optimizer name {identifier!r}. Expected one of {names()}, or an optax.GradientTransformation."
            )
        factory, defaults = _FACTORIES[key]
        if weight_decay is not None:
            if "weight_decay" in inspect.signature(factory).parameters:
                overrides = {**overrides, "weight_decay": weight_decay}
            else:
                factory = _decoupled_weight_decay(factory)
                overrides = {**overrides, "weight_decay": weight_decay}
        # A numpy scalar as its Python value: optax would keep `np.float32(1e-3)` static, out of the state.
        kwargs = {k: v.item() if isinstance(v, np.generic) else v for k, v in {**defaults, **overrides}.items()}
        static = tuple(k for k in kwargs if k != "learning_rate" and not callable(kwargs[k]))
        tx = optax.inject_hyperparams(factory, static_args=static)(**kwargs)
        tx = optax.chain(*clipping, tx) if clipping else tx
        clip_args = {"clipnorm": clipnorm, "clipvalue": clipvalue, "global_clipnorm": global_clipnorm}
        _RECIPES[tx.update] = Recipe(key, {**kwargs, **{k: v for k, v in clip_args.items() if v is not None}})
        return tx
    raise TypeError(
        "`optimizer` must be an optimizer name (one of "
        f"{names()}), an optax.GradientTransformation or an optax.MultiSteps. Received: {identifier!r} "
        f"of type {type(identifier).__name__}."
    )


def _decoupled_weight_decay(factory: Callable[..., optax.GradientTransformation]) -> Callable:
    """`factory` with Keras's decoupled weight decay added: `param -= learning_rate * weight_decay * param`.

    The decay is added to the optimizer's own update (which already holds the
    learning rate), so it never enters a momentum or a second moment, as in
    Keras's `BaseOptimizer._apply_weight_decay`. `inject_hyperparams` calls it with the
    learning rate as a value (a schedule already evaluated at the step).
    """

    def with_decay(learning_rate, *args, weight_decay: float = 0.0, **kwargs):
        inner = factory(learning_rate, *args, **kwargs)
        return optax.chain(inner, optax.add_decayed_weights(-learning_rate * weight_decay))

    with_decay.__name__ = f"{factory.__name__}_with_weight_decay"
    signature = inspect.signature(factory)  # what `inject_hyperparams` reads to bind the arguments
    decay = inspect.Parameter("weight_decay", inspect.Parameter.KEYWORD_ONLY, default=0.0)
    params = [p for p in signature.parameters.values() if p.kind != inspect.Parameter.VAR_KEYWORD]
    with_decay.__signature__ = signature.replace(parameters=[*params, decay])
    return with_decay


def _keras_optimizer(name: str, keras_names: dict[str, str], **arguments: Any) -> optax.GradientTransformation:
    """`get(name, ...)` with Keras's argument names renamed to optax's (`beta_1` -> `b1`)."""
    if not arguments.get("amsgrad", True):
        arguments.pop("amsgrad")  # the default of every factory that takes it
    elif "amsgrad" in arguments and name not in ("adam", "adamw"):
        raise ValueError(f"amsgrad=True is Adam's and AdamW's option, not {name!r}'s. Received: amsgrad=True.")
    own = {keras_names.get(k, k): v for k, v in arguments.items()}
    return get(name, **own)


_ADAM_NAMES = {"beta_1": "b1", "beta_2": "b2", "epsilon": "eps"}


def Adam(  # noqa: N802 (Keras's name)
    learning_rate: float | Callable = 1e-3,
    beta_1: float = 0.9,
    beta_2: float = 0.999,
    epsilon: float = 1e-7,
    amsgrad: bool = False,
    weight_decay: float | None = None,
    clipnorm: float | None = None,
    clipvalue: float | None = None,
    global_clipnorm: float | None = None,
) -> optax.GradientTransformation:
    """Keras's `Adam` with its arguments and defaults: `get("adam", ...)`, so it compiles, saves and
    loads as the name does.

    The steps are Keras's (`meshfit.optimizers.keras_adam`: epsilon outside the bias
    correction, `amsgrad` on the raw second moment).

    Example:
        >>> model.compile(optimizer=meshfit.optimizers.Adam(1e-3, clipnorm=1.0), loss="mse")
    """
    return _keras_optimizer(
        "adam",
        _ADAM_NAMES,
        learning_rate=learning_rate,
        beta_1=beta_1,
        beta_2=beta_2,
        epsilon=epsilon,
        amsgrad=amsgrad,
        weight_decay=weight_decay,
        clipnorm=clipnorm,
        clipvalue=clipvalue,
        global_clipnorm=global_clipnorm,
    )


def AdamW(  # noqa: N802 (Keras's name)
    learning_rate: float | Callable = 1e-3,
    weight_decay: float = 0.004,
    beta_1: float = 0.9,
    beta_2: float = 0.999,
    epsilon: float = 1e-7,
    amsgrad: bool = False,
    clipnorm: float | None = None,
    clipvalue: float | None = None,
    global_clipnorm: float | None = None,
) -> optax.GradientTransformation:
    """Keras's `AdamW` (decoupled weight decay, default 0.004): `get("adamw", ...)`; see `Adam`."""
    return _keras_optimizer(
        "adamw",
        _ADAM_NAMES,
        learning_rate=learning_rate,
        weight_decay=weight_decay,
        beta_1=beta_1,
        beta_2=beta_2,
        epsilon=epsilon,
        amsgrad=amsgrad,
        clipnorm=clipnorm,
        clipvalue=clipvalue,
        global_clipnorm=global_clipnorm,
    )


def SGD(  # noqa: N802 (Keras's name)
    learning_rate: float | Callable = 0.01,
    momentum: float = 0.0,
    nesterov: bool = False,
    weight_decay: float | None = None,
    clipnorm: float | None = None,
    clipvalue: float | None = None,
    global_clipnorm: float | None = None,
) -> optax.GradientTransformation:
    """Keras's `SGD` (with momentum and Nesterov momentum): `get("sgd", ...)`, the same steps as Keras's."""
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum <= 1:
        raise ValueError(f"`momentum` must be a float in [0, 1]. Received: momentum={momentum!r}.")
    extra = {"momentum": momentum, "nesterov": bool(nesterov)} if momentum else {}  # (Nesterov of 0 is SGD)
    return _keras_optimizer(
        "sgd",
        {},
        learning_rate=learning_rate,
        weight_decay=weight_decay,
        clipnorm=clipnorm,
        clipvalue=clipvalue,
        global_clipnorm=global_clipnorm,
        **extra,
    )


def RMSprop(  # noqa: N802 (Keras's name)
    learning_rate: float | Callable = 1e-3,
    rho: float = 0.9,
    momentum: float = 0.0,
    epsilon: float = 1e-7,
    centered: bool = False,
    weight_decay: float | None = None,
    clipnorm: float | None = None,
    clipvalue: float | None = None,
    global_clipnorm: float | None = None,
) -> optax.GradientTransformation:
    """Keras's `RMSprop` (`epsilon` inside the square root, as in Keras): `get("rmsprop", ...)`."""
    extra = {"momentum": momentum} if momentum else {}
    if centered:
        extra["centered"] = True
    return _keras_optimizer(
        "rmsprop",
        {"rho": "decay", "epsilon": "eps"},
        learning_rate=learning_rate,
        rho=rho,
        epsilon=epsilon,
        weight_decay=weight_decay,
        clipnorm=clipnorm,
        clipvalue=clipvalue,
        global_clipnorm=global_clipnorm,
        **extra,
    )


def Adagrad(  # noqa: N802 (Keras's name)
    learning_rate: float | Callable = 1e-3,
    initial_accumulator_value: float = 0.1,
    epsilon: float = 1e-7,
    weight_decay: float | None = None,
    clipnorm: float | None = None,
    clipvalue: float | None = None,
    global_clipnorm: float | None = None,
) -> optax.GradientTransformation:
    """Keras's `Adagrad`: `get("adagrad", ...)`, the same steps as Keras's."""
    return _keras_optimizer(
        "adagrad",
        {"epsilon": "eps"},
        learning_rate=learning_rate,
        initial_accumulator_value=initial_accumulator_value,
        epsilon=epsilon,
        weight_decay=weight_decay,
        clipnorm=clipnorm,
        clipvalue=clipvalue,
        global_clipnorm=global_clipnorm,
    )


def _clipping(
    clipnorm: float | None, clipvalue: float | None, global_clipnorm: float | None
) -> list[optax.GradientTransformation]:
    """Keras's gradient clipping as optax transforms, applied before the optimizer's own."""
    for name, value in (("clipnorm", clipnorm), ("clipvalue", clipvalue), ("global_clipnorm", global_clipnorm)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise ValueError(f"`{name}` must be a positive number. Received: {name}={value!r}.")
    given = {k: v for k, v in (("clipnorm", clipnorm), ("clipvalue", clipvalue), ("global_clipnorm", global_clipnorm))}
    if sum(v is not None for v in given.values()) > 1:
        raise ValueError(
            "Only one of `clipnorm` (each gradient array), `clipvalue` (each element) and `global_clipnorm` "
            f"(all together) can be set, as in Keras. Received: {given}."
        )
    out = []
    if clipvalue is not None:
        out.append(optax.clip(float(clipvalue)))
    if clipnorm is not None:
        out.append(_clip_each_by_norm(float(clipnorm)))
    if global_clipnorm is not None:
        out.append(optax.clip_by_global_norm(float(global_clipnorm)))
    return out


def _clip_each_by_norm(max_norm: float) -> optax.GradientTransformation:
    """Scales each gradient array whose L2 norm exceeds `max_norm` down to it (Keras's `clipnorm`)."""

    def clip(g: jax.Array) -> jax.Array:
        norm = jnp.sqrt(jnp.sum(jnp.square(g.astype(jnp.float32))))
        return g * (max_norm / jnp.maximum(norm, max_norm)).astype(g.dtype)

    return optax.stateless(lambda updates, params: jax.tree.map(clip, updates))


class OptimizerStateAccess(NamedTuple):
    """What an `Optimizer` reads and writes of the training state, without knowing who holds it.

    `Model.compile` builds one over the model's session.

    Attributes:
        opt_state: returns the optimizer state as the last step left it (device arrays; nothing waits).
        replace_opt_state: writes a new optimizer state, of the same structure and placement, between steps.
        step: returns the number of optimizer steps taken, as a device scalar.
        to_host: pulls a device value to the host (a host sync).
    """

    opt_state: Callable[[], Any]
    replace_opt_state: Callable[[Any], None]
    step: Callable[[], Any]
    to_host: Callable[[Any], Any]


def partitioned(transforms: dict[str, optax.GradientTransformation]) -> optax.GradientTransformation:
    """One transform that trains each top-level part of the parameters with its own transform.

    `transforms` is keyed by the module's top-level attributes (the first
    keys of the parameter dict); the state is a dict with the same keys, each
    entry the state of that part's transform (as Keras keeps one optimizer's
    variables apart from another's). The parameters must have exactly these
    keys (`check_parts`).
    """
    transforms = dict(transforms)

    def init(params):
        return {key: tx.init(params[key]) for key, tx in transforms.items()}

    def update(updates, state, params=None):
        new_updates, new_state = {}, {}
        for key, tx in transforms.items():
            part = None if params is None else params[key]
            new_updates[key], new_state[key] = tx.update(updates[key], state[key], part)
        return new_updates, new_state

    return optax.GradientTransformation(init, update)


def check_parts(keys, params) -> None:
    """Raises a `ValueError` unless `keys` (of a dict of optimizers) are exactly the parameters' top-level parts."""
    parts = sorted(params) if isinstance(params, dict) else []
    unknown = sorted(set(keys) - set(parts))
    missing = sorted(set(parts) - set(keys))
    if unknown or missing:
        raise ValueError(
            "A dict of optimizers must be keyed by the module's top-level attributes that hold parameters, "
            f"one optimizer each: expected the keys {parts}. Received: {sorted(keys)} "
            f"(unknown: {unknown}, missing: {missing}). Freeze a part with `Model(..., trainable=...)` "
            "rather than leaving it out."
        )


def stateless_apply(transform: optax.GradientTransformation, opt_state, grads, params):
    """`(new params, new optimizer state)` after one update of `params` by `grads` (Keras's name)."""
    updates, opt_state = transform.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


class Optimizer:
    """The model's optimizer as Keras callbacks see it: `model.optimizer.learning_rate`.

    Reads and writes the learning rate held in the optimizer state (see
    `optax.inject_hyperparams`); writing keeps the array's dtype and placement,
    so the compiled step is reused. A learning rate given as an optax schedule
    (`get("adam", learning_rate=optax.cosine_decay_schedule(...))`) is read as
    the schedule's value at the optimizer's step count (the rate the next step
    uses, as Keras reads a `LearningRateSchedule`), and cannot be set.

    Args:
        transform: the optax transformation.
        state: how to read and replace the optimizer state (`OptimizerStateAccess`).
        schedule: the learning-rate schedule `transform` was built with (`schedule_of`), if any.
        key: for one of several optimizers (`compile(optimizer={...})`), the
            part it trains: its state is `opt_state[key]`. None: the only one.
    """

    def __init__(
        self,
        transform: optax.GradientTransformation,
        state: OptimizerStateAccess,
        schedule: Callable | None = None,
        key: str | None = None,
    ) -> None:
        self.transform = transform
        self._state = state
        self.schedule = schedule
        self.key = key

    def stateless_apply(self, opt_state, grads, params):
        """`(new params, new optimizer state)`: one update of `params` by `grads` (Keras's name), pure.

        For one of several optimizers, `opt_state`, `grads` and `params` are
        its part's (`state.opt_state[key]`, `grads[key]`, `state.params[key]`).
        """
        return stateless_apply(self.transform, opt_state, grads, params)

    def _own_state(self, opt_state):
        return opt_state if self.key is None else opt_state[self.key]

    def _lr_leaves(self) -> list[tuple[tuple, Any]]:
        found = otu.tree_get_all_with_path(self._own_state(self._state.opt_state()), "learning_rate")
        if not found:
            raise AttributeError(
                "The optimizer has no learning rate held in its state, so it cannot be read "
                "or changed while training. Build it with optax.inject_hyperparams, e.g. "
                "optax.inject_hyperparams(optax.adam)(learning_rate=1e-3), or pass a name like 'adam'."
            )
        return found

    @staticmethod
    def _is_schedule_state(path: tuple) -> bool:
        return any(getattr(key, "name", None) == "hyperparams_states" for key in path)

    @property
    def learning_rate_is_schedule(self) -> bool:
        """Whether the learning rate follows a schedule (it can be read, not set)."""
        return any(self._is_schedule_state(path) for path, _ in self._lr_leaves())

    @property
    def learning_rate(self) -> float:
        """The current learning rate (reads one value from the device).

        For a schedule: its value at the optimizer's step count. For a schedule
        in a transform `get` did not build (its function is unknown here), the
        rate the last step used.
        """
        leaves = self._lr_leaves()
        values = [leaf for path, leaf in leaves if not self._is_schedule_state(path)]
        counts = [leaf.count for path, leaf in leaves if self._is_schedule_state(path) and hasattr(leaf, "count")]
        if self.schedule is not None and counts:
            return float(self.schedule(int(self._state.to_host(counts[0]))))
        return float(self._state.to_host(values[0]))

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        if self.learning_rate_is_schedule:
            raise self.schedule_error(f"set to {value!r}")
        old = self._lr_leaves()[0][1]
        new = placement.put(np.asarray(value, dtype=old.dtype), old.sharding)
        opt_state = self._state.opt_state()
        own = otu.tree_set(self._own_state(opt_state), learning_rate=new)
        self._state.replace_opt_state(own if self.key is None else {**opt_state, self.key: own})

    @staticmethod
    def schedule_error(what: str) -> LearningRateIsSchedule:
        return LearningRateIsSchedule(
            f"The learning rate follows an optax schedule, so it cannot be {what}: the schedule decides it at "
            "every step. To set it from a callback or `model.optimizer.learning_rate = ...`, compile with a float "
            "learning rate, e.g. meshfit.optimizers.get('adam', learning_rate=1e-3), or put it in the schedule."
        )

    @property
    def iterations(self) -> int:
        """Number of optimizer steps taken (reads one value from the device)."""
        return int(self._state.to_host(self._state.step()))

    def __repr__(self) -> str:
        return f"Optimizer({self.transform!r})" if self.key is None else f"Optimizer({self.key!r}, {self.transform!r})"


class Optimizers(dict):
    """Several optimizers (`compile(optimizer={"generator": ..., "discriminator": ...})`): a dict of
    `Optimizer`s keyed by the part of the module each trains, as `state.opt_state` is keyed.

    `model.optimizer["generator"].learning_rate` reads one; callbacks that
    read or set a learning rate take `optimizer="generator"` to say which.
    """

    def __init__(
        self, optimizers: dict[str, Optimizer], transform: optax.GradientTransformation, state: OptimizerStateAccess
    ) -> None:
        super().__init__(optimizers)
        self.transform = transform
        self._state = state

    def stateless_apply(self, opt_state, grads, params):
        """Every part updated by its own optimizer: `(new params, new optimizer state)`, pure."""
        return stateless_apply(self.transform, opt_state, grads, params)

    @property
    def iterations(self) -> int:
        """Number of training steps taken (reads one value from the device)."""
        return int(self._state.to_host(self._state.step()))

    def __repr__(self):
        return f"Optimizers({sorted(self)})"


def select(optimizer, key: str | None, who: str):
    """The `Optimizer` a callback acts on: the model's only one, or `optimizer[key]` of several.

    Raises a `ValueError` naming the keys when a model has several and `key`
    is None or unknown, or when `key` is given for a model with one.
    """
    if isinstance(optimizer, Optimizers):
        if key in optimizer:
            return optimizer[key]
        raise ValueError(
            f"{who} acts on one optimizer and the model has several: {sorted(optimizer)}. "
            f"Received: optimizer={key!r}. Pass one of these keys, e.g. {who}(..., optimizer={sorted(optimizer)[0]!r})."
        )
    if key is not None:
        raise ValueError(
            f"{who} was given optimizer={key!r}, but the model was compiled with one optimizer. "
            "Leave `optimizer` unset, or compile with a dict of optimizers."
        )
    return optimizer


def is_keras_optimizer(obj: Any) -> bool:
    """Whether `obj` is a Keras 3 optimizer object (`keras.optimizers.Adam()`), without importing Keras."""
    keras = sys.modules.get("keras")
    optimizers = getattr(keras, "optimizers", None)
    return optimizers is not None and isinstance(obj, optimizers.Optimizer)


#: The Keras optimizer classes `from_keras` maps, to the functions with their names and arguments.
_FROM_KERAS: dict[str, Callable[..., optax.GradientTransformation]] = {
    "Adam": Adam,
    "AdamW": AdamW,
    "SGD": SGD,
    "RMSprop": RMSprop,
    "Adagrad": Adagrad,
}


def from_keras(optimizer: Any) -> optax.GradientTransformation:
    """The optax transform of a Keras optimizer object, from its `get_config()`: Keras's arguments, as
    `meshfit.optimizers.Adam(...)` etc. take them (a learning-rate schedule of Keras's as the same
    `meshfit.optimizers.schedules` one), so it saves and loads as a name does.

    Raises:
        TypeError: an optimizer class with no meshfit function of its name, naming what to pass instead.
        ValueError: a setting meshfit does elsewhere or not at all (`use_ema`, `loss_scale_factor`,
            `gradient_accumulation_steps`, a schedule of another class).
    """
    name = type(optimizer).__name__
    build = _FROM_KERAS.get(name)
    if build is None:
        instead = f"meshfit.optimizers.get({name.lower()!r}, ...)" if name.lower() in _FACTORIES else "an optax one"
        raise TypeError(
            f"meshfit maps Keras's {sorted(_FROM_KERAS)} optimizers to optax. Received: keras.optimizers.{name}. "
            f"Pass {instead} as the optimizer instead."
        )
    config = optimizer.get_config()
    if config.get("gradient_accumulation_steps"):
        raise ValueError(
            f"Received: keras.optimizers.{name}(gradient_accumulation_steps="
            f"{config['gradient_accumulation_steps']}). Pass compile(gradient_accumulation_steps=...) instead."
        )
    for setting in ("use_ema", "loss_scale_factor"):
        if config.get(setting):
            raise ValueError(
                f"meshfit's optimizers have no `{setting}`. Received: keras.optimizers.{name}({setting}="
                f"{config[setting]!r}). Leave it unset, or pass an optax transformation that does it."
            )
    learning_rate = config["learning_rate"]
    if isinstance(learning_rate, dict):  # a serialized Keras schedule
        schedule = getattr(schedules, str(learning_rate.get("class_name")), None)
        if not (isinstance(schedule, type) and issubclass(schedule, schedules.LearningRateSchedule)):
            raise ValueError(
                f"meshfit.optimizers.schedules has no {learning_rate.get('class_name')!r}. Received it as "
                f"keras.optimizers.{name}'s learning_rate. Pass an optax schedule as the learning rate instead."
            )
        config["learning_rate"] = schedule.from_config(learning_rate["config"])
    accepted = inspect.signature(build).parameters
    # Keras holds its hyperparameters in float32: 0.003 comes back as 0.003000000026; the shortest decimal
    # of the same float32 is what the user wrote (and what `save` writes down).
    shortest = {k: float(str(np.float32(v))) for k, v in config.items() if type(v) is float}
    return build(**{key: shortest.get(key, value) for key, value in config.items() if key in accepted})
