"""The step methods of `meshfit.Model` a subclass may override (Keras 3's JAX trainer contract).

`train_step(state, data)`, `test_step` and `predict_step` are pure functions of the one `TrainState` pytree
and a batch; `fit`, `evaluate` and `predict` compile them under the model's strategy. Their defaults are
ordinary code built from `stateless_call` (the module's forward pass), `compute_loss` (the compiled loss),
`compute_metrics` and `get_metrics_result`: a GAN overrides `train_step` and keeps the rest, a model with an
extra loss term overrides `compute_loss` and calls `super().compute_loss(...)`. What they read of the built
steps is `StepParts`, which the model hands them once its first batch built the steps.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from meshfit import utils
from meshfit.core import precision
from meshfit.core.state import TrainState
from meshfit.steps.builtin import StepFunctions, forward
from meshfit.steps.custom_steps import MetricsLayout


class StepParts(NamedTuple):
    """What a model's step methods use, set when the steps are built.

    Attributes:
        adapter: the module adapter in the policy's compute dtype (`stateless_call`).
        policy: the dtype policy.
        compiled: the built-in steps: the compiled loss and metrics.
        layout: a custom step's `state.metrics` layout (None for the built-in steps).
    """

    adapter: Any
    policy: precision.DTypePolicy
    compiled: StepFunctions
    layout: MetricsLayout | None

    def metrics_layout(self) -> MetricsLayout:
        """The layout of a custom step's `state.metrics` (the built-in steps': the compiled accumulators)."""
        return self.layout if self.layout is not None else MetricsLayout(self.compiled, [])


class StepMethods:
    """The step methods of `meshfit.Model` (its base class): the training logic a subclass may override.

    The class using it provides `optimizer` (a `meshfit.optimizers.Optimizer`) and `_step_parts(what)`, the
    built steps' `StepParts` (raising, naming where `what` works, before they are built).
    """

    optimizer: Any

    def _step_parts(self, what: str) -> StepParts:
        raise NotImplementedError

    def stateless_call(self, params, model_state, x, training: bool = False, rng=None, method: str | None = None):
        """`(y_pred, model_state)`: the module's forward pass on these weights, pure (Keras's name).

        Runs under the compiled dtype policy (outputs in float32). `rng` is the step's key for modules that take one
        (Linen dropout: pass `state.rng`); NNX modules carry their random streams in `model_state`. `method` names
        another method of the module to call instead of `__call__` (a GAN's `generate`), as Flax's `apply(...,
        method=...)`.
        """
        parts = self._step_parts("stateless_call")
        return forward(parts.adapter, parts.policy, params, model_state, x, rng, training, method)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training: bool = True):
        """The scalar loss of a batch: the compiled loss (each output's loss times its weight, summed; 0 without one).
        Override it to add terms; `super().compute_loss(...)` is the compiled loss.

        The default `train_step` and `test_step` differentiate and log it. It sees only real rows (a partial batch
        at its real size).
        """
        del x, training
        return self._step_parts("compute_loss").compiled.compiled_loss(y, y_pred, sample_weight)[0]

    def compute_metrics(self, x, y, y_pred, sample_weight=None, *, metrics_state, loss):
        """`metrics_state` (a custom step's `state.metrics`) with one batch added to the loss tracker
        (`loss`, averaged over the epoch) and the compiled metrics; pure. Read the values with
        `get_metrics_result`."""
        del x
        layout = self._step_parts("compute_metrics").metrics_layout()
        return layout.update_compiled(metrics_state, loss, y, y_pred, sample_weight)

    def get_metrics_result(self, metrics_state) -> dict:
        """Every metric's value for these accumulators: the loss, the compiled metrics, then each
        tracker of `self.metrics` by name (`metric.stateless_result`)."""
        return self._step_parts("get_metrics_result").metrics_layout().result(metrics_state)

    def train_step(self, state: TrainState, data) -> tuple[dict, TrainState]:
        """One training step on the global batch `data`: `(logs, state)`, pure (Keras 3's JAX contract).

        `data` is `x`, `(x, y)` or `(x, y, sample_weight)` (unpack it with
        `meshfit.utils.unpack_x_y_sample_weight`); `state` is a `meshfit.TrainState`. Compiled once per batch shape
        under the model's strategy; meshfit advances `state.step` after it. Overriding it (or `compute_loss`,
        `test_step`, `predict_step`) makes the model's steps these methods (`meshfit.steps.custom_steps`); otherwise
        meshfit runs its built-in steps, which compute the same and also train on a padded partial batch without
        recompiling.
        """
        x, y, sample_weight = utils.unpack_x_y_sample_weight(data)

        def loss_fn(params):
            y_pred, model_state = self.stateless_call(params, state.model_state, x, training=True, rng=state.rng)
            loss = self.compute_loss(x, y, y_pred, sample_weight, training=True)
            return loss, (y_pred, model_state)

        (loss, (y_pred, model_state)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        params, opt_state = self.optimizer.stateless_apply(state.opt_state, grads, state.params)
        metrics = self.compute_metrics(x, y, y_pred, sample_weight, metrics_state=state.metrics, loss=loss)
        state = state._replace(params=params, model_state=model_state, opt_state=opt_state, metrics=metrics)
        return self.get_metrics_result(metrics), state

    def test_step(self, state: TrainState, data) -> tuple[dict, TrainState]:
        """One evaluation step: `(logs, state)` with `state.metrics` updated (no optimizer state)."""
        x, y, sample_weight = utils.unpack_x_y_sample_weight(data)
        y_pred, _ = self.stateless_call(state.params, state.model_state, x, training=False)
        loss = self.compute_loss(x, y, y_pred, sample_weight, training=False)
        metrics = self.compute_metrics(x, y, y_pred, sample_weight, metrics_state=state.metrics, loss=loss)
        return self.get_metrics_result(metrics), state._replace(metrics=metrics)

    def predict_step(self, state: TrainState, data):
        """The outputs for the batch `data` (its `x`)."""
        x, _, _ = utils.unpack_x_y_sample_weight(data)
        return self.stateless_call(state.params, state.model_state, x, training=False)[0]
