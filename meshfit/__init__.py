"""meshfit: Keras-style training for Flax models on JAX, from one device to many hosts."""

from meshfit import callbacks, data, losses, metrics, optimizers, strategies
from meshfit.model import Model
from meshfit.preemption import PREEMPTED_EXIT_CODE, Preempted

__version__ = "0.1.0"

__all__ = ["Model", "Preempted", "PREEMPTED_EXIT_CODE", "callbacks", "data", "losses", "metrics", "optimizers", "strategies", "__version__"]
