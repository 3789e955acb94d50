"""Joining a multi-process JAX job: `jax.distributed` set-up from arguments or the environment.

Order of precedence for each setting: the argument, then `MESHFIT_*` variables
(set by `meshfit launch`), then JAX's own (`JAX_COORDINATOR_ADDRESS`, ...), then
JAX's cluster auto-detection (SLURM, Open MPI, Cloud TPU, Kubernetes). With none
of these, the job is a single process.
"""

from __future__ import annotations

import logging
import os
import warnings

import jax

from meshfit import compat

logger = logging.getLogger("meshfit")

ENV_COORDINATOR = "MESHFIT_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "MESHFIT_NUM_PROCESSES"
ENV_PROCESS_ID = "MESHFIT_PROCESS_ID"
ENV_HEARTBEAT = "MESHFIT_HEARTBEAT_TIMEOUT"
# Variables launchers set that reveal a multi-process job JAX may not detect (e.g. Open MPI 5).
_SIZE_HINTS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS", "WORLD_SIZE")


def detected_cluster() -> str | None:
    """Name of the cluster environment JAX would auto-detect, or None."""
    for env in compat.cluster_environments():
        if not getattr(env, "opt_in_only_method", False) and env.is_env_present():
            return env.__name__
    return None


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"Environment variable {name} must be an integer. Received: {name}={value!r}.") from None


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids=None,
    heartbeat_timeout_seconds: int | None = None,
    initialization_timeout: int = 300,
) -> bool:
    """Initializes `jax.distributed` once; returns True if this is a multi-process job.

    Must run before any JAX computation. CPU collectives go through gloo, so a
    multi-process job also runs on hosts without accelerators.
    """
    if jax.distributed.is_initialized():
        return jax.process_count() > 1
    coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR)
    num_processes = num_processes if num_processes is not None else _int_env(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _int_env(ENV_PROCESS_ID)
    heartbeat = heartbeat_timeout_seconds or _int_env(ENV_HEARTBEAT) or 100
    explicit = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if not explicit and num_processes is None and detected_cluster() is None:
        hinted = {k: os.environ[k] for k in _SIZE_HINTS if os.environ.get(k, "1") not in ("", "0", "1")}
        if hinted:
            warnings.warn(
                f"The environment says this is one of several processes ({hinted}) but JAX detected no cluster, "
                "so this process trains alone. Pass coordinator_address, num_processes and process_id (or set "
                f"{ENV_COORDINATOR}, {ENV_NUM_PROCESSES}, {ENV_PROCESS_ID}).",
                stacklevel=3,
            )
        logger.info("No coordinator address or cluster found; running as a single process.")
        return False
    if num_processes == 1:
        return False
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=local_device_ids,
        heartbeat_timeout_seconds=heartbeat,
        initialization_timeout=initialization_timeout,
    )
    logger.info("Joined a %d-process job as process %d.", jax.process_count(), jax.process_index())
    return jax.process_count() > 1
