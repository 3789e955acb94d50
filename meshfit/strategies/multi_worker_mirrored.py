"""MultiWorkerMirroredStrategy: MirroredStrategy over every device of every process."""

from __future__ import annotations

import jax

from meshfit.runtime import cluster
from meshfit.strategies import data_parallel
from meshfit.strategies.mirrored import MirroredStrategy


class MultiWorkerMirroredStrategy(MirroredStrategy):
    """Synchronous data parallelism across processes and hosts.

    Joins the `jax.distributed` job (see `meshfit.runtime.cluster.initialize`: explicit
    arguments, `MESHFIT_*` variables from `meshfit launch`, or auto-detection on
    SLURM, Open MPI, Cloud TPU and Kubernetes), then builds one `"data"` mesh over
    all processes' devices, process by process. Each process feeds only its own
    rows of every global batch: numpy inputs are split by process; an iterable
    input must yield this process's local batches (global batch = local batch x
    processes). Only process 0 prints progress and writes logs; every process
    gets the same History. Must be created before any other JAX computation.

    Args:
        coordinator_address: "host:port" of process 0's coordinator.
        num_processes: number of processes in the job.
        process_id: this process's index.
        local_device_ids: devices this process uses (GPU hosts running one
            process per device).
        heartbeat_timeout_seconds: a process that stops sending heartbeats for
            this long is declared dead, and the others stop with an error
            (default: `MESHFIT_HEARTBEAT_TIMEOUT`, else 30).
        initialization_timeout: seconds to wait for all processes to join
            (default: `MESHFIT_INIT_TIMEOUT`, else 300); past it, a
            `meshfit.runtime.rendezvous.JoinTimeoutError` says how many came.
        reduction: as for `MirroredStrategy`: "auto" (XLA's all-reduce) or
            "explicit" (meshfit's psum under shard_map).
        gradient_compression: as for `MirroredStrategy`: None, "bf16" or "fp16";
            across hosts the all-reduce crosses the network, where it pays most.
    """

    def __init__(
        self,
        coordinator_address: str | None = None,
        num_processes: int | None = None,
        process_id: int | None = None,
        local_device_ids: list[int] | None = None,
        heartbeat_timeout_seconds: int | None = None,
        initialization_timeout: int | None = None,
        *,
        reduction: str | None = None,
        gradient_compression: str | None = None,
    ):
        data_parallel.check_options(reduction, gradient_compression)  # refused before any network wait
        cluster.initialize(
            coordinator_address,
            num_processes,
            process_id,
            local_device_ids,
            heartbeat_timeout_seconds=heartbeat_timeout_seconds,
            initialization_timeout=initialization_timeout,
        )
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        super().__init__(devices, reduction=reduction, gradient_compression=gradient_compression)
