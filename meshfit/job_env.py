"""What `meshfit launch` tells each process it starts, through environment variables.

The launcher sets these and `cluster.initialize` and the parameter-server transport read them. This
module imports nothing of JAX, so the launcher, a supervisor that never computes, starts in a fraction
of a second instead of the seconds JAX, Flax and Orbax take to import.
"""

from __future__ import annotations

import secrets

# Joining the jax.distributed job (read by meshfit.cluster).
ENV_COORDINATOR = "MESHFIT_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "MESHFIT_NUM_PROCESSES"
ENV_PROCESS_ID = "MESHFIT_PROCESS_ID"
ENV_HEARTBEAT = "MESHFIT_HEARTBEAT_TIMEOUT"
ENV_INIT_TIMEOUT = "MESHFIT_INIT_TIMEOUT"

# Parameter-server jobs (`meshfit launch --ps`, read by the parameter-server transport).
ENV_PS_ROLE = "MESHFIT_PS_ROLE"  # "coordinator" (server rank 0), "server" (server ranks 1..) or "worker"
ENV_PS_ADDRESS = "MESHFIT_PS_ADDRESS"  # host:port of the coordinator's control listener
ENV_PS_AUTHKEY = "MESHFIT_PS_AUTHKEY"  # hex secret shared by the job's processes
ENV_PS_WORKERS = "MESHFIT_PS_WORKERS"  # number of worker processes the coordinator waits for
ENV_PS_SERVERS = "MESHFIT_PS_SERVERS"  # number of server processes (rank 0 included)
ENV_PS_SERVER_RANK = "MESHFIT_PS_SERVER_RANK"  # this server's rank among the servers
ENV_PS_SERVER_TIMEOUT = "MESHFIT_PS_SERVER_TIMEOUT"  # seconds without a word from rank 0 before its peers give up
#: What worker ranks run (`python -m`): the worker needs nothing of the training script.
PS_WORKER_MODULE = "meshfit.strategies.parameter_server.worker"
#: Exit status of a worker that found the parameter server silent (`meshfit launch` then ends the job).
EXIT_SERVER_SILENT = 3


def new_authkey() -> str:
    """A fresh secret for one job's parameter-server connections."""
    return secrets.token_hex(32)
