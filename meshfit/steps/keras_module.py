"""The module adapter for Keras 3 models (`KERAS_BACKEND=jax`): Sequential, functional and subclassed.

Keras 3 on JAX already makes a model a pure function: `model.stateless_call(trainable, non_trainable, x,
training=...)` returns the outputs and the new non-trainable values (BatchNormalization's moving statistics,
a seed generator's state). `KerasAdapter` gives it the face the steps read (`meshfit.steps.modules`):

- `params`: the trainable variables, a nested dict by their paths (`"sequential/dense/kernel"` is
  `params["sequential"]["dense"]["kernel"]`), so a rule on paths shards them (`MeshStrategy(rules=...)`, and
  a `keras.distribution.LayoutMap`'s items, which are rules on the same paths);
- `model_state`: `{"weights": ..., "rngs": ...}`, the other variables by path: non-trainable weights
  (moving statistics, frozen layers' kernels) and seed generators' states, which every training step
  carries on and a backup saves, so a resume draws the dropout masks the uninterrupted run draws.

The forward pass passes the batch's inputs as one argument (a list or dict as it is), with `training` set as
Keras's `fit` sets it. Keras is imported only once a Keras model is given: `import meshfit` does not.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Collection
from typing import Any

from meshfit.core import compat

Pytree = Any

#: Modules of Keras 2 (tf.keras) classes: models meshfit cannot call on JAX.
_KERAS_2 = ("tf_keras", "tensorflow", "keras.engine", "keras.src.engine")
#: The arguments Keras's `fit` fills in itself when a model's `call` takes them (`keras.Layer.__call__`).
_FILLED_BY_KERAS = ("training", "mask")
#: The step methods of `keras.Model` a subclass may override, which meshfit's compiled steps never call
#: (a `meshfit.Model` subclass overrides the same names: `meshfit.steps.custom_steps.STEP_METHODS`).
_KERAS_STEP_METHODS = ("train_step", "test_step", "predict_step", "compute_loss")


def is_keras_model(obj: Any) -> bool:
    """Whether `obj` is a Keras 3 layer or model (without importing Keras: one given is imported already).

    Raises:
        TypeError: `obj` is a Keras 2 (`tf.keras`) model, which meshfit cannot call on JAX.
    """
    for cls in type(obj).__mro__:
        module = cls.__module__ or ""
        if cls.__name__ in ("Layer", "Model") and module.startswith(_KERAS_2):
            raise TypeError(
                f"meshfit trains Keras 3 models on the JAX backend. Received: {type(obj).__name__} from "
                f"{module} (Keras 2 / tf.keras). Build the model with Keras 3 (`import keras`, version >= 3) "
                "under KERAS_BACKEND=jax."
            )
    keras = sys.modules.get("keras")
    return keras is not None and hasattr(keras, "Layer") and isinstance(obj, keras.Layer)


def check_keras_backend(model: Any) -> None:
    """Raises unless Keras runs on JAX (its variables are then JAX arrays a compiled step can take)."""
    import keras

    backend = keras.backend.backend()
    if backend != "jax":
        raise ValueError(
            f"meshfit trains Keras models on the JAX backend. Received: model {model.name!r} under "
            f"keras.backend.backend()={backend!r}. Set KERAS_BACKEND=jax before the first `import keras`."
        )


def _unbuilt(model: Any) -> bool:
    return not model.built or any(not layer.built for layer in compat.keras_layers(model))


def _build(model: Any, sample_input: Any) -> None:
    """Builds `model`'s variables by calling it on `sample_input` in inference mode, as Keras's own message for an
    unbuilt model says to ("calling the model on a batch of data is the right way to build it")."""
    model(sample_input, training=False)


def _check_call(model: Any) -> None:
    """Raises unless `model.call` takes the batch's inputs as its one required argument, as Keras's `fit` calls it
    (`training` and `mask` need no default: Keras fills them in, and so does `stateless_call(training=...)`)."""
    try:
        parameters = list(inspect.signature(model.call).parameters.values())
    except (TypeError, ValueError):  # no signature to read: let the first call say
        return
    required = [
        p.name
        for p in parameters
        if p.default is p.empty
        and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and p.name not in _FILLED_BY_KERAS
    ]
    if len(required) > 1:
        raise TypeError(
            f"meshfit calls a Keras model as Keras's fit does, with a batch's inputs as one argument. Received: "
            f"model {model.name!r} whose call requires {required}. Take the inputs as one argument (a list or "
            "dict: call(self, inputs)) and give the others defaults."
        )


def _check_steps(model: Any, own_steps: Collection[str]) -> None:
    """Raises if `model`'s class overrides a step method of `keras.Model` that the `meshfit.Model` wrapping it does
    not override itself (`own_steps`): meshfit compiles its own steps around `stateless_call`, so Keras's would
    silently go unused."""
    import keras

    if not isinstance(model, keras.Model):
        return
    overridden = [
        name
        for name in _KERAS_STEP_METHODS
        if getattr(type(model), name, None) is not getattr(keras.Model, name) and name not in own_steps
    ]
    if overridden:
        name = overridden[0]
        raise TypeError(
            f"Keras model class {type(model).__name__} overrides {name}, which meshfit never calls (it compiles "
            f"its own steps around the model's forward pass), so the override would silently go unused. Write it "
            f"as the {name} of a meshfit.Model subclass (`class MyModel(mf.Model)`; docs/keras.md, 'Bring your "
            "Keras model', ports a Keras 3 JAX-style train_step) and wrap the Keras model in it: "
            "MyModel(keras_model). Or drop the override."
        )


def _check_strategy(model: Any, strategy: Any) -> None:
    """Raises under a strategy that pipelines over a `stage` axis: a Keras model holds no `Stages` stack."""
    stages = getattr(strategy, "stages", 1)
    if stages > 1:
        raise ValueError(
            f"Keras model {model.name!r} ({type(model).__name__}) cannot run pipelined over MeshStrategy's "
            f"'stage' axis (size {stages}): pipeline stages run a Flax module's meshfit.pipeline.Stages stack, "
            "which a Keras model does not hold. Train a Keras model over the 'data', 'fsdp' and 'tensor' axes "
            "(or another strategy), or write the pipelined blocks in Flax with meshfit.pipeline.Stages."
        )


def _check_layers(model: Any) -> None:
    """Raises for layers that `jax.jit` cannot trace (Keras marks them `supports_jit=False`: the TensorFlow
    lookups and text layers, and image augmentations such as RandomCrop or RandomZoom)."""
    unjittable = [layer for layer in compat.keras_layers(model) if not getattr(layer, "supports_jit", True)]
    if unjittable:
        layer = unjittable[0]
        raise ValueError(
            f"Model {model.name!r} holds layer {layer.name!r} ({type(layer).__name__}), which Keras marks "
            "supports_jit=False: jax.jit cannot trace it, so it cannot run inside meshfit's compiled step. Apply "
            "it in the input pipeline before fit (e.g. a tf.data or grain map, or on the numpy arrays) and give "
            "meshfit the model without it."
        )


def _paths(variables: list, model: Any) -> list[str]:
    paths = [v.path for v in variables]
    doubles = sorted({p for p in paths if paths.count(p) > 1})
    if doubles:
        raise ValueError(
            f"Model {model.name!r} has several variables with the path {doubles[0]!r}; meshfit names each weight by "
            "its path. Give the layers distinct names (name=...)."
        )
    return paths


def nest(paths: list[str], values: list) -> dict:
    """A nested dict of `values` by their '/'-separated `paths` (`"a/b"` -> `{"a": {"b": value}}`)."""
    tree: dict = {}
    for path, value in zip(paths, values, strict=True):
        *parents, leaf = path.split("/")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"A Keras variable's path {path!r} passes through another variable's path.")
        if leaf in node:
            raise ValueError(f"A Keras variable's path {path!r} is also the path of a layer's variables.")
        node[leaf] = value
    return tree


def unnest(paths: list[str], tree: dict) -> list:
    """The values of `tree` (from `nest`) in the order of `paths`."""
    values = []
    for path in paths:
        node: Any = tree
        for part in path.split("/"):
            node = node[part]
        values.append(node)
    return values


class KerasAdapter:
    """Wraps a built Keras 3 model (or one `sample_input` builds); see the module docstring.

    The face of `meshfit.steps.modules.ModuleAdapter` (which `modules.adapt` picks this adapter from). Which
    variables are trainable is read once, here: set `layer.trainable` before `meshfit.Model(model)`.
    """

    #: Keras models carry their seed generators' states in `model_state["rngs"]`: the step passes no key.
    uses_rng = False
    #: The variables exist (a Keras model is built before it is wrapped): `init` returns their values.
    creates = False

    def __init__(
        self, model: Any, sample_input: Any = None, own_steps: Collection[str] = (), strategy: Any = None
    ) -> None:
        check_keras_backend(model)
        _check_steps(model, own_steps)
        _check_strategy(model, strategy)
        if _unbuilt(model):
            if sample_input is None:
                raise ValueError(
                    f"Keras model {model.name!r} is not built: its variables do not exist yet. Call "
                    "model.build(input_shape), start it from keras.Input(...), or pass "
                    "meshfit.Model(model, sample_input=x[:1]) to build it from a batch as Keras's fit does."
                )
            _check_call(model)
            _build(model, sample_input)
        _check_call(model)
        _check_layers(model)
        self.module = model
        self._trainable = list(model.trainable_variables)
        weights = {id(v) for v in model.non_trainable_weights}
        self._non_trainable = list(model.non_trainable_variables)
        self._trainable_paths = _paths(self._trainable, model)
        self._non_trainable_paths = _paths(self._non_trainable, model)
        self._is_weight = [id(v) in weights for v in self._non_trainable]

    def abstract_init(self) -> tuple[Pytree, Pytree]:
        """`(params, model_state)` as `jax.ShapeDtypeStruct`s."""
        import jax

        return jax.eval_shape(self.init)

    def partition_specs(self) -> None:
        """None: a Keras variable carries no sharding metadata meshfit reads (rules on paths lay it out)."""
        return None

    def init(self, shardings: tuple[Pytree, Pytree] | None = None) -> tuple[Pytree, Pytree]:
        """`(params, model_state)`: the variables' current values (`shardings` unused: they exist already)."""
        params = nest(self._trainable_paths, [v.value for v in self._trainable])
        return params, self._model_state([v.value for v in self._non_trainable])

    def _model_state(self, values: list) -> dict:
        """`{"weights": ..., "rngs": ...}` of the non-trainable variables' `values` (in their order)."""
        parts: dict[str, tuple[list, list]] = {"weights": ([], []), "rngs": ([], [])}
        for path, value, weight in zip(self._non_trainable_paths, values, self._is_weight, strict=True):
            paths, kept = parts["weights" if weight else "rngs"]
            paths.append(path)
            kept.append(value)
        return {key: nest(paths, kept) for key, (paths, kept) in parts.items()}

    def _non_trainable_values(self, model_state: Pytree) -> list:
        """The non-trainable variables' values from `model_state`, in `stateless_call`'s order."""
        kinds = list(zip(self._non_trainable_paths, self._is_weight, strict=True))
        weights = iter(unnest([path for path, weight in kinds if weight], model_state["weights"]))
        rngs = iter(unnest([path for path, weight in kinds if not weight], model_state["rngs"]))
        return [next(weights) if weight else next(rngs) for weight in self._is_weight]

    def apply(
        self,
        params: Pytree,
        model_state: Pytree,
        x: Any,
        *,
        training: bool,
        rng: Any,
        method: str | None = None,
    ) -> tuple[Any, Pytree]:
        del rng  # Keras models carry their seed generators' states in model_state["rngs"].
        if method is not None:
            raise ValueError(
                f"stateless_call(method=...) calls a Flax module's method; a Keras model is called whole. "
                f"Received: method={method!r} for Keras model {self.module.name!r}."
            )
        y_pred, non_trainable, losses = self.module.stateless_call(
            unnest(self._trainable_paths, params),
            self._non_trainable_values(model_state),
            x,
            training=training,
            return_losses=True,
        )
        if losses:
            raise ValueError(
                f"Keras model {self.module.name!r} adds losses of its own (a kernel_regularizer, an "
                "activity_regularizer or add_loss), which meshfit's compiled loss does not add. Drop them and add "
                "the penalty in a compute_loss override (see docs/keras.md, 'Bring your Keras model')."
            )
        if not training:
            return y_pred, model_state
        return y_pred, self._model_state(list(non_trainable))

    def non_trainable_weights(self, model_state: Pytree) -> Pytree:
        return model_state["weights"]

    def sync_module(self, params: Pytree, model_state: Pytree) -> Any:
        """The Keras model, each of its variables assigned a copy of the state's value, so Keras's own `predict`
        and `save` see the trained values. A copy: Keras's compiled functions donate the arrays its variables
        hold, which would delete the state's."""
        values = unnest(self._trainable_paths, params) + self._non_trainable_values(model_state)
        for variable, value in zip(self._trainable + self._non_trainable, values, strict=True):
            variable.assign(value.copy())
        return self.module

    def with_compute_dtype(self, dtype: Any) -> KerasAdapter:
        import jax.numpy as jnp

        if jnp.dtype(dtype) != jnp.float32:
            raise ValueError(
                f"A Keras model computes in its layers' own dtype policy. Received: compile(dtype_policy=...) "
                f"computing in {jnp.dtype(dtype).name} for Keras model {self.module.name!r}. Call "
                "keras.mixed_precision.set_dtype_policy('mixed_bfloat16') before building the model instead."
            )
        return self


def adapter(
    model: Any,
    sample_input: Any = None,
    trainable: Any = None,
    own_steps: Collection[str] = (),
    strategy: Any = None,
) -> KerasAdapter:
    """The adapter of a Keras model (`meshfit.steps.modules.adapt`), refusing NNX's `trainable` filter.

    `own_steps`: the step methods the `meshfit.Model` subclass wrapping it overrides (a Keras override of one of
    those names is then ported, not ignored); `strategy`: the model's (a `stage` axis is refused)."""
    if trainable is not None:
        raise TypeError(
            "`trainable` takes an NNX filter and applies to flax.nnx modules. To freeze part of a Keras model, set "
            f"layer.trainable = False before meshfit.Model(model), as in Keras. Received: trainable={trainable!r}."
        )
    return KerasAdapter(model, sample_input, own_steps, strategy)
