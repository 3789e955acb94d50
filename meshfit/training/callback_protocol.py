"""The Keras callback protocol: `Callback` and the `CallbackList` the loop calls.

Hooks receive `logs`, a dict of metric name -> value. In per-batch hooks the
values are device scalars (`jax.Array`): reading one (`float(v)`) waits for the
step that made it, so a callback that does not need per-batch values should not
touch them. Epoch-level hooks receive plain Python floats, unless every
callback of the fit is one that declares `accepts_device_logs` (as History
does): then the epoch ends without waiting for the devices.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshfit.model import Model
    from meshfit.training.fit_context import FitContext


class Callback:
    """Base class for callbacks, with the hooks and attributes Keras defines.

    Attributes:
        model: the `meshfit.Model` being trained (set by `set_model`).
        context: the running fit (`meshfit.training.fit_context.FitContext`): steps, state, position, restore.
        params: dict with `epochs`, `steps` (batches per epoch or None) and `verbose`.

    Callbacks that carry state across epochs (patience counters, best values)
    implement `state_dict()` / `load_state_dict()` so a resumed run restores them.
    """

    #: True if the epoch hooks of this class (not its subclasses) take device
    #: scalars as they come and read them later.
    accepts_device_logs = False
    #: True for callbacks that save training state (BackupAndRestore): they run after
    #: the others, and their presence arms the SIGTERM handler for `on_preemption`.
    handles_preemption = False
    #: True for callbacks that add entries to the epoch logs (Throughput): they run before
    #: the others, which then see and record those entries.
    adds_epoch_logs = False
    #: The name a backup files this callback's `state_dict` under; None: its class name, with
    #: `_1`, `_2`, ... for the later callbacks of one class, in order (see `state_keys`). Set it
    #: to tell apart callbacks of one class whose order may change between runs.
    state_key: str | None = None

    def close(self) -> None:
        """Finishes background work (an asynchronous save); called when `fit` ends, also by an error."""

    def __init__(self) -> None:
        self.model: Model | None = None
        self.params: dict[str, Any] = {}

    def set_model(self, model: Model) -> None:
        self.model = model

    @property
    def context(self) -> FitContext:
        """The running fit as a callback sees it (`meshfit.training.fit_context.FitContext`): the optimizer
        steps taken, a settled state, the fit's position and `restore`."""
        return self.model.fit_context

    def set_params(self, params: dict[str, Any]) -> None:
        self.params = params

    # State carried across a backup and restore (see BackupAndRestore), filed under `state_key`.
    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to continue this callback (JSON values and numpy arrays); {} for none."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Takes back what `state_dict` returned, before the resumed fit's first step."""
        del state

    # Training.
    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        """Called once at the start of `fit`, before any step (BackupAndRestore restores here).

        Args:
            logs: an empty dict (reserved).
        """

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        """Called once at the end of `fit`, also after an early stop.

        Args:
            logs: the last epoch's logs.
        """

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        """Called at the start of each epoch.

        Args:
            epoch: the epoch's index (0-based; from `initial_epoch` on).
            logs: an empty dict (reserved).
        """

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        """Called at the end of each epoch, after validation.

        Args:
            epoch: the epoch's index.
            logs: the epoch's training logs (`loss`, metrics) and `val_` logs,
                as Python floats (device scalars when every callback declares
                `accepts_device_logs`).
        """

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """Called before each training step (each execution with `steps_per_execution`).

        Args:
            batch: the batch's index within the epoch.
            logs: an empty dict (reserved).
        """
        self.on_batch_begin(batch, logs=logs)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """Called after each training step (each execution with `steps_per_execution`).

        Args:
            batch: the index within the epoch of the last batch the step trained on.
            logs: the running epoch logs as device scalars: reading one waits
                for that step.
        """
        self.on_batch_end(batch, logs=logs)

    # Evaluation.
    def on_test_begin(self, logs: dict[str, Any] | None = None) -> None:
        """Called at the start of `evaluate` (and of validation within `fit`).

        Args:
            logs: an empty dict (reserved).
        """

    def on_test_end(self, logs: dict[str, Any] | None = None) -> None:
        """Called at the end of `evaluate` or validation.

        Args:
            logs: the evaluation's results, as Python floats.
        """

    def on_test_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """Called before each evaluation step.

        Args:
            batch: the batch's index.
            logs: an empty dict (reserved).
        """

    def on_test_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """Called after each evaluation step.

        Args:
            batch: the batch's index.
            logs: the running results as device scalars.
        """

    # Prediction.
    def on_predict_begin(self, logs: dict[str, Any] | None = None) -> None:
        """Called at the start of `predict`.

        Args:
            logs: an empty dict (reserved).
        """

    def on_predict_end(self, logs: dict[str, Any] | None = None) -> None:
        """Called at the end of `predict`.

        Args:
            logs: an empty dict (reserved).
        """

    def on_predict_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """Called before each prediction step.

        Args:
            batch: the batch's index.
            logs: an empty dict (reserved).
        """

    def on_predict_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """Called after each prediction step.

        Args:
            batch: the batch's index.
            logs: `{"outputs": ...}`, the batch's outputs on the devices.
        """

    def on_preemption(self, epoch: int, batch: int) -> None:
        """meshfit: called when training stops for a preemption (SIGTERM), before `Preempted` is raised.

        Every process calls it at the same step. A callback that saves here
        should set `handles_preemption = True` (it then runs after the others).

        Args:
            epoch: the epoch the stop falls in.
            batch: how many batches of that epoch were trained.
        """

    # Keras 2 aliases, still called by much user code.
    def on_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """Keras 2 alias of `on_train_batch_begin` (called by its default)."""

    def on_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """Keras 2 alias of `on_train_batch_end` (called by its default)."""


def state_keys(callbacks: Sequence[Callback]) -> list[str]:
    """The names under which a backup files each callback's state, in the order of `callbacks`.

    A callback's `state_key` if set, else its class name, with `_1`, `_2`, ...
    for the second, third, ... callback of that class (Keras names layers so):
    reordering callbacks of different classes keeps each one's name.

    Raises:
        ValueError: two callbacks get the same name (a `state_key` set twice,
            or one that equals another callback's default name).
    """
    seen: dict[str, int] = {}
    keys = []
    for cb in callbacks:
        if cb.state_key is not None:
            keys.append(cb.state_key)
            continue
        name = type(cb).__name__
        count = seen.get(name, 0)
        seen[name] = count + 1
        keys.append(name if count == 0 else f"{name}_{count}")
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    if repeated:
        raise ValueError(
            "Expected each callback of a fit to have its own state key (its `state_key`, or its class name with "
            f"_1, _2, ... for later callbacks of one class). Received: {', '.join(map(repr, repeated))} more than "
            "once. Set a distinct `state_key` on each of those callbacks."
        )
    return keys


_HOOKS = [
    f"on_{phase}_{edge}"
    for phase in ("train", "test", "predict", "train_batch", "test_batch", "predict_batch", "epoch")
    for edge in ("begin", "end")
]


class CallbackList(Callback):
    """Calls each hook on every callback in order; the only object the loop talks to.

    With a `timer` (the session's `meshfit.training.fit_timer.FitTimer`), the time the
    callbacks spend in the hooks it dispatches is counted as "callbacks".
    """

    def __init__(
        self, callbacks: Iterable[Callback] = (), model: Model | None = None, timer=None, **params: Any
    ) -> None:
        super().__init__()
        self._timing = contextlib.nullcontext() if timer is None else timer.phase("callbacks")
        self.callbacks = list(callbacks)
        for cb in self.callbacks:
            if not isinstance(cb, Callback):
                raise TypeError(
                    "Every callback must be a meshfit.callbacks.Callback instance. "
                    f"Received: {cb!r} of type {type(cb).__name__}."
                )
        if model is not None:
            self.set_model(model)
        if params:
            self.set_params(params)

    def append(self, callback: Callback) -> None:
        self.callbacks.append(callback)

    def bound_hooks(self, hook: str) -> list[Callable[..., Any]]:
        """The bound `hook` of each callback that does something in it.

        Hooks a callback inherits unchanged from `Callback` are skipped, so a
        loop whose callbacks ignore batches pays nothing per batch.
        """
        alias = _ALIASES.get(hook)
        found = []
        for cb in self.callbacks:
            names = (hook,) if alias is None else (hook, alias)
            if any(_overrides(cb, name) for name in names):
                found.append(getattr(cb, hook))
        return found

    @property
    def accepts_device_logs(self) -> bool:
        """True if every callback's own class declares `accepts_device_logs` (subclasses must again)."""
        return all(vars(type(cb)).get("accepts_device_logs", False) for cb in self.callbacks)

    def wants(self, hook: str) -> bool:
        """True if some callback implements `hook` (or its Keras 2 alias)."""
        return bool(self.bound_hooks(hook))

    def set_model(self, model: Model) -> None:
        super().set_model(model)
        for cb in self.callbacks:
            cb.set_model(model)

    def set_params(self, params: dict[str, Any]) -> None:
        super().set_params(params)
        for cb in self.callbacks:
            cb.set_params(params)

    def __iter__(self) -> Iterator[Callback]:
        return iter(self.callbacks)

    def __len__(self) -> int:
        return len(self.callbacks)

    def _call(self, hook: str, *args: Any) -> None:
        bound_hooks = self.bound_hooks(hook)
        if not bound_hooks:
            return
        with self._timing:
            for bound in bound_hooks:
                bound(*args)


_ALIASES = {"on_train_batch_begin": "on_batch_begin", "on_train_batch_end": "on_batch_end"}


def _overrides(callback: Callback, hook: str) -> bool:
    if hook in vars(callback):  # set on the instance, as LambdaCallback does
        return True
    if isinstance(callback, CallbackList):
        return callback.wants(hook)
    return getattr(type(callback), hook) is not getattr(Callback, hook)


def _make_dispatcher(hook: str) -> Callable[..., None]:
    def dispatch(self: CallbackList, *args: Any) -> None:
        self._call(hook, *args)

    dispatch.__name__ = hook
    return dispatch


_HOOKS.append("on_preemption")

for _hook in _HOOKS:
    setattr(CallbackList, _hook, _make_dispatcher(_hook))
