"""A `Model` subclass's own training logic as the steps the strategies compile (Keras 3's JAX contract).

A subclass of `meshfit.Model` that overrides `train_step(state, data)`,
`test_step(state, data)`, `predict_step(state, data)` or `compute_loss(...)`
is built into `ModelSteps`: an object of the `meshfit.steps.builtin.Steps` contract,
compiled by `meshfit.training.executables.Executables` through the strategy exactly as
the built-in `StepFunctions` are, with the staged and K-step programs of
`ScannedSteps`. Around each call of the user's method it does only what
meshfit owns: the batch as the user gave it (`x`, `(x, y)` or
`(x, y, sample_weight)`, a partial batch at its real rows), the random key of
the step, and the step count.

`MetricsLayout` is what `TrainState.metrics` holds for such a model: a dict
of the compiled loss and metrics' accumulators (`"compiled"`, where there are
any) and one entry per tracker of `Model.metrics` (by name), reset at every
epoch's start.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from meshfit import utils
from meshfit.core.batch import Batch
from meshfit.core.state import TrainState
from meshfit.steps.builtin import ScannedSteps, StepFunctions

#: The methods of `meshfit.Model` whose override makes a model's steps `ModelSteps`.
STEP_METHODS = ("train_step", "test_step", "predict_step", "compute_loss")
#: The key of the compiled loss and metrics' accumulators in a custom step's `state.metrics`.
COMPILED_KEY = "compiled"


class MetricsLayout:
    """What a custom step's `state.metrics` holds: `{"compiled": ..., tracker name: its accumulators}`.

    Args:
        compiled: the built-in steps whose accumulators hold the loss (a
            `Mean` over the epoch, weighted by rows), each output's loss and
            the compiled metrics; None when the model compiled none and
            computes no loss of its own.
        trackers: the metric objects of the user's `Model.metrics` other than
            the compiled ones (Keras's `Mean` trackers of a GAN's losses).
    """

    def __init__(self, compiled: StepFunctions | None, trackers: Sequence):
        names = [tracker.name for tracker in trackers]
        clashes = sorted({name for name in names if names.count(name) > 1 or name == COMPILED_KEY})
        if clashes:
            raise ValueError(
                f"Each metric of `Model.metrics` needs a name of its own (and not {COMPILED_KEY!r}): its "
                f"accumulators are `state.metrics[name]`. Received the names {names} (clashing: {clashes}). "
                "Name the trackers apart, e.g. meshfit.metrics.Mean(name='d_loss')."
            )
        self.compiled = compiled
        self.trackers = list(trackers)

    def init(self) -> dict:
        """Fresh accumulators."""
        fresh = {} if self.compiled is None else {COMPILED_KEY: self.compiled.init_metrics()}
        fresh.update({tracker.name: tracker.init() for tracker in self.trackers})
        return fresh

    def update_compiled(self, metrics_state: dict, loss, y, y_pred, sample_weight=None) -> dict:
        """`metrics_state` with one batch of real rows added to the compiled loss and metrics."""
        if self.compiled is None:
            return metrics_state
        updated = self.compiled.update_compiled_metrics(metrics_state[COMPILED_KEY], loss, y, y_pred, sample_weight)
        return {**metrics_state, COMPILED_KEY: updated}

    def result(self, metrics_state: dict) -> dict[str, jax.Array]:
        """Every metric's value: the compiled ones' logs, then each tracker's result."""
        logs = {} if self.compiled is None else dict(self.compiled.logs(metrics_state[COMPILED_KEY]))
        logs.update({tracker.name: tracker.compute(metrics_state[tracker.name]) for tracker in self.trackers})
        return logs


class ModelSteps(ScannedSteps):
    """The `meshfit.steps.builtin.Steps` of a `Model` subclass: its `train_step`, `test_step` and `predict_step`.

    Each training step calls `model.train_step(state, data)` once, on the
    global batch, with `state.rng` the step's own key (Linen modules; None for
    NNX); meshfit then sets the step count to one more than before and the
    key to the next one, whatever the returned state holds. A partial batch
    reaches the user's `train_step` and `test_step` at its real rows (a copy
    by `with_rows(n)`, compiled per real-row count); `predict_step` sees the
    padded batch, whose padding rows the loop drops.

    Args:
        model: the `meshfit.Model` whose methods are called (while tracing).
        layout: what `state.metrics` holds (`MetricsLayout`).
        uses_rng: whether the module takes a random key (Linen).
        scalar_losses: the outputs whose compiled loss returns a scalar (for messages).
    """

    needs_real_rows = True
    masks_padding = False

    def __init__(self, model, layout: MetricsLayout, uses_rng: bool, scalar_losses: Sequence[str] = ()):
        self.model = model
        self.layout = layout
        self.uses_rng = uses_rng
        self._scalar_losses = list(scalar_losses)
        self.rows: int | None = None  # set by `with_rows`: the user's steps see only these first rows

    @property
    def scalar_losses(self) -> list[str]:
        return list(self._scalar_losses)

    @property
    def metrics(self) -> list:
        """The metric objects whose accumulators `state.metrics` holds (compiled ones first)."""
        compiled = [] if self.layout.compiled is None else self.layout.compiled.metrics
        return compiled + self.layout.trackers

    @property
    def metric_names(self) -> list[str]:
        """The keys of `logs` (those of `Model.get_metrics_result`); a custom step may return others."""
        return list(jax.eval_shape(self.logs, jax.eval_shape(self.init_metrics)))

    def init_metrics(self) -> dict:
        return self.layout.init()

    def logs(self, metrics) -> dict[str, jax.Array]:
        return self.layout.result(metrics)

    def with_rows(self, rows: int) -> ModelSteps:
        """A copy whose `train_step` and `test_step` see the first `rows` rows of each batch (its real ones)."""
        steps = copy.copy(self)
        steps.rows = int(rows)
        return steps

    def with_replica_gradients(self, fn) -> ModelSteps:
        del fn
        raise ValueError(
            "A custom train_step computes its own gradients on the global batch, so a strategy cannot "
            "compute them per replica. Received: a strategy with reduction='explicit' (or gradient "
            "compression). Use reduction='auto' (the default without gradient_compression), under which "
            "XLA reduces the gradients of the step as written."
        )

    # -- the batch as the user gave it ----------------------------------------------------------

    def _data(self, batch: Batch, real_rows: bool = True):
        """`x`, `(x, y)` or `(x, y, sample_weight)` of `batch`: its real rows for `with_rows` copies."""
        if real_rows and self.rows is not None:
            batch = jax.tree.map(lambda a: a[: self.rows], batch)
        return utils.pack_x_y_sample_weight(batch.x, batch.y, batch.sample_weight)

    # -- steps ----------------------------------------------------------------------------------

    def train_step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
        rng, step_rng = state.rng, None
        if self.uses_rng:
            rng, step_rng = (jax.random.key_data(k) for k in jax.random.split(jax.random.wrap_key_data(rng)))
        given = state._replace(rng=step_rng)
        logs, new_state = _checked(self.model.train_step(given, self._data(batch)), given, "train_step")
        return new_state._replace(step=state.step + 1, rng=rng), dict(logs)

    def eval_step(self, variables, metrics, batch: Batch):
        state = _variables_state(variables, metrics)
        logs, new_state = _checked(self.model.test_step(state, self._data(batch)), state, "test_step")
        return new_state.metrics, dict(logs)

    def predict_step(self, variables, batch: Batch):
        return self.model.predict_step(_variables_state(variables, ()), self._data(batch, real_rows=False))


def _variables_state(variables, metrics) -> TrainState:
    """The `TrainState` an evaluation or prediction step sees: its weights and accumulators, no optimizer."""
    params, model_state = variables
    return TrainState(params, model_state, None, metrics, jnp.zeros((), jnp.int32), None)


def _checked(returned, state: TrainState, method: str) -> tuple[dict, TrainState]:
    """`(logs, state)` as a custom step returned them, or a `TypeError` saying what was expected (while tracing)."""
    if not (isinstance(returned, tuple) and len(returned) == 2 and isinstance(returned[0], dict)):
        raise TypeError(
            f"`{method}(state, data)` must return `(logs, state)`: a dict of scalars and a meshfit.TrainState "
            f"(Keras 3's JAX contract). Received: {type(returned).__name__}."
        )
    logs, new_state = returned
    if not isinstance(new_state, TrainState):
        raise TypeError(
            f"`{method}(state, data)` must return `(logs, state)` with `state` a meshfit.TrainState: "
            f"`state._replace(params=..., opt_state=..., metrics=...)`. Received: {type(new_state).__name__}."
        )
    for field in TrainState._fields:
        if field == "step":
            continue
        old, new = getattr(state, field), getattr(new_state, field)
        if jax.tree.structure(old) != jax.tree.structure(new):
            raise ValueError(
                f"`{method}` returned a state whose `{field}` is laid out differently from the one it was "
                f"given; a step must keep every field's structure (the step is compiled once). "
                f"Expected: {jax.tree.structure(old)}. Received: {jax.tree.structure(new)}."
            )
    return logs, new_state
