"""Strategies: where state lives, how batches split, how steps compile.

Change only the strategy line to move a model from one device to many:

    with meshfit.strategies.OneDeviceStrategy().scope():
        model = meshfit.Model(module)

The names below load on first use (PEP 562), as `meshfit`'s do: `meshfit launch` reads a
strategy's launcher module (`parameter_server/launcher.py`) without importing JAX, and
`import meshfit` loads no parameter-server module until `ParameterServerStrategy` is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshfit.core.lazy import lazy_names

# Each public name, by the module that defines it.
_NAMES = {
    "Capabilities": "meshfit.strategies.base",
    "Strategy": "meshfit.strategies.base",
    "get_strategy": "meshfit.strategies.current",
    "has_strategy": "meshfit.strategies.current",
    "MeshStrategy": "meshfit.strategies.mesh",
    "constrain": "meshfit.strategies.mesh",
    "MirroredStrategy": "meshfit.strategies.mirrored",
    "MultiWorkerMirroredStrategy": "meshfit.strategies.multi_worker_mirrored",
    "OneDeviceStrategy": "meshfit.strategies.one_device",
    "Pipeline": "meshfit.pipeline.settings",
    "ParameterServerStrategy": "meshfit.strategies.parameter_server.strategy",
}

if TYPE_CHECKING:  # what type checkers and the API docs see
    from meshfit.pipeline.settings import Pipeline
    from meshfit.strategies.base import Capabilities, Strategy
    from meshfit.strategies.current import get_strategy, has_strategy
    from meshfit.strategies.mesh import MeshStrategy, constrain
    from meshfit.strategies.mirrored import MirroredStrategy
    from meshfit.strategies.multi_worker_mirrored import MultiWorkerMirroredStrategy
    from meshfit.strategies.one_device import OneDeviceStrategy
    from meshfit.strategies.parameter_server import ParameterServerStrategy


__all__ = [
    "Strategy",
    "Capabilities",
    "OneDeviceStrategy",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "MeshStrategy",
    "ParameterServerStrategy",
    "Pipeline",
    "constrain",
    "get_strategy",
    "has_strategy",
]

__getattr__, __dir__ = lazy_names(__name__, _NAMES, __all__, globals())
