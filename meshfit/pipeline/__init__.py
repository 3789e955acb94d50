"""Pipeline parallelism: `Stages`, a stack of blocks split over a `stage` mesh axis.

Configure the schedule on the strategy:

    strategy = mf.strategies.MeshStrategy(
        axes={"stage": 4, "data": 2}, pipeline=mf.strategies.Pipeline(microbatches=8))
"""

from __future__ import annotations

from meshfit.pipeline.stages import Stages

__all__ = ["Stages"]
