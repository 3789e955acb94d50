"""Pipeline parallelism: `Stages`, a stack of blocks split over a `stage` mesh axis.

Configure the schedule on the strategy:

    strategy = mf.strategies.MeshStrategy(
        axes={"stage": 4, "data": 2}, pipeline=mf.strategies.Pipeline(microbatches=8))

The package sits below the strategies: a strategy's scope hands `Stages` its
`stage_layout.StageLayout`, and a strategy hands the built-in train step the
fused 1F1B objective (`one_f_one_b`). `Stages` loads on first use (PEP 562),
so a strategy can import the pipeline's settings without importing Flax.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshfit.core.lazy import lazy_names

_NAMES = {"Stages": "meshfit.pipeline.stages"}

if TYPE_CHECKING:  # what type checkers and the API docs see
    from meshfit.pipeline.stages import Stages

__all__ = ["Stages"]

__getattr__, __dir__ = lazy_names(__name__, _NAMES, __all__, globals())
