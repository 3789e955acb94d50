"""Adapters that give Flax NNX and Linen modules one pure, functional face.

The training step only ever sees `apply(params, model_state, x, training, rng)`
on plain pytrees (nested dicts of `jax.Array`), whatever API built the model.
`params` are the trainable variables; `model_state` holds everything else the
forward pass reads or updates (BatchNorm statistics, NNX RNG counters).
"""

from __future__ import annotations

import inspect
from typing import Any

import jax
from flax import linen, nnx
from flax.core import meta

Pytree = Any


class ModuleAdapter:
    """What the training step needs from a model, independent of the Flax API."""

    module: Any
    #: Whether `apply` reads the `rng` argument (else the step skips splitting keys).
    uses_rng: bool = False

    def init(self) -> tuple[Pytree, Pytree]:
        """Returns `(params, model_state)` as pure pytrees."""
        raise NotImplementedError

    def apply(self, params, model_state, x, *, training: bool, rng) -> tuple[Any, Pytree]:
        """Runs the forward pass; returns `(y_pred, new_model_state)`."""
        raise NotImplementedError

    def partition_specs(self) -> Pytree | None:
        """PartitionSpecs from the module's sharding metadata, shaped like `params` (or None)."""
        return None

    def non_trainable_weights(self, model_state) -> Pytree:
        """The part of `model_state` that counts as weights (no RNG state)."""
        return model_state

    def sync_module(self, params, model_state) -> Any:
        """Returns the user's module object holding the given values."""
        raise NotImplementedError

    def with_compute_dtype(self, dtype) -> ModuleAdapter:
        """This adapter with the forward pass computing in `dtype` where the module lets it choose.

        By default the same adapter: the step casts the parameters and floating
        inputs, and layers whose `dtype` is None follow them (Linen's).
        """
        del dtype
        return self


# Trainable parameters, RNG streams, then every other variable (BatchNorm statistics, ...).
_NNX_GROUPS = (nnx.Param, nnx.RngState, ...)


class NNXAdapter(ModuleAdapter):
    """Wraps an `nnx.Module`; train/eval modes via `nnx.view` (Dropout, BatchNorm flags).

    With a `compute_dtype`, every submodule that has a `dtype` attribute
    (Linear, Conv, Embed, LayerNorm, attention, ...) computes in it: Flax
    modules fix their computation dtype when built (`nnx.Embed` takes its
    parameters' float32), so casting the parameters alone would not change it.
    The user's module is left as it is: the change is made on views.
    """

    def __init__(self, module: nnx.Module, compute_dtype=None):
        self.module = module
        self.compute_dtype = compute_dtype
        train_view = nnx.view(module, deterministic=False, use_running_average=False, raise_if_not_found=False)
        eval_view = nnx.view(module, deterministic=True, use_running_average=True, raise_if_not_found=False)
        if compute_dtype is not None:
            for view in (train_view, eval_view):
                for _, submodule in nnx.iter_modules(view):
                    if hasattr(submodule, "dtype"):
                        submodule.dtype = compute_dtype
        self._train_graphdef = nnx.split(train_view, *_NNX_GROUPS)[0]
        self._eval_graphdef = nnx.split(eval_view, *_NNX_GROUPS)[0]

    def with_compute_dtype(self, dtype) -> NNXAdapter:
        return NNXAdapter(self.module, dtype)

    def init(self):
        _, params, rngs, weights = nnx.split(self.module, *_NNX_GROUPS)
        return nnx.to_pure_dict(params), {
            "weights": nnx.to_pure_dict(weights),
            "rngs": nnx.to_pure_dict(rngs),
        }

    def apply(self, params, model_state, x, *, training, rng):
        del rng  # NNX modules carry their own RNG streams in model_state["rngs"].
        graphdef = self._train_graphdef if training else self._eval_graphdef
        module = nnx.merge(graphdef, params, model_state["rngs"], model_state["weights"])
        y_pred = module(*x) if isinstance(x, tuple) else module(x)
        if not training:
            return y_pred, model_state
        _, _, rngs, weights = nnx.split(module, *_NNX_GROUPS)
        return y_pred, {"weights": nnx.to_pure_dict(weights), "rngs": nnx.to_pure_dict(rngs)}

    def non_trainable_weights(self, model_state):
        return model_state["weights"]

    def partition_specs(self):
        _, params, _, _ = nnx.split(self.module, *_NNX_GROUPS)
        return nnx.to_pure_dict(nnx.get_partition_spec(params))

    def sync_module(self, params, model_state):
        _, param_state, rng_state, weight_state = nnx.split(self.module, *_NNX_GROUPS)
        nnx.replace_by_pure_dict(param_state, params)
        nnx.replace_by_pure_dict(rng_state, model_state["rngs"])
        nnx.replace_by_pure_dict(weight_state, model_state["weights"])
        nnx.update(self.module, param_state, rng_state, weight_state)
        return self.module


_TRAINING_FLAGS = {"train": True, "training": True, "is_training": True, "deterministic": False}


class LinenAdapter(ModuleAdapter):
    """Wraps a `linen.Module`, initialised from `sample_input`.

    A keyword of `__call__` named `train`, `training`, `is_training` or
    `deterministic` is set from the mode; collections other than `params`
    (e.g. `batch_stats`) are mutable during training.
    """

    def __init__(self, module: linen.Module, sample_input, seed: int = 0):
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

    def _call(self, variables, x, **kwargs):
        args = x if isinstance(x, tuple) else (x,)
        return self.module.apply(variables, *args, **kwargs)

    def init(self):
        param_key, dropout_key = jax.random.split(jax.random.key(self.seed))
        args = self.sample_input if isinstance(self.sample_input, tuple) else (self.sample_input,)
        variables = jax.jit(
            lambda: self.module.init({"params": param_key, "dropout": dropout_key}, *args, **self._mode_kwargs(False))
        )()
        self._specs = linen.get_partition_spec(variables).get("params")
        variables = dict(meta.unbox(variables))
        params = variables.pop("params", {})
        return dict(params), variables

    def partition_specs(self):
        return getattr(self, "_specs", None)

    def apply(self, params, model_state, x, *, training, rng):
        variables = {"params": params, **model_state}
        kwargs = self._mode_kwargs(training)
        if not training:
            return self._call(variables, x, **kwargs), model_state
        mutable = list(model_state.keys())
        rngs = {"dropout": jax.random.wrap_key_data(rng)}
        y_pred, updated = self._call(variables, x, rngs=rngs, mutable=mutable, **kwargs)
        return y_pred, {**model_state, **dict(updated)}

    def sync_module(self, params, model_state):
        return self.module.bind({"params": params, **model_state})


def adapt(module, sample_input=None, seed: int = 0) -> ModuleAdapter:
    """Picks the adapter for `module`, with a clear error for anything else."""
    if isinstance(module, nnx.Module):
        return NNXAdapter(module)
    if isinstance(module, linen.Module):
        return LinenAdapter(module, sample_input, seed)
    raise TypeError(
        "meshfit.Model expects a flax.nnx.Module or a flax.linen.Module. "
        f"Received: module of type {type(module).__name__}."
    )
