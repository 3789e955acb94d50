"""meshfit: Keras-style training for Flax models on JAX, from one device to many hosts."""

from meshfit import callbacks, cluster, data, losses, metrics, optimizers, outputs, strategies
from meshfit.model import Model, load_model
from meshfit.preemption import PREEMPTED_EXIT_CODE, Preempted

__version__ = "0.1.0"

__all__ = [
    "Model",
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
    "__version__",
]
