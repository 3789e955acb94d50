"""How a `Stages` call behaves while the fused 1F1B step splits a module around it.

The fused step (`meshfit.pipeline.one_f_one_b`) runs the module twice in
special modes:

* "capture": the `Stages` call records what the pipeline needs of it (its
  input, its blocks' parameters and how to apply one block: a `StackCall`) and
  returns its input unchanged. The rest of the forward pass is traced on
  that input; its result is unused, so XLA drops it as dead code. Nothing is
  raised, so a module whose forward pass catches exceptions around its
  layers is split as any other.
* "inject": the call returns a given stage output, so the module's remaining
  layers (the tail) run on one microbatch inside the pipeline's last stage.

Outside these modes `Stages` runs as usual.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax

_MODE: contextvars.ContextVar[Capture | Inject | None] = contextvars.ContextVar("meshfit_stages_mode", default=None)

ONE_CALL = (
    "The 1f1b schedule pipelines one Stages call per forward pass. Received a module that calls "
    "Stages more than once; use one Stages stack, or schedule='gpipe'."
)


@dataclasses.dataclass(frozen=True)
class StackCall:
    """What the pipelined loop needs of a `Stages` call."""

    apply: Callable[[Any, jax.Array], jax.Array]  # one layer: (layer params, h) -> h
    params: Any  # the stacked blocks' parameters (leading layer axis, in layer order), as traced in the step
    x: jax.Array  # the stack's input


@dataclasses.dataclass
class Capture:
    """The capture mode's record: the one `Stages` call of a forward pass, once it has run."""

    call: StackCall | None = None


@dataclasses.dataclass
class Inject:
    """The inject mode's output for the one `Stages` call, and how many calls came."""

    y: jax.Array
    calls: int = 0


def mode() -> Capture | Inject | None:
    """The current mode: a `Capture`, an `Inject`, or None (a `Stages` call runs as usual)."""
    return _MODE.get()


@contextlib.contextmanager
def capturing() -> Iterator[Capture]:
    """`Stages` calls record themselves in the `Capture` yielded and return their input."""
    found = Capture()
    token = _MODE.set(found)
    try:
        yield found
    finally:
        _MODE.reset(token)


@contextlib.contextmanager
def injecting(y: jax.Array) -> Iterator[None]:
    """The one `Stages` call returns `y` (its blocks do not run)."""
    token = _MODE.set(Inject(y))
    try:
        yield
    finally:
        _MODE.reset(token)


def intercept(call: StackCall) -> jax.Array:
    """What a `Stages` call returns in the current mode (capture or inject): its input, or the injected output."""
    current = _MODE.get()
    if isinstance(current, Capture):
        if current.call is not None:
            raise ValueError(ONE_CALL)
        current.call = call
        return call.x
    if not isinstance(current, Inject):
        raise RuntimeError("capture.intercept runs only in capture or inject mode (capture.mode() is None).")
    current.calls += 1
    if current.calls > 1:
        raise ValueError(ONE_CALL)
    if current.y.shape != call.x.shape:
        raise ValueError(
            f"Stages maps its input to an output of the same shape: {call.x.shape}. Received {current.y.shape}."
        )
    return current.y
