"""A model's steps, built from its first batch (Keras's `build` on first data).

The first batch tells what `compile` could not: the module's outputs (traced,
nothing runs), so the losses and metrics resolve per output
(`meshfit.outputs`), the targets' class-id ranges (`meshfit.data.label_check`),
and which losses return a scalar. `StepBuilder` checks every batch's inputs
and targets against them, refuses what the strategy or dtype policy cannot
compute before any state changes, and has the session compile the steps: the
built-in `StepFunctions`, or `ModelSteps` for a model whose class overrides
its step methods.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from meshfit import mixed_precision
from meshfit import outputs as outputs_lib
from meshfit.core import precision
from meshfit.core.batch import Batch
from meshfit.data import label_check
from meshfit.steps.builtin import StepFunctions, forward
from meshfit.steps.compile_settings import CompileSettings
from meshfit.steps.custom_steps import MetricsLayout, ModelSteps
from meshfit.steps.step_methods import StepParts
from meshfit.steps.terms import LossTerm, MetricTerm, Output
from meshfit.training.session import Session


class StepBuilder:
    """Builds a model's steps from its first batch into `session`, and checks every later batch.

    Args:
        session: the model's session (its state, strategy and compiled programs).
        adapter: the model's module adapter (`meshfit.steps.modules`), in float32.

    Attributes:
        outputs: the module's outputs, known from the first batch.
        label_ranges: the targets read as class ids, and how many classes each has.
        parts: what the step methods use (None before the steps are built).
    """

    def __init__(self, session: Session, adapter: Any) -> None:
        self.session = session
        self.adapter = adapter
        self.outputs: list[Output] = []
        self.label_ranges: tuple[label_check.LabelRange, ...] = ()
        self.parts: StepParts | None = None
        self._input_spec: Any = None
        self._built_with_targets = False  # the steps were built from a batch with targets

    def policy_adapter(self, settings: CompileSettings | None) -> tuple[Any, precision.DTypePolicy]:
        """The module adapter in the compiled dtype policy's compute dtype, and that policy.

        Every call meshfit makes of the module (output shapes, the steps, `predict`) goes through it, so a
        module that computes in bfloat16 only is never called with float32 activations or weights.
        Before `compile`, the global policy (`meshfit.mixed_precision`).
        """
        policy = mixed_precision.global_policy() if settings is None else settings.dtype_policy
        if policy.name == "float32":
            return self.adapter, policy
        return self.adapter.with_compute_dtype(policy.compute_dtype), policy

    def output_spec(self, batch: Batch, settings: CompileSettings | None) -> Any:
        """The outputs' shapes and dtypes for `batch`, traced (nothing runs) under the dtype policy as the step."""
        state = self.session.template  # shapes only: a state not created yet stays so
        adapter, policy = self.policy_adapter(settings)
        try:
            return jax.eval_shape(
                lambda p, s, x: forward(adapter, policy, p, s, x, None, False)[0],
                state.params,
                state.model_state,
                batch.x,
            )
        except (TypeError, ValueError) as error:
            shapes = jax.tree.map(lambda a: tuple(a.shape), batch.x)
            raise ValueError(f"The model could not be called on inputs of shape {shapes}: {error}") from error

    def check_input(self, batch: Batch, settings: CompileSettings | None) -> None:
        """Raises unless `batch`'s inputs have the feature shapes of the first batch's (or the model takes them)."""
        spec = jax.tree.map(lambda a: (tuple(a.shape[1:]), np.dtype(a.dtype).kind), batch.x)
        if self._input_spec is None:
            self.output_spec(batch, settings)  # a clear error here if the model rejects these inputs
            self._input_spec = spec
        elif jax.tree.structure(spec) != jax.tree.structure(self._input_spec):
            self.output_spec(batch, settings)  # inputs passed another way ([a, b], then {"a": a, "b": b})
        elif spec != self._input_spec:
            raise ValueError(
                "Input does not match the shape the model was built with: expected feature shape(s) "
                f"{_describe(self._input_spec)} (after the batch dimension), received {_describe(spec)}."
            )

    def build(
        self,
        batch: Batch,
        settings: CompileSettings,
        *,
        custom: set[str],
        model: Any,
        trackers: Callable[[], list],
    ) -> None:
        """Resolves losses and metrics per output from the first batch's shapes and compiles the steps once.

        Every batch's targets are checked against what the losses and metrics read. Steps built by
        `predict` (no targets) are built again at the first batch with targets only if a loss returns
        a scalar, which the steps must know and only the targets' shapes tell.

        Args:
            settings: the model's compile settings.
            custom: the step methods `model`'s class overrides (its steps are then `ModelSteps`).
            model: the `meshfit.Model` whose step methods `ModelSteps` calls.
            trackers: the metric objects of `model.metrics` a custom step updates itself.
        """
        self.check_input(batch, settings)
        if self.session.built:
            self._check_targets(batch, self.parts.compiled.losses, self.parts.compiled.metric_terms)
            if custom or not self._scalar_loss_found_late(batch, settings):
                return
        y_pred = self.output_spec(batch, settings)
        y_true = None if batch.y is None else jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batch.y)
        c = settings
        self.outputs = outputs = outputs_lib.outputs_of(y_pred)
        loss_terms = outputs_lib.resolve_losses(c.loss, c.loss_weights, outputs)
        metric_terms = outputs_lib.resolve_metrics(c.metrics, c.weighted, outputs, y_true, y_pred, c.loss_id)
        self._check_targets(batch, loss_terms, metric_terms)
        self.label_ranges = label_check.label_ranges(loss_terms, metric_terms, y_pred)
        adapter, policy = self.policy_adapter(settings)
        if custom:
            self._check_custom_steps(custom, policy, type(model).__name__)
            if y_true is not None:  # (a custom step sees a partial batch's real rows: nothing to refuse)
                loss_terms = outputs_lib.find_scalar_losses(loss_terms, y_true, y_pred)
        else:
            loss_terms = self._find_scalar_losses(loss_terms, y_true, y_pred)  # after every check of the arguments
        compiled = StepFunctions(adapter, loss_terms, c.tx, metric_terms, policy)
        steps, parts = compiled, StepParts(adapter, policy, compiled, None)
        if custom:
            keeps_compiled = c.loss is not None or bool(metric_terms) or "compute_loss" in custom
            own = [m for m in trackers() if all(m is not known for known in compiled.metrics)]
            layout = MetricsLayout(compiled if keeps_compiled else None, own)
            parts = parts._replace(layout=layout)
            steps = ModelSteps(model, layout, adapter.uses_rng, compiled.scalar_losses)
        self.session.build(steps, c.steps_per_execution, batch, eager=c.run_eagerly)  # raises before any change
        self.parts = parts
        self._built_with_targets = y_true is not None

    def require_parts(self, what: str) -> StepParts:
        """What the step methods use; raises, naming where `what` works, before the steps are built."""
        if self.parts is None:
            raise ValueError(
                f"`{what}` works once the model is built: call it inside `train_step`, `test_step` or "
                "`predict_step`, which `fit`, `evaluate` and `predict` compile after `compile()`."
            )
        return self.parts

    def _check_custom_steps(self, custom: set[str], policy: precision.DTypePolicy, owner: str) -> None:
        """Refuses, before any state changes, what a custom step cannot do under this strategy or policy."""
        overridden = ", ".join(sorted(custom))
        strategy = self.session.strategy
        if not strategy.capabilities.loss_scaling:
            raise ValueError(
                f"{owner} overrides {overridden}, a step computed in one piece on the global "
                f"batch; {strategy!r} splits each step between workers and a server. Train it under "
                "OneDeviceStrategy, MirroredStrategy, MultiWorkerMirroredStrategy or MeshStrategy, or use "
                "the built-in steps (no override) under the parameter server."
            )
        if policy.loss_scaling:
            raise ValueError(
                f"dtype_policy={policy.name!r} scales the loss inside the built-in step, and "
                f"{owner} overrides {overridden}. Use dtype_policy='mixed_bfloat16' "
                "(no loss scale needed), or the built-in steps."
            )

    def _check_targets(self, batch: Batch, loss_terms: Sequence[LossTerm], metric_terms: Sequence[MetricTerm]) -> None:
        if batch.y is None:
            return
        outputs_lib.check_targets(batch.y, [*loss_terms, *metric_terms], self.outputs)
        if outputs_lib.is_structure(batch.sample_weight):
            outputs_lib.check_targets(batch.sample_weight, loss_terms, self.outputs, "sample_weight")

    def _find_scalar_losses(self, terms: Sequence[LossTerm], y_true: Any, y_pred: Any) -> Sequence[LossTerm]:
        """The loss terms, with targets those returning a scalar marked, and refused (before any state
        changes) under a strategy that cannot compute them on a partial batch's real rows."""
        if y_true is None:
            return terms
        terms = outputs_lib.find_scalar_losses(terms, y_true, y_pred)
        scalar = [term.output.name or "output" for term in terms if term.scalar]
        strategy = self.session.strategy
        reason = strategy.capabilities.scalar_loss_refusal if scalar else None
        if reason:
            raise ValueError(
                f"Expected a loss that returns one value per sample under {strategy!r}: {reason}. "
                f"Received: a loss returning a scalar (shape ()) for {', '.join(map(repr, scalar))}. "
                "Return per-sample values (shape (batch,), e.g. `jnp.mean(..., axis=-1)` rather than "
                "`jnp.mean(...)`) and compile again, or train under OneDeviceStrategy, MirroredStrategy "
                "(reduction='auto') or a single-process MeshStrategy."
            )
        return terms

    def _scalar_loss_found_late(self, batch: Batch, settings: CompileSettings) -> bool:
        """Whether steps built without targets (by `predict`) must be built again for `batch`'s: only
        when a loss returns a scalar. Checked once, at the first batch with targets."""
        if self._built_with_targets or batch.y is None or settings.loss is None:
            return False
        y_pred = self.output_spec(batch, settings)
        y_true = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batch.y)
        terms = outputs_lib.resolve_losses(settings.loss, settings.loss_weights, outputs_lib.outputs_of(y_pred))
        terms = self._find_scalar_losses(terms, y_true, y_pred)  # may refuse: then checked again next time
        self._built_with_targets = True
        return any(term.scalar for term in terms)


def _describe(spec: Any) -> str:
    return str(
        jax.tree.map(
            lambda s: "(None, " + ", ".join(map(str, s[0])) + ")" if s[0] else "(None,)",
            spec,
            is_leaf=lambda s: isinstance(s, tuple) and len(s) == 2 and isinstance(s[1], str),
        )
    )
