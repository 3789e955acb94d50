"""Pure step functions: one training, evaluation or prediction step on one batch.

Nothing here knows about devices or strategies: each function maps pytrees to
pytrees and a strategy compiles it. `steps_per_execution=K` wraps a step in a
`lax.scan` over K stacked batches.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import optax

from meshfit import losses as losses_lib
from meshfit.core import precision
from meshfit.core.batch import Batch
from meshfit.core.state import TrainState
from meshfit.steps.modules import ModuleAdapter
from meshfit.steps.terms import LOSS_KEY, LossTerm, MetricTerm


class Replicas(Protocol):
    """How the replicas computing one step share their results (`StepFunctions.gradients`).

    One replica (`ONE_REPLICA`) shares nothing. Under an explicit data-parallel
    step every replica computes on its own rows and these are the collectives
    (`meshfit.strategies.data_parallel.DataReplicas`).
    """

    def sum(self, tree):
        """The sum of `tree` over the replicas (loss totals, row counts, metric increments)."""

    def sum_gradients(self, grads):
        """The sum of the replicas' gradients (where a strategy may compress them)."""

    def mean_state(self, model_state):
        """The module state (BatchNorm statistics) every replica keeps: the replicas' mean."""

    def rng(self, key):
        """This replica's random key (key data) for its rows: its own draws, not a copy of the others'."""


class PipelinedObjective(Protocol):
    """An objective computed another way (`StepFunctions.with_pipelined_objective`): a pipeline's fused loop."""

    def __call__(self, objective: Callable, params: Any, batch: Any, consts: Any, /) -> tuple[jax.Array, Any]:
        """What `objective(params, batch, consts)` returns, `(objective, aux)`: aux leaves scalars or rows first."""
        ...


class _OneReplica:
    """The whole batch on one replica: nothing to share."""

    def sum(self, tree):
        return tree

    sum_gradients = mean_state = rng = sum


ONE_REPLICA: Replicas = _OneReplica()


class Steps(Protocol):
    """What `meshfit.training.executables.Executables` compiles through a strategy: a model's pure steps.

    `StepFunctions` (the built-in steps) and `meshfit.steps.custom_steps.ModelSteps`
    (a `Model` subclass's own `train_step`, `test_step`, `predict_step`)
    satisfy it. `ScannedSteps` writes the staged and K-step programs once,
    in terms of the single steps.

    Attributes:
        needs_real_rows: a partial batch must reach the steps as its real rows
            only: `Executables` reads them from the host mask and compiles
            `with_rows(n)` per real-row count `n`.
        masks_padding: a batch's padding rows (mask 0) count for nothing in the
            steps, so a batch of padding only may run through them.
        scalar_losses: the outputs whose compiled loss returns a scalar (for messages).
        metric_names: the keys of the logs, where known before a step runs.
    """

    needs_real_rows: bool
    masks_padding: bool

    @property
    def scalar_losses(self) -> list[str]: ...

    @property
    def metric_names(self) -> list[str]: ...

    def train_step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
        """One training step: the new state (the old one donated) and the logs (device scalars)."""

    def staged_train_step(self, state: TrainState, stage: Batch, index) -> tuple[TrainState, dict]:
        """`train_step` on batch `index` of batches stacked on a leading axis."""

    def multi_train_step(self, state: TrainState, batches: Batch) -> tuple[TrainState, dict]:
        """K training steps in one `lax.scan` over K stacked batches; the last step's logs."""

    def eval_step(self, variables, metrics, batch: Batch) -> tuple[Any, dict]:
        """One evaluation step on `(params, model_state)`: new accumulators and logs."""

    def multi_eval_step(self, variables, metrics, batches: Batch) -> tuple[Any, dict]: ...

    def predict_step(self, variables, batch: Batch) -> Any:
        """The outputs for every row of `batch` (padding rows too: the loop drops them)."""

    def multi_predict_step(self, variables, batches: Batch) -> Any: ...

    def init_metrics(self) -> Any:
        """Fresh accumulators for `TrainState.metrics` (an epoch's start, an evaluation)."""

    def logs(self, metrics) -> dict[str, jax.Array]:
        """The logs these accumulators give (when no step ran to return its own)."""

    def with_rows(self, rows: int) -> Steps:
        """A copy for a partial batch of `rows` real rows (they come first, the padding after)."""


class ScannedSteps:
    """The staged and K-step programs, written once in terms of `train_step`, `eval_step` and `predict_step`.

    With `logs_follow_metrics` the logs are a function of the accumulators
    alone (`logs(metrics)`), read once after a scan; otherwise the last
    step's own logs are kept (a custom step's logs may hold plain values).
    """

    logs_follow_metrics: bool = False

    def staged_train_step(self, state: TrainState, stage: Batch, index) -> tuple[TrainState, dict]:
        """`train_step` on batch `index` of a stage: batches stacked on a leading axis.

        The stage was placed on the devices once; each step only picks its
        batch, so no host slicing or transfer happens per step.
        """
        batch = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, index, keepdims=False), stage)
        return self.train_step(state, batch)

    def multi_train_step(self, state: TrainState, batches: Batch):
        """K training steps in one `lax.scan`; every batch must hold real rows.

        (A fully padded batch would still move the optimizer state, so a short
        last group runs through `train_step` instead.)
        """
        if self.logs_follow_metrics:
            state, _ = jax.lax.scan(lambda state, batch: (self.train_step(state, batch)[0], None), state, batches)
            return state, self.logs(state.metrics)
        state, logs = jax.lax.scan(self.train_step, state, batches)
        return state, _last(logs)

    def multi_eval_step(self, variables, metrics, batches: Batch):
        def body(metrics, batch):
            metrics, logs = self.eval_step(variables, metrics, batch)
            return metrics, None if self.logs_follow_metrics else logs

        metrics, logs = jax.lax.scan(body, metrics, batches)
        return metrics, self.logs(metrics) if self.logs_follow_metrics else _last(logs)

    def multi_predict_step(self, variables, batches: Batch):
        return jax.lax.map(lambda batch: self.predict_step(variables, batch), batches)


def _last(stacked_logs: dict) -> dict:
    """The last step's entry of logs stacked by a scan."""
    return jax.tree.map(lambda a: a[-1], stacked_logs)


def forward(
    adapter: ModuleAdapter,
    policy: precision.DTypePolicy,
    params,
    model_state,
    x,
    rng,
    training: bool,
    method: str | None = None,
):
    """The module's outputs under the dtype policy (float32 out) and its updated state.

    Under a policy other than float32 the parameters and floating inputs are
    cast to the compute dtype (`adapter` computes in it), the outputs back to
    float32, and the module state keeps the dtypes it had.
    """
    if policy.name != "float32":
        params, x = policy.cast_to_compute((params, x))
    call = {} if method is None else {"method": method}
    y_pred, new_model_state = adapter.apply(params, model_state, x, training=training, rng=rng, **call)
    if policy.name != "float32":
        y_pred = precision.to_float32(y_pred)
        new_model_state = jax.tree.map(_keep_floating_dtype, new_model_state, model_state)
    return y_pred, new_model_state


class StepFunctions(ScannedSteps):
    """A compiled model's pure step functions (train, evaluate, predict; one or K per call), built from its pieces.

    Args:
        adapter: the module adapter (forward pass on pure pytrees).
        losses: the `meshfit.steps.terms.LossTerm`s: each output's loss and its
            weight; the training objective is their weighted sum (none:
            `predict` only).
        tx: the optax optimizer.
        metrics: the `meshfit.steps.terms.MetricTerm`s, updated with the padding
            mask as sample weight (times the output's `sample_weight` for the
            weighted ones).
        policy: the `meshfit.core.precision.DTypePolicy` the forward and backward passes run under.

    A loss that returns a scalar for the batch (`LossTerm.scalar`) cannot
    leave padding rows out: the steps take it as computed on the whole batch,
    which is right for full batches, and a partial batch of `n` real rows
    goes through a copy made by `with_rows(n)`, which computes it on the
    first `n` rows (the real ones: padding always follows them).
    """

    def __init__(
        self,
        adapter: ModuleAdapter,
        losses: Sequence[LossTerm],
        tx: optax.GradientTransformation,
        metrics: Sequence[MetricTerm] = (),
        policy: precision.DTypePolicy | None = None,
    ):
        self.adapter = adapter
        self.policy = policy or precision.get("float32")
        self.losses = list(losses)
        self.tx = tx
        self.metric_terms = list(metrics)
        self.replica_gradients: Callable | None = None
        self.pipelined_objective: PipelinedObjective | None = None
        self.rows: int | None = None  # set by `with_rows`: a scalar loss sees only these first rows

    def with_replica_gradients(self, fn: Callable) -> StepFunctions:
        """A copy whose training steps compute `(grads, module state, increments)` with `fn`.

        `fn` takes `gradients`' arguments; a strategy that reduces gradients
        itself (the explicit data-parallel step) passes `gradients` run on
        each replica and shared through its collectives.
        """
        steps = copy.copy(self)
        steps.replica_gradients = fn
        return steps

    def with_pipelined_objective(self, fn: PipelinedObjective) -> StepFunctions:
        """A copy whose training steps compute the objective and its gradient with `fn`.

        `fn(objective, params, batch, consts)` returns what `objective(params,
        batch, consts)` returns, `(objective, aux)`, computed another way: a
        strategy that pipelines the model passes its fused 1F1B loop, which runs
        the layers after the pipeline and the loss inside the pipeline's last
        stage, one microbatch at a time (`meshfit.pipeline.one_f_one_b`).
        """
        steps = copy.copy(self)
        steps.pipelined_objective = fn
        return steps

    def with_rows(self, rows: int) -> StepFunctions:
        """A copy whose steps compute each scalar loss on the first `rows` rows of the batch.

        For a partial batch with `rows` real rows (they come first, the padding
        after them): the slice is static, so each distinct `rows` is its own
        compiled program; per-sample losses and metrics still use the mask.
        Under explicit per-replica gradients a replica holds only its own rows,
        so there is no copy to make (the model refuses that pairing at build).
        """
        if self.replica_gradients is not None:
            raise ValueError(
                "Scalar losses computed on a partial batch's real rows need the whole batch in one step. "
                "Received: steps with per-replica gradients (an explicit data-parallel step); "
                "return per-sample loss values instead."
            )
        steps = copy.copy(self)
        steps.rows = int(rows)
        return steps

    logs_follow_metrics = True
    masks_padding = True

    @property
    def needs_real_rows(self) -> bool:
        """Whether a partial batch needs its own program: only under a loss returning a scalar."""
        return bool(self.scalar_losses)

    @property
    def scalar_losses(self) -> list[str]:
        """The names of the outputs whose loss returns a scalar (empty: every loss is per sample)."""
        return [term.output.name or "output" for term in self.losses if term.scalar]

    @property
    def metrics(self) -> list:
        """The metric objects, in log order."""
        return [term.metric for term in self.metric_terms]

    @property
    def _logs_each_loss(self) -> bool:
        return len(self.losses) > 1

    @property
    def metric_names(self) -> list[str]:
        """The keys of the logs: "loss", each output's "<output>_loss" (several losses), the metrics."""
        each = [f"{term.output.name}_loss" for term in self.losses] if self._logs_each_loss else []
        return [LOSS_KEY, *each] + [term.log_name for term in self.metric_terms]

    # -- metric accumulators -----------------------------------------------------

    def init_metrics(self):
        # (weighted sum, count) of the loss, then of each output's loss: one buffer, fewer step arguments.
        losses = 1 + (len(self.losses) if self._logs_each_loss else 0)
        return (jnp.zeros((2 * losses,), jnp.float32),) + tuple(term.metric.init() for term in self.metric_terms)

    def _update_metrics(self, states, losses, batch: Batch, y_pred):
        """Adds one batch to the accumulators; `losses` is `(loss, [each output's loss])`."""
        loss, each = losses
        mask = batch.mask
        n_real = jnp.sum(mask)
        values = [loss] + (list(each) if self._logs_each_loss else [])
        sums = [part for value in values for part in (value.astype(jnp.float32) * n_real, n_real)]
        new = [states[0] + jnp.stack(sums)]
        for term, state in zip(self.metric_terms, states[1:], strict=True):
            weight = mask
            if term.weighted:
                sample_weight = _output_weight(batch.sample_weight, term.output)
                weight = mask if sample_weight is None else mask * _per_sample(sample_weight)
            new.append(term.metric.update(state, term.output.of(batch.y), term.output.of(y_pred), weight))
        return tuple(new)

    def logs(self, states) -> dict[str, jax.Array]:
        """Current value of the loss, each output's loss and each metric (device scalars)."""
        sums = states[0].reshape(-1, 2)
        means = sums[:, 0] / jnp.maximum(sums[:, 1], 1.0)
        loss_names = self.metric_names[: sums.shape[0]]
        values = {name: means[i] for i, name in enumerate(loss_names)}
        for term, state in zip(self.metric_terms, states[1:], strict=True):
            values[term.log_name] = term.metric.compute(state)
        return values

    # -- steps ---------------------------------------------------------------------

    def _forward(self, params, model_state, batch: Batch, rng, training: bool):
        """Each loss's per-sample values, the predictions (float32 at least) and the updated module state.

        Under a policy other than float32 the parameters and floating inputs
        are cast to the compute dtype, the outputs back to float32, and the
        module state keeps the dtypes it had.
        """
        y_pred, new_model_state = self._apply(params, model_state, batch.x, rng, training)
        values = [  # (values, the entries that count: None for all, e.g. ignore_class)
            term.loss.values_and_mask(
                self._real(term, term.output.of(batch.y)), self._real(term, term.output.of(y_pred))
            )
            for term in self.losses
        ]
        return values, y_pred, new_model_state

    def _real(self, term: LossTerm, tree):
        """`tree` as a loss term reads it: a scalar loss of a `with_rows` copy reads the first `rows` rows."""
        if tree is None or not term.scalar or self.rows is None:
            return tree
        return jax.tree.map(lambda a: a[: self.rows], tree)

    def _apply(self, params, model_state, x, rng, training: bool):
        """The module's outputs under the dtype policy (float32 out) and its updated state."""
        return forward(self.adapter, self.policy, params, model_state, x, rng, training)

    # -- the compiled loss and metrics on real rows (for `meshfit.steps.custom_steps`) ----------------

    def compiled_loss(self, y, y_pred, sample_weight=None):
        """`(loss, each output's loss)` of rows that are all real: Keras's compiled loss (0 without one)."""
        each = []
        for term in self.losses:
            value, valid = term.loss.values_and_mask(term.output.of(y), term.output.of(y_pred))
            weight = _output_weight(sample_weight, term.output)
            total, divisor = losses_lib.reduce_parts(value, weight, valid, term.loss.reduction)
            each.append(losses_lib.divide_no_nan(total, divisor))
        loss = self._weighted_sum(each) if each else jnp.zeros((), jnp.float32)
        return loss, each

    def update_compiled_metrics(self, states, loss, y, y_pred, sample_weight=None):
        """The accumulators of `init_metrics` with one batch of real rows: `loss`, each output's loss
        (several losses) and the compiled metrics."""
        rows = jax.tree.leaves(y_pred)[0].shape[0]
        each = self.compiled_loss(y, y_pred, sample_weight)[1] if self._logs_each_loss else []
        batch = Batch(None, y, sample_weight, jnp.ones((rows,), jnp.float32))
        return self._update_metrics(states, (jnp.asarray(loss, jnp.float32), each), batch, y_pred)

    def _parts(self, values, batch: Batch):
        """`(total, divisor)` of each loss: its value is `total / divisor`.

        A scalar loss is reduced as Keras reduces it (see
        `meshfit.losses.reduce_values`) over the rows it was computed on, with
        no mask; its divisor is 1, or 0 on a batch of padding only (a filler
        in a stacked group), which then counts for nothing, as with a
        per-sample loss.
        """
        parts = []
        for term, (value, valid) in zip(self.losses, values, strict=True):
            sample_weight = _output_weight(batch.sample_weight, term.output)
            if not term.scalar:
                mask = batch.mask if valid is None else losses_lib.combine_masks(valid, batch.mask)
                parts.append(losses_lib.reduce_parts(value, sample_weight, mask, term.loss.reduction))
                continue
            total, divisor = losses_lib.reduce_parts(value, self._real(term, sample_weight), None, term.loss.reduction)
            parts.append((total, divisor * (jnp.sum(batch.mask) > 0).astype(divisor.dtype)))
        return parts

    def _weighted_sum(self, each):
        """The loss: each output's loss times its weight, summed (Keras's total)."""
        weighted = [
            value if term.weight is None else value * term.weight for term, value in zip(self.losses, each, strict=True)
        ]
        return functools.reduce(jnp.add, weighted)

    def compute_loss(self, params, model_state, batch: Batch, rng, training: bool):
        """`(loss, each output's loss)` and `(predictions, module state)`."""
        values, y_pred, new_model_state = self._forward(params, model_state, batch, rng, training)
        each = [losses_lib.divide_no_nan(total, divisor) for total, divisor in self._parts(values, batch)]
        return (self._weighted_sum(each), each), (y_pred, new_model_state)

    def _loss_parts(self, params, model_state, batch: Batch, rng, loss_scale, replicas: Replicas):
        """The training objective (times `loss_scale`) and `(totals, divisors, y_pred, module state)`.

        One loss: its (weighted) total; `gradients` divides by the divisor (the
        real rows) afterwards, so the divisor, summed over replicas, needs no
        collective of its own before the backward pass. Several losses each
        have their own divisor: these are summed over the replicas first
        (scalars that depend on no parameter), and each total is divided by
        its own before the weighted sum.
        """
        values, y_pred, new_model_state = self._forward(params, model_state, batch, rng, True)
        totals, divisors = (list(parts) for parts in zip(*self._parts(values, batch), strict=True))
        if len(self.losses) == 1:
            objective = self._weighted_sum(totals)
        else:
            divisors = [
                d if term.loss.reduction == "sum" else jax.lax.stop_gradient(replicas.sum(d))
                for term, d in zip(self.losses, divisors, strict=True)
            ]
            objective = self._weighted_sum(
                [losses_lib.divide_no_nan(t, d) for t, d in zip(totals, divisors, strict=True)]
            )
        if loss_scale is not None:
            objective = objective * loss_scale
        return objective, (totals, divisors, y_pred, new_model_state)

    @property
    def _pipelined_loss_parts(self) -> Callable | None:
        """`_loss_parts` computed by `pipelined_objective` (`with_pipelined_objective`); None without one."""
        pipelined = self.pipelined_objective
        if pipelined is None:
            return None
        scalar = self.scalar_losses
        several = len(self.losses) > 1 and any(term.loss.reduction != "sum" for term in self.losses)
        if scalar or several:
            raise ValueError(
                "The 1f1b schedule computes the loss per microbatch, so it must be a sum over rows. Received "
                + (f"losses returning a scalar ({scalar})" if scalar else "several losses with mean reductions")
                + "; return per-sample values (one loss, or reductions 'sum'), or use schedule='gpipe'."
            )

        def parts(params, batch, consts, replicas):
            model_state, rng, loss_scale = consts
            objective, (totals, divisors, y_pred, new_state) = self._loss_parts(
                params, model_state, batch, rng, loss_scale, replicas
            )
            changed = [
                a is not b for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(model_state), strict=True)
            ]
            if any(changed):
                raise ValueError(
                    "The 1f1b schedule runs the layers after Stages per microbatch, which must not update module "
                    "state. Received a module whose forward pass does (BatchNorm statistics, dropout streams); "
                    "move those layers before Stages, or use schedule='gpipe'."
                )
            return objective, (totals, divisors, y_pred)

        def loss_parts(params, model_state, batch, rng, loss_scale, replicas):
            consts = (model_state, rng, loss_scale)
            fn = functools.partial(parts, replicas=replicas)
            objective, aux = pipelined(fn, params, batch, consts)
            return objective, (*aux, model_state)

        return loss_parts

    def gradients(self, params, model_state, batch: Batch, rng, loss_scale=None, replicas: Replicas = ONE_REPLICA):
        """A worker's part of a step: gradients, the updated module state, metric increments.

        The gradient of a single loss's total is divided by its divisor (the
        real rows) afterwards (see `_loss_parts`). With a `loss_scale`
        (float16), the objective is scaled before the backward pass and the
        gradients unscaled in the same division. `replicas` says how replicas
        computing one step on parts of its batch share totals, gradients and
        module state: with them, every replica returns the values one replica
        computes on the whole batch.
        """
        if rng is not None:
            rng = replicas.rng(rng)
        grad_fn = jax.grad(self._pipelined_loss_parts or self._loss_parts, has_aux=True)
        grads, (totals, divisors, y_pred, model_state) = grad_fn(params, model_state, batch, rng, loss_scale, replicas)
        grads = replicas.sum_gradients(grads)
        if len(self.losses) > 1:  # the divisors are the whole batch's already
            totals = replicas.sum(totals)
            divisor = jnp.ones((), divisors[0].dtype)
        elif self.losses[0].loss.reduction == "sum":  # every replica's divisor is 1, and so is the whole batch's
            totals = replicas.sum(totals)
            divisor = divisors[0]
        else:
            totals, divisors = replicas.sum((totals, divisors))
            divisor = divisors[0]
        model_state = replicas.mean_state(model_state)
        scale = losses_lib.divide_no_nan(jnp.ones((), divisor.dtype), divisor)  # 0 for an all-padding batch
        if loss_scale is not None:
            scale = scale / loss_scale
        grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
        each = [losses_lib.divide_no_nan(t, d) for t, d in zip(totals, divisors, strict=True)]
        losses = (self._weighted_sum(each), each)
        increments = replicas.sum(self._update_metrics(self.init_metrics(), losses, batch, y_pred))
        return grads, model_state, increments

    def apply_gradients(self, state: TrainState, grads, model_state, increments, rng) -> TrainState:
        """The server's part of a step: the optimizer update and the metric sums.

        Under loss scaling a step whose gradients are not all finite leaves the
        parameters and optimizer state as they were and halves the scale.
        """
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        loss_scale = state.loss_scale
        if loss_scale is not None:
            finite = precision.all_finite(grads)
            params, opt_state = jax.tree.map(
                lambda new, old: jnp.where(finite, new, old), (params, opt_state), (state.params, state.opt_state)
            )
            loss_scale = loss_scale.next(finite)
        metrics = jax.tree.map(jnp.add, state.metrics, increments)
        return state._replace(
            params=params,
            model_state=model_state,
            opt_state=opt_state,
            metrics=metrics,
            step=state.step + 1,
            rng=rng,
            loss_scale=loss_scale,
        )

    def train_step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
        batch = with_rows_all_real(batch)
        rng, step_rng = state.rng, None
        if self.adapter.uses_rng:
            rng, step_rng = (jax.random.key_data(k) for k in jax.random.split(jax.random.wrap_key_data(rng)))
        loss_scale = None if state.loss_scale is None else state.loss_scale.scale
        gradients = self.replica_gradients or self.gradients
        grads, model_state, increments = gradients(state.params, state.model_state, batch, step_rng, loss_scale)
        new_state = self.apply_gradients(state, grads, model_state, increments, rng)
        return new_state, self.logs(new_state.metrics)

    def eval_step(self, variables, metrics, batch: Batch):
        params, model_state = variables
        losses, (y_pred, _) = self.compute_loss(params, model_state, batch, None, False)
        metrics = self._update_metrics(metrics, losses, batch, y_pred)
        return metrics, self.logs(metrics)

    def predict_step(self, variables, batch: Batch):
        params, model_state = variables
        y_pred, _ = self._apply(params, model_state, batch.x, None, False)
        return y_pred


def with_rows_all_real(batch: Batch) -> Batch:
    """`batch`, with a mask of ones made on the device if it came without one (an input whose batches are
    all full, `meshfit.training.feeder`: no mask is gathered, placed or picked from a stage).

    The ones pass an optimization barrier, so the step compiles as for a masked batch and trains bitwise
    as it does: with the constant folded away, XLA:CPU schedules a large MLP's update kernels differently,
    and slower.
    """
    if batch.mask is not None:
        return batch
    rows = jax.tree.leaves(batch.x)[0].shape[0]
    return batch._replace(mask=jax.lax.optimization_barrier(jnp.ones((rows,), jnp.float32)))


def _per_sample(sample_weight):
    """Reduces a sample-weight array to one weight per row (Keras allows (batch, 1))."""
    sample_weight = jnp.asarray(sample_weight, jnp.float32)
    return sample_weight.reshape(sample_weight.shape[0], -1)[:, 0] if sample_weight.ndim > 1 else sample_weight


def _output_weight(sample_weight, output):
    """An output's sample weights: its entry of per-output weights (a dict or list), else the one array for all."""
    if sample_weight is None or not isinstance(sample_weight, (dict, list, tuple)):
        return sample_weight
    return output.of(sample_weight)


def _keep_floating_dtype(new, old):
    """A module-state leaf in the dtype it had before a cast forward pass (statistics stay float32)."""
    if jnp.issubdtype(old.dtype, jnp.floating) and new.dtype != old.dtype:
        return new.astype(old.dtype)
    return new
