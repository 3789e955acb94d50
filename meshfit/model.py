"""`meshfit.Model`: Keras's compile / fit / evaluate / predict for Flax modules.

The model's `Session` holds its one `TrainState` pytree on the devices its strategy chose, and the bookkeeping of
fits. This file is the Keras face: it checks arguments (every check runs before any state changes) and hands the
work on: `compile` to `meshfit.steps.compile_settings`, the first batch to `meshfit.training.step_builder`, data to
`meshfit.training.fit_inputs`, callbacks to `meshfit.training.callback_setup`, and the loops to
`meshfit.training.loop`. Its base classes hold `fit`, `evaluate`, `predict` and the `*_on_batch` calls
(`meshfit.training.trainer`, as Keras 3's `Trainer`), the step methods a subclass overrides
(`meshfit.steps.step_methods`) and the weights as Keras lists them (`meshfit.training.weights`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from meshfit import callbacks as callbacks_lib
from meshfit import mixed_precision
from meshfit import optimizers as optimizers_lib
from meshfit.checkpointing import saving
from meshfit.core import keras_names, precision
from meshfit.core.batch import Batch
from meshfit.core.state import TrainState
from meshfit.cost.step_report import StepReport
from meshfit.cost.summary import format_step_report, format_summary
from meshfit.data import sources as data_lib
from meshfit.runtime import cluster
from meshfit.steps import compile_settings
from meshfit.steps.compile_settings import CompileSettings
from meshfit.steps.custom_steps import STEP_METHODS
from meshfit.steps.modules import adapt
from meshfit.steps.step_methods import StepMethods, StepParts
from meshfit.strategies import get_strategy, has_strategy
from meshfit.training import fit_inputs
from meshfit.training.fit_context import FitContext
from meshfit.training.session import Session
from meshfit.training.step_builder import StepBuilder
from meshfit.training.trainer import Trainer
from meshfit.training.weights import Weights

__all__ = ["CompileSettings", "Model", "load_model"]


class Model(Trainer, StepMethods, Weights):
    """A Flax module with Keras's training API.

    Args:
        module: a `flax.nnx.Module` (variables already created), a factory of one (a function of no arguments, e.g.
            `lambda: MLP(rngs=nnx.Rngs(0))`: the variables are created straight into the strategy's layout, so a
            model larger than one device never exists whole on a device), or a `flax.linen.Module` (variables
            created from `sample_input`, in the layout too), or a Keras 3 model under `KERAS_BACKEND=jax` (Sequential,
            functional or subclassed; see "Bring your Keras model" in docs/keras.md). An eager module is moved into
            the layout and then holds the placed arrays (its own copies are freed; a Keras model gets copies back).
        sample_input: an example input batch; required for Linen modules, and builds an unbuilt Keras model.
        seed: seeds data shuffling, Linen initialisation and dropout. Same seed, same data -> bitwise identical
            training.
        trainable: for NNX modules, a filter of the parameters to train (default `nnx.Param`: all), e.g.
            `nnx.All(nnx.Param, nnx.PathContains("head"))` or `lambda path, value: path[0] == "head"`. The other
            parameters are frozen: no gradient, no optimizer state, no update; they are listed (and saved) with the
            non-trainable weights.
        abstract: shapes and layouts only: the parameters and the optimizer state are `jax.ShapeDtypeStruct`s with
            the strategy's shardings and nothing is created (a factory runs under `nnx.eval_shape` alone). Such a
            model compiles its train step and reports its cost (`step_report`) but cannot train, evaluate or
            predict: how `meshfit.plan` weighs layouts before any parameter exists.

    Example:
        >>> model = meshfit.Model(MLP(rngs=nnx.Rngs(0)))
        >>> model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
        ...               metrics=["accuracy"])
        >>> history = model.fit(x_train, y_train, batch_size=64, epochs=5,
        ...                     validation_split=0.1)
    """

    def __init__(
        self, module: Any, *, sample_input: Any = None, seed: int = 0, trainable: Any = None, abstract: bool = False
    ) -> None:
        self.strategy = get_strategy()
        self.abstract = bool(abstract)
        cluster.warn_if_launched_but_alone(self.strategy)
        self.seed = int(seed)
        self._adapter = adapt(
            module, sample_input, self.seed, trainable, own_steps=self._custom_methods(), strategy=self.strategy
        )
        hints = self._adapter.partition_specs()
        template = jax.eval_shape(self._initial_state, *self._adapter.abstract_init())

        def create() -> TrainState:
            shardings = self.strategy.state_shardings(template, hints)
            # Created straight into the strategy's layout where it has one (a factory, Linen), under the model's
            # strategy, whenever it runs: a factory may read the scope (`Stages`' layout).
            with self.strategy.scope():
                params, model_state = self._adapter.init(
                    None if shardings is None else (shardings.params, shardings.model_state)
                )
            return self.strategy.place_state(self._initial_state(params, model_state), hints)

        # A module whose variables are still to be created (a factory, Linen) is created when its arrays are
        # first read: a fit that restores a backup first never creates what it would overwrite.
        later = self.abstract or self._adapter.creates
        state = self.strategy.place_state(template, hints) if later else create()  # (laid out: shapes, shardings)
        #: The training state and the bookkeeping of fits (the one owner of both; see `meshfit.training.session`).
        self.session = Session(
            self.strategy,
            state,
            follow=None if self.abstract else self._follow_state,
            create=create if later and not self.abstract else None,
        )
        self._compiled: CompileSettings | None = None
        self.optimizer: optimizers_lib.Optimizer | None = None
        self.stop_training = False
        self.history: callbacks_lib.History | None = None
        self._shuffle_orders = data_lib.ShuffleOrders()  # computed ahead by one fit for the next
        self._inputs = fit_inputs.Inputs(self.strategy, self.seed, self._shuffle_orders)
        # The steps, built from the first batch; what the step methods below use once they are.
        self._builder = StepBuilder(self.session, self._adapter)

    def _initial_state(self, params: Any, model_state: Any) -> TrainState:
        return TrainState(
            params=params,
            model_state=model_state,
            opt_state=None,
            metrics=(),
            step=jnp.zeros((), jnp.int32),
            # Only modules that take an RNG argument (Linen) carry a key; NNX keeps its own streams.
            rng=jax.random.key_data(jax.random.key(self.seed)) if self._adapter.uses_rng else None,
        )

    def _follow_state(self, state: TrainState) -> None:
        """Points the user's module at the state's arrays (its own copies are then freed)."""
        self._adapter.sync_module(state.params, state.model_state)

    # -- state access ----------------------------------------------------------------

    @property
    def fit_context(self) -> FitContext:
        """The running fit as callbacks see it: optimizer steps taken, a settled state, the fit's
        position and `restore` (`meshfit.training.fit_context.FitContext`)."""
        return self.session.context

    def get_config(self) -> dict:
        """What the model is, as JSON: the module's class, the seed, the strategy and the compile record.

        Code is not JSON: rebuild the module yourself and `meshfit.load_model` (or `set_weights`) the weights into
        it. `"compile"` is `get_compile_config()` (None before `compile`).
        """
        module = type(self._adapter.module)
        return {
            "module": f"{module.__module__}.{module.__qualname__}",
            "seed": self.seed,
            "strategy": repr(self.strategy),
            "weights": {name: list(a.shape) for name, a in zip(self.weight_names(), self.weights, strict=True)},
            "compile": self.get_compile_config(),
        }

    def __call__(self, x: Any, training: bool = False) -> Any:
        """The outputs for one batch `x` as numpy, under the model's strategy (`predict_on_batch`).

        Keras's `model(x)`. Only inference: with `training=True` a forward pass would update no state here; train
        with `fit` or `train_on_batch`, or call `stateless_call` in a custom step.
        """
        if training:
            raise ValueError(
                "model(x) runs inference only. Received: training=True. Use fit / train_on_batch to train, or "
                "model.stateless_call(params, model_state, x, training=True) inside a custom train_step."
            )
        return self.predict_on_batch(x)

    def export(self, path: str | os.PathLike, overwrite: bool = False) -> None:
        """Writes the forward pass for serving, callable with JAX alone; see `meshfit.export`.

        `path` holds `forward.jax` (serialized StableHLO with a symbolic batch dimension) and `weights.npz`. An
        existing non-empty `path` is refused unless `overwrite=True`.
        """
        from meshfit import export as export_lib

        parts = self._builder.parts
        export_lib.export_forward(
            path,
            batch=self.session.example_batch,
            state=self.session.latest,
            strategy=self.strategy,
            adapter=None if parts is None else parts.adapter,
            policy=None if parts is None else parts.policy,
            overwrite=overwrite,
        )

    # -- compile -------------------------------------------------------------------------

    def compile(
        self,
        optimizer: str | optax.GradientTransformation | dict | None = "rmsprop",
        loss: Any = None,
        loss_weights: Any = None,
        metrics: Any = None,
        weighted_metrics: Any = None,
        run_eagerly: bool = False,
        steps_per_execution: int = 1,
        jit_compile: bool | str = "auto",
        auto_scale_loss: bool = True,
        dtype_policy: str | precision.DTypePolicy | None = None,
        gradient_accumulation_steps: int | None = None,
    ) -> None:
        """Configures the model for training (Keras's `compile`).

        Args:
            optimizer: an optimizer name ("adam", "sgd", ...; see `meshfit.optimizers.names()`) or an
                `optax.GradientTransformation`; or a dict of them keyed by the module's top-level attributes
                (`{"generator": "adam", "discriminator": "adam"}`): each trains only its part, `state.opt_state` and
                `model.optimizer` are dicts with the same keys (see "Customizing fit" in the docs). None: no
                optimizer and no optimizer state, for `evaluate` and `predict` only (`fit` asks for one);
                `load_model` compiles so a saved model whose optimizer `save` could not write down.
            loss: a loss name, a `meshfit.losses.Loss`, or a callable `(y_true, y_pred) -> per-sample losses`, or a
                scalar for the batch (Keras's value; computed on a partial batch's real rows by a step compiled per
                partial size: see `meshfit.training.executables`; refused where that cannot be exact). For a model
                with several outputs (a dict, list or tuple of arrays), one loss for every output, or a dict keyed
                by output name (a list in output order) of them; outputs left out have no loss. See
                `meshfit.outputs` for output names.
            loss_weights: a float (one output), or a dict/list per output of floats: the loss is the sum of each
                output's loss times its weight (unweighted: 1).
            metrics: a list of metric names, `meshfit.metrics.Metric` objects or callables. With several outputs, a
                dict keyed by output name (or a list in output order) of such lists; they are logged as
                `<output>_<metric>`.
            weighted_metrics: metrics that also use `sample_weight`, given like `metrics`.
            steps_per_execution: number of batches run inside one compiled call (a `lax.scan`); batch callbacks are
                called once per call.
            dtype_policy: Keras's policy names: "float32", "mixed_bfloat16", "mixed_float16" (with dynamic loss
                scaling) or "bfloat16" (weights kept in bfloat16 too); see `meshfit.core.precision`. None: the
                global policy (`meshfit.mixed_precision.set_global_policy`; "float32" unless set).
            gradient_accumulation_steps: apply the optimizer every K batches with the mean of their gradients (K
                batches of B rows train as one of K x B). The accumulators live in the optimizer state, so a backup
                taken mid-accumulation resumes exactly. An `optax.MultiSteps` optimizer does the same.
            run_eagerly: run the train, evaluate and predict steps un-jitted, op by op (under `jax.disable_jit()`),
                to debug them: a `print` or a breakpoint in a custom `train_step` runs at every step with concrete
                arrays. Same numbers as the compiled steps, far slower; `steps_per_execution` still groups batches
                (a Python loop over them). Under the parameter server, the workers' steps stay compiled.
            jit_compile: True or "auto" (the default): the steps are compiled with XLA. False: not compiled, which
                on JAX is what Keras does too: the same as `run_eagerly=True`.
            auto_scale_loss: Keras's switch for loss scaling under "mixed_float16": meshfit always scales there
                (True); False is refused under that policy and changes nothing under the others.
        """
        self._check_strategy("compile")
        if not isinstance(run_eagerly, bool):
            raise ValueError(f"`run_eagerly` must be True or False. Received: run_eagerly={run_eagerly!r}.")
        if jit_compile not in (True, False, "auto"):
            raise ValueError(f'`jit_compile` must be True, False or "auto". Received: jit_compile={jit_compile!r}.')
        resolution = compile_settings.resolve(
            optimizer,
            loss,
            loss_weights,
            metrics,
            weighted_metrics,
            steps_per_execution=steps_per_execution,
            dtype_policy=mixed_precision.global_policy() if dtype_policy is None else dtype_policy,
            gradient_accumulation_steps=gradient_accumulation_steps,
            auto_scale_loss=auto_scale_loss,
            run_eagerly=run_eagerly or jit_compile is False,
            strategy=self.strategy,
            params=self.session.template.params,
        )  # every argument checked: from here the model changes
        settings, hints = resolution.settings, self._adapter.partition_specs()
        created = self.session.pending
        if created is None:
            state = compile_settings.compiled_state(settings, self.session.latest, self.strategy, hints, self.abstract)
            self.session.reset(state)
        else:  # not created yet: nor is the optimizer state, until the arrays are read
            template = compile_settings.compiled_state(settings, self.session.template, self.strategy, hints, True)
            self.session.reset_later(
                template, lambda: compile_settings.compiled_state(settings, created(), self.strategy, hints, False)
            )
        self._compiled = settings
        self.optimizer = compile_settings.optimizer(resolution, self.session)

    @property
    def compiled(self) -> bool:
        return self._compiled is not None

    @property
    def run_eagerly(self) -> bool:
        """Whether the steps run un-jitted (`compile(run_eagerly=True)` or `jit_compile=False`)."""
        return self._compiled is not None and self._compiled.run_eagerly

    @property
    def jit_compile(self) -> bool:
        """Whether the steps are compiled with XLA (the opposite of `run_eagerly`)."""
        return not self.run_eagerly

    @property
    def compile_settings(self) -> CompileSettings | None:
        """What `compile` was given (None before `compile`)."""
        return self._compiled

    def get_compile_config(self) -> dict | None:
        """How the model was compiled, as the JSON `save` writes (None before `compile`), as in Keras.

        Names, meshfit's built-in losses and metrics, and optimizers from `meshfit.optimizers.get` are written down;
        anything else is recorded as `{"__custom__": description}`, for `load_model` to ask for again.
        """
        return saving.compile_record(self)

    def _check_strategy(self, what: str) -> None:
        current = get_strategy()
        if has_strategy() and current is not self.strategy:
            raise ValueError(
                f"This model was created under {self.strategy!r} but `{what}` was called under {current!r}. "
                "Create, compile and fit a model under the same strategy scope."
            )

    def _require_compiled(self, what: str) -> None:
        compile_settings.require(self._compiled, what, abstract=self.abstract, custom=self._custom_methods())

    def _custom_methods(self) -> set[str]:
        """The step methods (`meshfit.steps.custom_steps.STEP_METHODS`) this model's class overrides."""
        return {name for name in STEP_METHODS if getattr(type(self), name) is not getattr(Model, name)}

    def _needs_targets(self, own_step: str) -> bool:
        """Whether `fit`/`evaluate` need targets: not when the user's own `own_step` reads the batch."""
        return own_step not in self._custom_methods()

    def _build(self, batch: Batch) -> None:
        """Builds the steps from `batch` (the first), or checks `batch` against them (`StepBuilder.build`)."""

        def trackers() -> list:  # the metrics a subclass's `metrics` adds to the compiled ones
            return list(self.metrics) if type(self).metrics is not Model.metrics else []

        custom = self._custom_methods()
        self._builder.build(batch, self._compiled, custom=custom, model=self, trackers=trackers)

    def _check_input(self, batch: Batch) -> None:
        self._builder.check_input(batch, self._compiled)

    def _step_parts(self, what: str) -> StepParts:
        return self._builder.require_parts(what)

    @property
    def metrics_names(self) -> list[str]:
        """Keys of the logs: "loss" then each metric's name (after the first fit/evaluate)."""
        return self.session.steps.metric_names if self.session.built else []

    @property
    def metrics(self) -> list:
        """The compiled metric objects (after the first fit/evaluate)."""
        steps = self.session.steps
        return steps.metrics if steps is not None else []

    # The default callbacks of `fit` (`Trainer`), from the layer above the training package.
    _history_class = callbacks_lib.History
    _progbar_class = callbacks_lib.ProgbarLogger

    def step_report(self, x: Any = None, y: Any = None) -> StepReport:
        """What one training step costs per device, from XLA's analyses of the compiled step.

        FLOPs, bytes accessed, memory (arguments, outputs, temporaries, peak) and the bytes of each kind of
        collective of the train step, under the model's strategy. With `x` and `y` (one global batch: every row of
        them), for a batch shaped like that one, before any training: a model that does not fit shows it here,
        nothing runs. Without them, for the batch shape the model was built with by its first `fit` or `evaluate`.
        Compiles the step once per batch shape; runs nothing.
        """
        self._require_compiled("step_report")
        if x is not None:
            if y is None:
                raise ValueError("step_report(x, y) needs targets `y` for the loss, shaped like a batch of them.")
            data = self._inputs.source(x, y, None, len(jax.tree.leaves(x)[0]), what="step_report")
            self._build(self._inputs.first_batch(data))
            return self.session.step_report(self._inputs.first_batch(data))
        batch = self.session.example_batch
        trains_on_it = bool({"train_step", "compute_loss"} & self._custom_methods()) or (
            batch is not None and batch.y is not None and self.compile_settings.loss is not None
        )
        if not self.session.built or batch is None or not trains_on_it:
            raise ValueError(
                "step_report() needs a model built for training: call fit() or evaluate() on data first, "
                "or pass a batch: step_report(x, y)."
            )
        return self.session.step_report(batch)

    def summary(self, print_fn: Callable[[str], Any] | None = print) -> str:
        """Prints a table of every weight: path, shape, dtype, count and bytes, with totals.

        After the first `fit`, also what a train step costs per device (`step_report()`): memory, FLOPs and the
        bytes of its collectives.
        """
        state = self.session.latest
        text = format_summary(
            type(self._adapter.module).__name__,
            self.strategy,
            self.weight_names(),
            state.params,
            self._adapter.non_trainable_weights(state.model_state),
            state.opt_state,
        )
        batch = self.session.example_batch
        if self.session.built and batch is not None and batch.y is not None and self.compile_settings.loss is not None:
            text += "\n" + format_step_report(self.session.step_report(batch))
        if print_fn is not None:
            print_fn(text)
        return text

    def save(
        self,
        path: str | os.PathLike | None = None,
        overwrite: bool = True,
        zipped: bool | None = None,
        *,
        filepath: str | os.PathLike | None = None,
    ) -> None:
        """Saves weights, optimizer state, step and compile settings (Orbax); see `meshfit.load_model`.

        `path` (Keras's `filepath=` too) is a directory: `"model.keras"` makes a directory of that name. Keras's
        `zipped=False` is what meshfit writes; `zipped=True` is refused (zip the directory yourself).

        The compile settings are written as JSON: names, meshfit's built-in losses and metrics with their arguments
        (`SparseCategoricalCrossentropy( from_logits=True)`), and optimizers from `meshfit.optimizers.get` with JSON
        arguments (`get("adam", learning_rate=3e-3)`), so `load_model(path, module)` evaluates, predicts and trains
        on with nothing passed again. Code cannot be saved: a custom loss or metric (a function, a class of your
        own), a raw optax transformation or a learning-rate schedule is recorded by name only, and `load_model` asks
        for it again (as Keras asks for custom objects).

        A model saved at `path` before is replaced, as in Keras (`overwrite=False` refuses with a FileExistsError);
        the old copy is deleted only once the new one is complete, so a crash mid-save leaves one of them whole. A
        directory meshfit did not write, or of saved weights or checkpoints, is refused.
        """
        path = keras_names.alias("Model.save", "filepath", filepath, "path", path)
        if path is None:
            raise TypeError("Model.save() needs where to save: `path=` (or Keras's `filepath=`).")
        if zipped:
            keras_names.refuse("Model.save", "zipped", zipped)
        saving.save_model(self, path, overwrite=overwrite)

    def save_weights(self, path: str | os.PathLike, overwrite: bool = True) -> None:
        """Saves the weights (Orbax), replacing weights saved at `path` before, as `save` replaces a model."""
        saving.save_weights(self, path, overwrite=overwrite)

    def load_weights(self, path: str | os.PathLike) -> None:
        """Loads weights saved by `save_weights`, `save`, `ModelCheckpoint` or `BackupAndRestore`, onto this
        model's layout."""
        saving.load_weights(self, path)

    def __repr__(self) -> str:
        return f"Model({type(self._adapter.module).__name__}, strategy={self.strategy!r})"


def load_model(
    path: str | os.PathLike,
    module: Any,
    *,
    sample_input: Any = None,
    seed: int = 0,
    trainable: Any = None,
    compile: bool = True,
    **compile_kwargs: Any,
) -> Model:
    """Loads a model saved with `model.save` into `module` (same architecture).

    The model is compiled as it was saved (optimizer, loss, metrics, dtype policy, ...) and its optimizer state and
    step are restored, so it evaluates and predicts to the same numbers, and trains on as the saved one would, with
    nothing passed again. A loss or metric `model.save` could not write down (a user's function or class) must be
    passed again: without it, a `ValueError` names it before anything is loaded, rather than compiling with
    something else (Keras raises too). An optimizer it could not write down (an optax transformation, or `get` with
    an optax schedule; a schedule of `meshfit.optimizers.schedules` is written down) is left out, with a warning:
    the model is compiled with `optimizer=None`, so `evaluate` and `predict` work and `fit` asks for it; passed
    again (`optimizer=...`), it continues from the saved optimizer state and step. `compile=False` loads the weights
    alone.

    A checkpoint of another architecture or optimizer is refused with a `ValueError` naming the arrays that differ;
    nothing on disk changes.

    Args:
        path: the directory `model.save` wrote.
        module: a Flax module of the saved architecture (its values are replaced), or a factory of one (see
            `Model`): the restored arrays go straight into the layout.
        sample_input: for Linen modules, as in `Model`.
        seed: as in `Model`.
        trainable: as in `Model` (the parameters it freezes load as saved).
        compile: compile the model as it was saved, `compile_kwargs` overriding its settings; the optimizer state
            and step are restored too. With False, only the weights load (`predict` works; call `compile` to
            evaluate or train).
        **compile_kwargs: arguments for `Model.compile`, each replacing the saved setting of that name: e.g.
            `loss=my_loss` for a custom loss.

    Returns:
        A `meshfit.Model` under the current strategy.

    Example:
        >>> model.compile(optimizer=meshfit.optimizers.get("adam", learning_rate=3e-3),
        ...               loss=meshfit.losses.SparseCategoricalCrossentropy(from_logits=True),
        ...               metrics=["accuracy"])
        >>> model.save("/tmp/model")
        >>> loaded = meshfit.load_model("/tmp/model", MLP(rngs=nnx.Rngs(0)))
        >>> loaded.evaluate(x, y)  # the numbers model.evaluate(x, y) gives
    """

    def build() -> Model:  # called once the saved record is read and checked
        return Model(module, sample_input=sample_input, seed=seed, trainable=trainable)

    return saving.load_saved_model(path, build, compile=compile, **compile_kwargs)
