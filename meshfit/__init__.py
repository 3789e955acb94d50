"""meshfit: Keras-style training for Flax models on JAX, from one device to many hosts.

Submodules and the names below load on first use, so `meshfit launch` (which needs none of JAX)
starts at once; `import meshfit` followed by any use behaves as if everything had been imported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshfit.core.lazy import lazy_names
from meshfit.runtime import exit_report, start_phases

exit_report.install()  # under `meshfit launch`: the exception that ends this process is reported to it
start_phases.mark("meshfit imported")

__version__ = "0.1.0"

__all__ = [
    "Model",
    "TrainState",
    "load_model",
    "plan",
    "Plan",
    "Preempted",
    "PREEMPTED_EXIT_CODE",
    "callbacks",
    "cluster",
    "compilation_cache",
    "data",
    "layers",
    "losses",
    "metrics",
    "mixed_precision",
    "optimizers",
    "outputs",
    "pipeline",
    "strategies",
    "utils",
    "__version__",
]

# Names of other modules' objects, by module; every other public name is a submodule.
_NAMES = {
    "Model": "meshfit.model",
    "TrainState": "meshfit.core.state",
    "load_model": "meshfit.model",
    "plan": "meshfit.planning.planner",
    "Plan": "meshfit.planning.planner",
    "Preempted": "meshfit.runtime.preemption",
    "PREEMPTED_EXIT_CODE": "meshfit.runtime.preemption",
}

if TYPE_CHECKING:  # what type checkers and the API docs see
    from meshfit import (
        callbacks,
        cluster,
        compilation_cache,
        data,
        layers,
        losses,
        metrics,
        mixed_precision,
        optimizers,
        outputs,
        pipeline,
        strategies,
        utils,
    )
    from meshfit.core.state import TrainState
    from meshfit.model import Model, load_model
    from meshfit.planning.planner import Plan, plan
    from meshfit.runtime.preemption import PREEMPTED_EXIT_CODE, Preempted

__getattr__, __dir__ = lazy_names(__name__, _NAMES, __all__, globals())
