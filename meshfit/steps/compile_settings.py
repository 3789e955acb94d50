"""What `Model.compile` resolves its arguments into, before the first batch (Keras's `compile_utils`).

`resolve` checks every argument and turns the optimizer(s), loss, metrics and
dtype policy into one frozen `CompileSettings`, changing nothing: every check
runs before the model's state does. `compiled_state` is the training state a
compile starts from (the parameters in the policy's variable dtype, a fresh
optimizer state laid out like its parameters), `optimizer` the
`meshfit.optimizers.Optimizer` face of the optimizer state, and `require`
the refusal of an operation the settings cannot do (no compile, no optimizer,
no loss).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from meshfit import losses as losses_lib
from meshfit import metrics as metrics_lib
from meshfit import optimizers as optimizers_lib
from meshfit.core import keras_names, precision
from meshfit.core.state import TrainState

#: A step count (`steps_per_execution`, `gradient_accumulation_steps`) must be below this: the step counter is int32.
STEP_LIMIT = 2**31


@dataclasses.dataclass(frozen=True)
class CompileSettings:
    """What `Model.compile` was given, resolved where it can be before the first batch.

    Attributes:
        tx: the optax transformation (several optimizers: one transform over their parts,
            `meshfit.optimizers.partitioned`).
        optimizer_id: the optimizer as passed (saved with the model when `serialization` can write it).
        loss: the loss as passed (one for every output, or a dict/list per
            output), checked; resolved per output on the first batch (None:
            `predict` only).
        loss_id: the loss as passed.
        metrics: metric identifiers (a list, or a dict/list per output),
            resolved on the first batch (their shapes decide "accuracy").
        weighted: identifiers of the metrics that use `sample_weight`, likewise.
        steps_per_execution: batches run inside one compiled call.
        dtype_policy: the `meshfit.core.precision.DTypePolicy` the steps compute under.
        gradient_accumulation_steps: batches whose mean gradient makes one update (1: every batch).
        run_eagerly: the steps run un-jitted, op by op (`compile(run_eagerly=True)` or `jit_compile=False`).
    """

    tx: Any
    optimizer_id: Any
    loss: Any
    loss_id: Any
    metrics: tuple
    weighted: tuple
    steps_per_execution: int
    dtype_policy: precision.DTypePolicy = precision.get("float32")
    gradient_accumulation_steps: int = 1
    loss_weights: Any = None
    run_eagerly: bool = False


class Resolution(NamedTuple):
    """`resolve`'s result: the settings, and the optimizer's parts that `optimizer` makes its face of.

    Attributes:
        settings: the resolved `CompileSettings`.
        transforms: each part's transformation (the key None: one optimizer for every parameter).
        schedules: each part's learning-rate schedule (`meshfit.optimizers.schedule_of`).
        several: the optimizer was given as a dict of parts.
    """

    settings: CompileSettings
    transforms: dict
    schedules: dict
    several: bool


def resolve(
    optimizer: Any,
    loss: Any,
    loss_weights: Any,
    metrics: Any,
    weighted_metrics: Any,
    *,
    steps_per_execution: Any,
    dtype_policy: Any,
    gradient_accumulation_steps: Any,
    auto_scale_loss: bool,
    run_eagerly: bool,
    strategy: Any,
    params: Any,
) -> Resolution:
    """`Model.compile`'s arguments checked and resolved; nothing changes (see `Model.compile` for each).

    Args:
        dtype_policy: the policy given, or the global one where none was (`meshfit.mixed_precision`).
        run_eagerly: the steps run un-jitted (`run_eagerly=True` or `jit_compile=False`).
        strategy: the model's strategy (what it can compute: `strategy.capabilities`).
        params: the model's parameters (a dict of optimizers is checked against their top-level parts).

    Raises:
        ValueError, TypeError: an argument meshfit cannot compile with, naming it.
    """
    policy = precision.get(dtype_policy)
    if not auto_scale_loss and policy.loss_scaling:
        keras_names.refuse("Model.compile", "auto_scale_loss", auto_scale_loss)
    if policy.loss_scaling and not strategy.capabilities.loss_scaling:
        raise ValueError(
            f"dtype_policy={policy.name!r} scales the loss inside the training step, which {strategy!r} "
            "splits between workers and a server. Use dtype_policy='mixed_bfloat16', which needs no loss scale."
        )
    accumulate = 1 if gradient_accumulation_steps is None else gradient_accumulation_steps
    if not isinstance(accumulate, int) or isinstance(accumulate, bool) or not 1 <= accumulate < STEP_LIMIT:
        raise ValueError(
            "`gradient_accumulation_steps` must be a positive int (batches per update) below 2**31. "
            f"Received: {gradient_accumulation_steps!r}."
        )
    several = isinstance(optimizer, dict)
    given = dict(optimizer) if several else {} if optimizer is None else {None: optimizer}
    # A Keras optimizer object as the optax transform of its arguments (which `save` writes down).
    given = {k: optimizers_lib.from_keras(o) if optimizers_lib.is_keras_optimizer(o) else o for k, o in given.items()}
    optimizer = given if several else given.get(None)
    if several and not given:
        raise ValueError("`optimizer` given as a dict needs one optimizer per top-level part. Received: {}.")
    if accumulate > 1 and any(isinstance(opt, optax.MultiSteps) for opt in given.values()):
        raise ValueError(
            "The optimizer is an optax.MultiSteps, which accumulates gradients itself; "
            f"leave `gradient_accumulation_steps` unset. Received: {gradient_accumulation_steps!r}."
        )
    if several:
        optimizers_lib.check_parts(given, params)
    transforms = {key: optimizers_lib.get(opt) for key, opt in given.items()}
    schedules = {key: optimizers_lib.schedule_of(tx) for key, tx in transforms.items()}
    if accumulate > 1:
        transforms = {
            key: optax.MultiSteps(tx, every_k_schedule=accumulate).gradient_transformation()
            for key, tx in transforms.items()
        }
    tx = optimizers_lib.partitioned(transforms) if several else transforms.get(None)  # None: no optimizer
    loss_obj = _check_each(loss, losses_lib.get)
    _check_loss_weights(loss_weights)
    metric_ids = _as_metrics(metrics)
    weighted_ids = _as_metrics(weighted_metrics)
    # Unknown names fail now, not at fit ("accuracy" is resolved from the first batch's shapes).
    _check_each(metric_ids, lambda i: _needs_shapes(i) or metrics_lib.get(i))
    _check_each(weighted_ids, lambda i: _needs_shapes(i) or metrics_lib.get(i))
    if (
        not isinstance(steps_per_execution, int)
        or isinstance(steps_per_execution, bool)
        or not 1 <= steps_per_execution < STEP_LIMIT
    ):
        raise ValueError(
            "`steps_per_execution` must be a positive int below 2**31 (the step counter is int32). "
            f"Received: {steps_per_execution!r}."
        )
    settings = CompileSettings(
        tx=tx,
        optimizer_id=optimizer,
        loss=loss_obj,
        loss_id=loss,
        metrics=metric_ids,
        weighted=weighted_ids,
        steps_per_execution=steps_per_execution,
        dtype_policy=policy,
        gradient_accumulation_steps=accumulate,
        loss_weights=loss_weights,
        run_eagerly=run_eagerly,
    )
    return Resolution(settings, transforms, schedules, several)


def compiled_state(settings: CompileSettings, state: TrainState, strategy: Any, hints: Any, abstract: bool) -> Any:
    """The state a compile starts from, placed by `strategy`: the parameters in the policy's variable dtype,
    a fresh optimizer state created in its layout (Adam's moments sharded like their parameters), step 0.

    Args:
        state: the model's state now (its parameters and model state carry over).
        hints: the module's partition specs (`ModuleAdapter.partition_specs`).
        abstract: shapes and layouts only: the optimizer state stays `jax.ShapeDtypeStruct`s.
    """
    policy, tx = settings.dtype_policy, settings.tx
    params = state.params
    if policy.variable_dtype != np.float32:
        params = (jax.eval_shape if abstract else lambda f, p: f(p))(policy.cast_to_variable, params)
    state = state._replace(
        params=params,
        opt_state=None if tx is None else jax.eval_shape(tx.init, params),
        metrics=(),
        step=jnp.zeros((), jnp.int32),
        loss_scale=precision.LossScale.initial() if policy.loss_scaling else None,
    )
    shardings = strategy.state_shardings(state, hints)
    if tx is not None and not abstract:  # (an abstract model keeps the shapes; `place_state` lays them out)
        init = tx.init if shardings is None else jax.jit(tx.init, out_shardings=shardings.opt_state)
        state = state._replace(opt_state=init(params))
    return strategy.place_state(state, hints)


def optimizer(resolution: Resolution, session: Any) -> optimizers_lib.Optimizer | None:
    """The `Model.optimizer` of these settings (None without one), reading and writing the optimizer state
    through `session` (the model's `meshfit.training.session.Session`: `latest`, `state`, `strategy`)."""
    tx, transforms, schedules = resolution.settings.tx, resolution.transforms, resolution.schedules
    if tx is None:
        return None
    access = _optimizer_state_access(session)
    if resolution.several:
        parts = {key: optimizers_lib.Optimizer(t, access, schedules[key], key) for key, t in transforms.items()}
        return optimizers_lib.Optimizers(parts, tx, access)
    return optimizers_lib.Optimizer(tx, access, schedules[None])


def require(settings: CompileSettings | None, what: str, *, abstract: bool, custom: set[str]) -> None:
    """Refuses `what` (an operation of `Model`) that the model as compiled cannot do, naming the fix.

    Args:
        settings: the model's settings (None: not compiled).
        abstract: the model holds shapes only (`Model(..., abstract=True)`).
        custom: the step methods the model's class overrides (its own loss stands in for a compiled one).
    """
    if abstract and what != "step_report":
        raise ValueError(
            f"`{what}()` needs the model's parameters, and this model is abstract (shapes and layouts only). "
            f"Received: Model(..., abstract=True). Create it without `abstract` to train, evaluate or predict."
        )
    if settings is None:
        raise ValueError(f"You must call `compile()` before `{what}()`. Call model.compile(optimizer=..., loss=...).")
    if settings.tx is None and what in ("fit", "train_on_batch", "step_report"):
        raise ValueError(
            f"`{what}()` needs an optimizer. Received: a model compiled with optimizer=None, for evaluate and "
            "predict only, as load_model compiles a saved model whose optimizer `save` could not write down "
            "(code: an optax transformation, or an optax learning-rate schedule). Pass it: "
            "meshfit.load_model(path, module, optimizer=...), with the optimizer the model was compiled with, "
            "restores the saved optimizer state and step too; model.compile(optimizer=..., loss=...) starts "
            "a fresh optimizer state. A schedule of meshfit.optimizers.schedules is written down, so the "
            "next save of a model compiled with one reloads with nothing passed."
        )
    own_step = {"fit": "train_step", "evaluate": "test_step"}.get(what)
    if settings.loss is None and own_step and not {own_step, "compute_loss"} & custom:
        raise ValueError(
            f"`{what}()` needs a loss. Call model.compile(..., loss=...), or override `compute_loss` "
            f"or `{own_step}` in a subclass of meshfit.Model."
        )


def _optimizer_state_access(session: Any) -> optimizers_lib.OptimizerStateAccess:
    """The optimizer's view of the session: the optimizer state as the last step left it, and a host read."""

    def replace_opt_state(opt_state: Any) -> None:
        session.state = session.latest._replace(opt_state=opt_state)

    return optimizers_lib.OptimizerStateAccess(
        opt_state=lambda: session.latest.opt_state,
        replace_opt_state=replace_opt_state,
        step=lambda: session.latest.step,
        to_host=lambda value: session.strategy.to_host(value),
    )


def _as_metrics(value: Any) -> Any:
    """Metrics as given: a list (a lone metric becomes one), or a dict/list per output."""
    if value is None:
        return []
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def _check_each(value: Any, check: Callable) -> Any:
    """`check` applied to each identifier of a `compile` argument given once or per output (dict/list);
    returns the same structure of results (None stays None)."""
    if value is None:
        return None
    if isinstance(value, dict):
        return {key: _check_each(v, check) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_check_each(v, check) for v in value]
    return check(value)


def _check_loss_weights(loss_weights: Any) -> None:
    bad = [
        w
        for w in jax.tree.leaves(loss_weights)
        if isinstance(w, bool) or not isinstance(w, (int, float, np.integer, np.floating))
    ]
    if bad:
        hint = ""
        if all(isinstance(w, (str, metrics_lib.Metric)) or callable(w) for w in bad):  # metric names or objects
            hint = (
                " These look like metrics: since Keras 3 the third positional argument of `compile` is "
                "`loss_weights` (tf.keras's order put `metrics` there). Pass metrics by name, e.g. "
                "model.compile(optimizer, loss, metrics=['accuracy'])."
            )
        raise TypeError(
            "`loss_weights` must be a number, or a dict/list of numbers per output. "
            f"Received: loss_weights={loss_weights!r} (not numbers: {bad}).{hint}"
        )


def _needs_shapes(identifier: Any) -> bool:
    return isinstance(identifier, str) and identifier.lower() in ("accuracy", "acc")
