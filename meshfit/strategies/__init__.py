"""Strategies: where state lives, how batches split, how steps compile.

Change only the strategy line to move a model from one device to many:

    with meshfit.strategies.OneDeviceStrategy().scope():
        model = meshfit.Model(module)
"""

from meshfit.strategies.base import Strategy, get_strategy, has_strategy
from meshfit.strategies.mesh import MeshStrategy, constrain
from meshfit.strategies.mirrored import MirroredStrategy
from meshfit.strategies.multi_worker_mirrored import MultiWorkerMirroredStrategy
from meshfit.strategies.one_device import OneDeviceStrategy
from meshfit.strategies.parameter_server import ParameterServerStrategy

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
