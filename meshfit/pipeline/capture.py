"""How a `Stages` call behaves while the fused 1F1B step splits a module around it.

The fused step (`meshfit.pipeline.one_f_one_b`) runs the module twice in
special modes: "capture" stops the forward pass at the `Stages` call and
hands back what the pipeline needs (its input and its blocks), and "inject"
makes the call return a given stage output, so the module's remaining layers
(the tail) run on one microbatch inside the pipeline's last stage. Outside
these modes `Stages` runs as usual.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax

_MODE: contextvars.ContextVar[Any] = contextvars.ContextVar("meshfit_stages_mode", default=None)


@dataclasses.dataclass
class Captured(Exception):
    """Raised by a `Stages` call in capture mode: what the pipelined loop needs of it."""

    apply: Callable[[Any, jax.Array], jax.Array]  # one layer: (layer params, h) -> h
    params: Any  # the stacked blocks' parameters (leading layer axis), as traced in the step
    x: jax.Array  # the stack's input
    mesh: Any
    pipeline: Any
    replicas: int
    data_axes: tuple[str, ...]


@dataclasses.dataclass
class _Inject:
    y: jax.Array
    calls: int = 0


@contextlib.contextmanager
def capturing() -> Iterator[None]:
    """`Stages` calls raise `Captured` instead of running."""
    token = _MODE.set("capture")
    try:
        yield
    finally:
        _MODE.reset(token)


@contextlib.contextmanager
def injecting(y: jax.Array) -> Iterator[None]:
    """The one `Stages` call returns `y` (its blocks do not run)."""
    token = _MODE.set(_Inject(y))
    try:
        yield
    finally:
        _MODE.reset(token)


def intercept(found: Captured) -> jax.Array | None:
    """What a pipelined `Stages` call returns in the current mode: None outside capture and inject."""
    mode = _MODE.get()
    if mode == "capture":
        raise found
    if isinstance(mode, _Inject):
        mode.calls += 1
        if mode.calls > 1:
            raise ValueError(
                "The 1f1b schedule pipelines one Stages call per forward pass. Received a module that calls "
                "Stages more than once; use one Stages stack, or schedule='gpipe'."
            )
        if mode.y.shape != found.x.shape:
            raise ValueError(
                f"Stages maps its input to an output of the same shape: {found.x.shape}. Received {mode.y.shape}."
            )
        return mode.y
    return None
