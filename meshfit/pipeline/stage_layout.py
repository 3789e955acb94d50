"""The stage layout a strategy's scope sets: what a `Stages` stack called inside it runs pipelined on.

A strategy with a `stage` mesh axis sets its `StageLayout` for the length of its
`scope()` (`meshfit.strategies.Strategy.scope`, entered again while a step is
traced); every other strategy's scope sets None. `Stages` reads it here, so the
pipeline asks no strategy which one is current: with a layout a stack runs
pipelined over its stages, without one its blocks run in one scan.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

from jax.sharding import Mesh

from meshfit.pipeline.settings import STAGE_AXIS, Pipeline

_CURRENT: contextvars.ContextVar[StageLayout | None] = contextvars.ContextVar("meshfit_stage_layout", default=None)


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """Where a pipelined `Stages` stack runs: the mesh, the schedule, and how the batch is split over data copies.

    Args:
        mesh: the device mesh; its `stage` axis splits the stack's layers.
        pipeline: the schedule's settings (`meshfit.pipeline.settings.Pipeline`).
        replicas: the data replicas a global batch is split over; each replica's rows are cut into
            `pipeline.microbatches` microbatches.
        data_axes: the leading batch axes over which a stage's parameters are whole copies: the pipelined loop
            runs manual over them too, so each copy sums its gradient over the ticks and the copies reduce it once.
    """

    mesh: Mesh
    pipeline: Pipeline
    replicas: int
    data_axes: tuple[str, ...] = ()

    @property
    def stages(self) -> int:
        """P, the size of the mesh's `stage` axis."""
        return int(self.mesh.shape[STAGE_AXIS])


def current() -> StageLayout | None:
    """The stage layout of the innermost strategy scope; None outside one, or in a scope without a `stage` axis."""
    return _CURRENT.get()


@contextlib.contextmanager
def scope(layout: StageLayout | None) -> Iterator[StageLayout | None]:
    """Makes `layout` the current stage layout (None: no pipeline) until the block ends."""
    token = _CURRENT.set(layout)
    try:
        yield layout
    finally:
        _CURRENT.reset(token)
