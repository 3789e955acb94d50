"""Strategies: where state lives, how batches split, how steps compile.

Change only the strategy line to move a model from one device to many:

    with meshfit.strategies.OneDeviceStrategy().scope():
        model = meshfit.Model(module)
"""

from typing import TYPE_CHECKING

from meshfit.strategies.base import Strategy
from meshfit.strategies.current import get_strategy, has_strategy
from meshfit.strategies.mesh import MeshStrategy, constrain
from meshfit.strategies.mirrored import MirroredStrategy
from meshfit.strategies.multi_worker_mirrored import MultiWorkerMirroredStrategy
from meshfit.strategies.one_device import OneDeviceStrategy

if TYPE_CHECKING:
    from meshfit.strategies.parameter_server import ParameterServerStrategy


def __getattr__(name: str):
    # The parameter-server modules (transport, servers, workers) load on first use:
    # `import meshfit` stays free of them.
    if name == "ParameterServerStrategy":
        from meshfit.strategies.parameter_server import ParameterServerStrategy

        return ParameterServerStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Strategy",
    "OneDeviceStrategy",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "MeshStrategy",
    "ParameterServerStrategy",
    "constrain",
    "get_strategy",
    "has_strategy",
]
