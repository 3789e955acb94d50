"""meshfit: Keras-style training for Flax models on JAX, from one device to many hosts.

Submodules and the names below load on first use, so `meshfit launch` (which needs none of JAX)
starts at once; `import meshfit` followed by any use behaves as if everything had been imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

__all__ = [
    "Model",
    "TrainState",
    "load_model",
    "Preempted",
    "PREEMPTED_EXIT_CODE",
    "callbacks",
    "cluster",
    "data",
    "losses",
    "metrics",
    "optimizers",
    "outputs",
    "strategies",
    "utils",
    "__version__",
]

# Names of other modules' objects, by module; every other public name is a submodule.
_NAMES = {
    "Model": "meshfit.model",
    "TrainState": "meshfit.state",
    "load_model": "meshfit.model",
    "Preempted": "meshfit.preemption",
    "PREEMPTED_EXIT_CODE": "meshfit.preemption",
}

if TYPE_CHECKING:  # what type checkers and the API docs see
    from meshfit import callbacks, cluster, data, losses, metrics, optimizers, outputs, strategies, utils
    from meshfit.model import Model, load_model
    from meshfit.preemption import PREEMPTED_EXIT_CODE, Preempted
    from meshfit.state import TrainState


def __getattr__(name: str):
    if name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name]), name)
        globals()[name] = value
        return value
    if not name.startswith("_"):  # any submodule, as if the package had imported them all
        try:
            return importlib.import_module(f"meshfit.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"meshfit.{name}":
                raise
    raise AttributeError(f"module 'meshfit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
