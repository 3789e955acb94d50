"""Joining a multi-process JAX job: `mf.cluster.initialize()` from arguments or the environment.

The public face of `meshfit.runtime.cluster` (SLURM, Open MPI, Cloud TPU and
Kubernetes detection, timeouts, the start-up handshake).
"""

from meshfit.runtime.cluster import (
    DEFAULT_HEARTBEAT_TIMEOUT,
    DEFAULT_INIT_TIMEOUT,
    detected_cluster,
    heartbeat_timeout,
    initialize,
)

__all__ = ["initialize", "detected_cluster", "DEFAULT_INIT_TIMEOUT", "DEFAULT_HEARTBEAT_TIMEOUT", "heartbeat_timeout"]
