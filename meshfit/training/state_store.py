"""The one owner of a model's `TrainState`: where it is kept, read, replaced and advanced by steps."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import jax

from meshfit.core.state import TrainState
from meshfit.steps.terms import LOSS_KEY
from meshfit.strategies.leaf_programs import LeafProgram
from meshfit.training.in_flight import InFlight


class StateStore:
    """A model's `TrainState` and its optimizer steps counted on the host.

    Compiled steps return a new state (the old buffers are donated, no copy is
    kept) and `advance` stores it; everything else reads the state through
    `latest` and replaces it through `replace`, `reset` or `restore`; under
    asynchronous strategies the session `settle`s it with what the strategy
    applied of the batches in flight.

    Between steps compiled on the state's leaves (`meshfit.strategies.leaf_programs`) the
    store keeps the flat list of leaves and rebuilds the `TrainState` only when
    something reads it.

    A state may be created on first read (`create`, `defer`): a model built
    from a factory holds only its template (shapes and layouts) until
    something reads the arrays, so a fit that restores a backup first never
    creates the parameters and optimizer state it would overwrite (seconds,
    and the memory of a second copy, at real sizes).

    Args:
        state: the initial state, already laid out by the strategy; with `create`, its template
            (`jax.ShapeDtypeStruct`s with the strategy's shardings).
        follow: called with each state set from outside a step and at the end
            of each fit: the model points the user's module at the state's
            arrays, so the module never keeps alive arrays the model has dropped.
        create: makes the state `state` is the template of, when it is first read (`latest`); None: `state`
            is the state.
    """

    def __init__(
        self,
        state: TrainState,
        follow: Callable[[TrainState], None] | None = None,
        create: Callable[[], TrainState] | None = None,
    ):
        self._state: TrainState | None = state
        # The state as a flat list of leaves and its structure, between leaf steps (`_state` is None then).
        self._leaves: list | None = None
        self._structure = None
        self._follow = follow or (lambda state: None)
        self._create = create
        if create is None:
            self._follow(state)
        self._step = 0  # optimizer steps taken, counted on the host
        self._step_known = True  # whether `_step` counts `_state` (else read once from the device)

    @property
    def latest(self) -> TrainState:
        """The state as the last step returned it, without waiting for batches still in flight.

        The same as the settled state (`Session.state`) under synchronous strategies. Under asynchronous
        ones, reading it costs nothing and joins no other process, so reads
        that need no exact position (shapes, the learning rate, a summary) use it. A state not created yet
        (`create`) is created here.
        """
        self._create_pending()
        if self._state is None:
            self._state = self._structure.unflatten(self._leaves)
        return self._state

    def _create_pending(self) -> None:
        if self._create is not None:
            create, self._create = self._create, None
            self._set(create())
            self._follow(self._state)

    @property
    def pending(self) -> Callable[[], TrainState] | None:
        """What creates the state on its first read, while it is not created yet; else None."""
        return self._create

    @property
    def template(self) -> TrainState:
        """The state's shapes, dtypes and shardings (`jax.ShapeDtypeStruct`s), without creating a pending state
        (what a restore reads into, and what traces a program)."""
        if self._create is not None:
            return self._state
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None)), self.latest
        )

    def defer(self, template: TrainState, create: Callable[[], TrainState]) -> None:
        """A fresh start (`compile`) whose state `create` makes on its first read; `template` its shapes."""
        self._set(template)
        self._create = create
        self._step, self._step_known = 0, True

    def _set(self, state: TrainState) -> None:
        self._state, self._leaves, self._create = state, None, None

    def settle(self, state: TrainState) -> None:
        """Keeps `state`, which accounts for every batch handed out (what an asynchronous strategy applied
        of the batches it had in flight: `meshfit.training.session.Session.settle`)."""
        self._set(state)

    def replace(self, state: TrainState) -> None:
        """Replaces the state from outside a step (weights set, a learning rate changed, a restore)."""
        self._set(state)
        self._follow(state)
        self._step_known = False  # a restored state may hold another step: the next fit reads it

    def reset(self, state: TrainState) -> None:
        """A fresh start (`compile`): the state at step 0, nothing in flight."""
        self._set(state)
        self._step, self._step_known = 0, True
        self._follow(state)

    def restore(self, state: TrainState, step: int) -> None:
        """Replaces the state with one restored at optimizer step `step`."""
        self.replace(state)
        self._step, self._step_known = step, True

    def replace_metrics(self, metrics) -> None:
        """Sets the loss and metric accumulators (fresh ones at an epoch's start); a state not created yet
        gets them when it is."""
        create = self._create
        if create is not None:
            self._state = self._state._replace(metrics=metrics)
            self._create = lambda: create()._replace(metrics=metrics)
            return
        self._set(self.latest._replace(metrics=metrics))

    def advance(self, calls: Iterable, in_flight: InFlight) -> dict:
        """Runs each `(program, args)` call on the state (donated) and keeps what it returns; returns
        the last call's logs (device values). Each call counts against the `in_flight` bound.

        A `LeafProgram` runs on the state's leaves, kept flat from one such call to the next.
        """
        self._create_pending()  # the first step creates a state not created yet
        leaves, structure, state = self._leaves, self._structure, self._state
        last, run = None, None  # the last leaf program and its compiled form for `structure`
        try:
            for program, args in calls:
                if isinstance(program, LeafProgram):
                    if leaves is None:
                        leaves, structure = jax.tree.flatten(state)
                    if program is not last:
                        last, run = program, program.on(structure)
                    leaves, logs = run(leaves, *args)
                    state = None
                else:
                    if state is None:
                        state = structure.unflatten(leaves)
                    state, logs = program(state, *args)
                    leaves = None
                if in_flight.due():  # the wait token is picked only for a mark
                    token = wait_token(logs)
                    if token is None:  # a step whose logs are empty: the state's step count
                        token = (state if state is not None else structure.unflatten(leaves)).step
                    in_flight.mark(token)
        finally:
            self._leaves, self._structure, self._state = leaves, structure, state
        return logs

    # -- the host's count of optimizer steps --------------------------------------------------

    @property
    def step(self) -> int:
        """Optimizer steps taken, counted on the host (no transfer)."""
        return self._step

    def count(self, steps: int) -> None:
        self._step += steps

    def begin_fit(self, to_host: Callable) -> None:
        """Reads the step from the device once if the state was set from outside since the last fit."""
        if not self._step_known:
            self._step = int(to_host(self.latest.step))
        self._step_known = False  # until this fit ends normally, the count may run ahead of the state

    def end_fit(self, finished: bool) -> None:
        """After a fit that `finished`, the host count matches the state, so the next need not read it."""
        self._step_known = finished
        self._follow(self.latest)


def wait_token(logs: dict):
    """A device value of a step's logs to wait on for the in-flight bound: the loss, else the first value (a
    custom step's logs may have no "loss"); None for empty logs."""
    token = logs.get(LOSS_KEY)
    return next(iter(logs.values()), None) if token is None else token
