"""Adapters that give Flax NNX and Linen modules (and Keras 3 models: `keras_module`) one pure, functional face.

The training step only ever sees `apply(params, model_state, x, training, rng)`
on plain pytrees (nested dicts of `jax.Array`), whatever API built the model.
`params` are the trainable variables; `model_state` holds everything else the
forward pass reads or updates (BatchNorm statistics, NNX RNG counters).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection
from typing import Any

import jax
from flax import linen, nnx
from flax.core import meta

from meshfit.core import compat
from meshfit.steps import keras_module

Pytree = Any


class ModuleAdapter:
    """What the training step needs from a model, independent of the Flax API."""

    module: Any
    #: Whether `apply` reads the `rng` argument (else the step skips splitting keys).
    uses_rng: bool = False

    @property
    def creates(self) -> bool:
        """Whether `init` creates the variables (a factory, Linen), rather than returning arrays that exist: the
        model may then put the creation off until the arrays are read (`StateStore`'s `create`)."""
        return False

    def abstract_init(self) -> tuple[Pytree, Pytree]:
        """`(params, model_state)` as `jax.ShapeDtypeStruct`s: what `init` returns, without creating it."""
        return jax.eval_shape(self.init)

    def init(self, shardings: tuple[Pytree, Pytree] | None = None) -> tuple[Pytree, Pytree]:
        """Returns `(params, model_state)` as pure pytrees.

        Variables not created yet are created in one compiled function whose
        outputs have `shardings` (a `(params, model_state)` pair of sharding
        pytrees, or None for the default device), so none is ever whole on a
        device that the layout gives only a part of it.
        """
        raise NotImplementedError

    def apply(
        self,
        params: Pytree,
        model_state: Pytree,
        x: Any,
        *,
        training: bool,
        rng: jax.Array | None,
        method: str | None = None,
    ) -> tuple[Any, Pytree]:
        """Runs the forward pass; returns `(y_pred, new_model_state)`."""
        raise NotImplementedError

    def partition_specs(self) -> Pytree | None:
        """PartitionSpecs from the module's sharding metadata, shaped like `params` (or None)."""
        return None

    def non_trainable_weights(self, model_state: Pytree) -> Pytree:
        """The part of `model_state` that counts as weights (no RNG state)."""
        return model_state

    def sync_module(self, params: Pytree, model_state: Pytree) -> Any:
        """Returns the user's module object holding the given values."""
        raise NotImplementedError

    def with_compute_dtype(self, dtype: Any) -> ModuleAdapter:
        """This adapter with the forward pass computing in `dtype` where the module lets it choose.

        By default the same adapter: the step casts the parameters and floating
        inputs, and layers whose `dtype` is None follow them (Linen's).
        """
        del dtype
        return self


def _groups(trainable: Any) -> tuple:
    """Trainable parameters, RNG streams, then every other variable (BatchNorm statistics, frozen parameters)."""
    return (nnx.All(nnx.Param, trainable), nnx.RngState, ...)


def call_arguments(module: Any, x: Any, method: str | None = None) -> tuple[tuple, dict]:
    """How a batch's inputs are passed to `module(...)` (or its `method`), as Keras passes them.

    A list or tuple of arrays: as positional arguments. A dict whose keys all
    name parameters of the module's `__call__`: as keyword arguments. Anything
    else, another dict included: as one argument.
    """
    if isinstance(x, (list, tuple)):
        return tuple(x), {}
    if isinstance(x, dict) and x and method is None and _takes_keywords(type(module), tuple(x)):
        return (), dict(x)
    return (x,), {}


def _takes_keywords(module_type: type, keys: tuple) -> bool:
    parameters = inspect.signature(module_type.__call__).parameters
    named = {
        name
        for name, p in parameters.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    return all(isinstance(key, str) and key in named for key in keys)


class NNXAdapter(ModuleAdapter):
    """Wraps an `nnx.Module`; train/eval modes via `nnx.view` (Dropout, BatchNorm flags).

    With a `compute_dtype`, every submodule that has a `dtype` attribute
    (Linear, Conv, Embed, LayerNorm, attention, ...) computes in it: Flax
    modules fix their computation dtype when built (`nnx.Embed` takes its
    parameters' float32), so casting the parameters alone would not change it.
    The user's module is left as it is: the change is made on views.
    """

    def __init__(
        self,
        module: nnx.Module,
        compute_dtype: Any = None,
        factory: Callable[[], nnx.Module] | None = None,
        trainable: Any = nnx.Param,
    ) -> None:
        self.module = module
        self.compute_dtype = compute_dtype
        self.trainable = trainable
        self._groups = _groups(trainable)
        self._factory = factory  # creates the module's variables, until `init` has
        train_view = nnx.view(module, deterministic=False, use_running_average=False, raise_if_not_found=False)
        eval_view = nnx.view(module, deterministic=True, use_running_average=True, raise_if_not_found=False)
        if compute_dtype is not None:
            for view in (train_view, eval_view):
                for _, submodule in nnx.iter_modules(view):
                    if hasattr(submodule, "dtype"):
                        submodule.dtype = compute_dtype
        self._train_graphdef = nnx.split(train_view, *self._groups)[0]
        self._eval_graphdef = nnx.split(eval_view, *self._groups)[0]

    @classmethod
    def from_factory(cls, factory: Callable[[], nnx.Module], trainable: Any = nnx.Param) -> NNXAdapter:
        """An adapter for the module `factory()` returns, whose variables `init` creates (under `jax.jit`).

        Until then the module is abstract (`nnx.eval_shape`): its structure and
        sharding metadata, no arrays.
        """
        abstract = nnx.eval_shape(lambda: _checked_module(factory()))
        return cls(abstract, factory=factory, trainable=trainable)

    @property
    def creates(self) -> bool:
        return self._factory is not None

    def with_compute_dtype(self, dtype: Any) -> NNXAdapter:
        return NNXAdapter(self.module, dtype, trainable=self.trainable)

    def abstract_init(self) -> tuple[Pytree, Pytree]:
        return jax.eval_shape(lambda: _nnx_state(self.module, self._groups))

    def init(self, shardings: tuple[Pytree, Pytree] | None = None) -> tuple[Pytree, Pytree]:
        if self._factory is None:
            return _nnx_state(self.module, self._groups)
        factory, self._factory = self._factory, None
        create = compat.as_eager(lambda: _nnx_state(_checked_module(factory()), self._groups))  # as eagerly
        params, model_state = jax.jit(create, out_shardings=shardings)()
        self.sync_module(params, model_state)  # the abstract module now holds the created arrays
        return params, model_state

    def apply(
        self,
        params: Pytree,
        model_state: Pytree,
        x: Any,
        *,
        training: bool,
        rng: jax.Array | None,
        method: str | None = None,
    ) -> tuple[Any, Pytree]:
        del rng  # NNX modules carry their own RNG streams in model_state["rngs"].
        graphdef = self._train_graphdef if training else self._eval_graphdef
        module = nnx.merge(graphdef, params, model_state["rngs"], model_state["weights"])
        args, kwargs = call_arguments(self.module, x, method)
        y_pred = (module if method is None else getattr(module, method))(*args, **kwargs)
        if not training:
            return y_pred, model_state
        _, _, rngs, weights = nnx.split(module, *self._groups)
        return y_pred, {"weights": nnx.to_pure_dict(weights), "rngs": nnx.to_pure_dict(rngs)}

    def non_trainable_weights(self, model_state: Pytree) -> Pytree:
        return model_state["weights"]

    def partition_specs(self) -> Pytree | None:
        _, params, _, _ = nnx.split(self.module, *self._groups)
        return nnx.to_pure_dict(nnx.get_partition_spec(params))

    def sync_module(self, params: Pytree, model_state: Pytree) -> Any:
        # The pure dicts have the module's own paths (`_nnx_state`), so `nnx.update` sets each
        # variable's value in one walk: no split into `State`s first (a quarter of the time, which
        # every call of fit pays once at its end).
        for part in (params, model_state["rngs"], model_state["weights"]):
            if part:
                nnx.update(self.module, part)
        return self.module


def _nnx_state(module: nnx.Module, groups: tuple) -> tuple[Pytree, Pytree]:
    """`(params, model_state)` of an NNX module as pure dicts, split by `groups` (see `_groups`)."""
    _, params, rngs, weights = nnx.split(module, *groups)
    return nnx.to_pure_dict(params), {"weights": nnx.to_pure_dict(weights), "rngs": nnx.to_pure_dict(rngs)}


def _checked_module(module: Any) -> nnx.Module:
    if not isinstance(module, nnx.Module):
        raise TypeError(
            "A model factory must return a flax.nnx.Module (e.g. lambda: MLP(rngs=nnx.Rngs(0))). "
            f"Received: {type(module).__name__} from the factory."
        )
    return module


_TRAINING_FLAGS = {"train": True, "training": True, "is_training": True, "deterministic": False}


class LinenAdapter(ModuleAdapter):
    """Wraps a `linen.Module`, initialised from `sample_input`.

    A keyword of `__call__` named `train`, `training`, `is_training` or
    `deterministic` is set from the mode; collections other than `params`
    (e.g. `batch_stats`) are mutable during training.
    """

    def __init__(self, module: linen.Module, sample_input: Any, seed: int = 0) -> None:
        if sample_input is None:
            raise ValueError(
                "A Linen module needs `sample_input` to create its variables, e.g. "
                "mf.Model(module, sample_input=x_train[:1]). Received: sample_input=None."
            )
        self.module = module
        self.uses_rng = True
        self.sample_input = sample_input
        self.seed = seed
        names = inspect.signature(module.__call__).parameters
        self._flag = next((n for n in _TRAINING_FLAGS if n in names), None)

    def _mode_kwargs(self, training: bool) -> dict:
        if self._flag is None:
            return {}
        on = _TRAINING_FLAGS[self._flag]
        return {self._flag: on if training else not on}

    def _call(self, variables: Pytree, x: Any, method: str | None = None, **kwargs: Any) -> Any:
        args, by_name = call_arguments(self.module, x, method)
        return self.module.apply(variables, *args, **by_name, method=method, **kwargs)

    def _variables(self) -> Pytree:
        """The module's variables from `init`, boxed with their sharding metadata."""
        param_key, dropout_key = jax.random.split(jax.random.key(self.seed))
        args, kwargs = call_arguments(self.module, self.sample_input)
        rngs = {"params": param_key, "dropout": dropout_key}
        return self.module.init(rngs, *args, **kwargs, **self._mode_kwargs(False))

    def _split(self) -> tuple[Pytree, Pytree]:
        variables = dict(meta.unbox(self._variables()))
        params = variables.pop("params", {})
        return dict(params), variables

    @property
    def creates(self) -> bool:
        return True

    def abstract_init(self) -> tuple[Pytree, Pytree]:
        return jax.eval_shape(self._split)

    def init(self, shardings: tuple[Pytree, Pytree] | None = None) -> tuple[Pytree, Pytree]:
        return jax.jit(self._split, out_shardings=shardings)()

    def partition_specs(self) -> Pytree | None:
        if not hasattr(self, "_specs"):
            self._specs = linen.get_partition_spec(jax.eval_shape(self._variables)).get("params")
        return self._specs

    def apply(
        self,
        params: Pytree,
        model_state: Pytree,
        x: Any,
        *,
        training: bool,
        rng: jax.Array | None,
        method: str | None = None,
    ) -> tuple[Any, Pytree]:
        variables = {"params": params, **model_state}
        kwargs = self._mode_kwargs(training) if method is None else {}
        if not training:
            return self._call(variables, x, method, **kwargs), model_state
        mutable = list(model_state.keys())
        rngs = {} if rng is None else {"dropout": jax.random.wrap_key_data(rng)}
        y_pred, updated = self._call(variables, x, method, rngs=rngs, mutable=mutable, **kwargs)
        return y_pred, {**model_state, **dict(updated)}

    def sync_module(self, params: Pytree, model_state: Pytree) -> Any:
        return self.module.bind({"params": params, **model_state})


def adapt(
    module: Any,
    sample_input: Any = None,
    seed: int = 0,
    trainable: Any = None,
    own_steps: Collection[str] = (),
    strategy: Any = None,
) -> ModuleAdapter:
    """Picks the adapter for `module` (a module, or a factory of one), with a clear error for anything else.

    `trainable`: an NNX filter of the parameters to train (default all `nnx.Param`s);
    the others are frozen: kept with the non-trainable weights, never updated.
    A Keras 3 model gets `meshfit.steps.keras_module.KerasAdapter` (built from `sample_input` if unbuilt), which
    refuses Keras step overrides not among `own_steps` (the step methods the `meshfit.Model` subclass overrides)
    and a `strategy` that pipelines over a `stage` axis.
    """
    if keras_module.is_keras_model(module):
        return keras_module.adapter(module, sample_input, trainable, own_steps, strategy)
    if isinstance(module, linen.Module):
        if trainable is not None:
            raise TypeError(
                "`trainable` takes an NNX filter and applies to flax.nnx modules. To freeze part of a Linen "
                "model, give compile an optimizer that leaves it alone, e.g. optax.multi_transform({'train': "
                "optax.adam(1e-3), 'freeze': optax.set_to_zero()}, labels) with labels from the parameter paths."
            )
        return LinenAdapter(module, sample_input, seed)
    trainable = nnx.Param if trainable is None else trainable
    if isinstance(module, nnx.Module):
        return NNXAdapter(module, trainable=trainable)
    if callable(module):
        _check_factory(module)
        return NNXAdapter.from_factory(module, trainable)
    raise TypeError(
        "meshfit.Model expects a flax.nnx.Module, a flax.linen.Module, a Keras 3 model, or a factory: a function of "
        f"no arguments that returns an nnx.Module. Received: module of type {type(module).__name__}."
    )


def _check_factory(factory: Callable[..., Any]) -> None:
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin without a signature: let the call say
        return
    required = [
        p.name
        for p in signature.parameters.values()
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if required:
        raise TypeError(
            "A model factory is called with no arguments (e.g. mf.Model(lambda: MLP(rngs=nnx.Rngs(0)))). "
            f"Received: {getattr(factory, '__name__', factory)!r}, which requires {required}."
        )
