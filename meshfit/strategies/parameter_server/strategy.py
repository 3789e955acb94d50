"""ParameterServerStrategy: workers compute gradients, a server applies them.

On one host each worker is a local device running in its own thread; the
parameters and optimizer state live on the server device (host memory by
default). Under `meshfit launch --ps N --workers M`, the workers are separate
processes that run `worker`, not the training script; a worker that dies is
dropped while training goes on. The N server processes run the script and
`fit`; rank 0 also coordinates (`coordinator`), and with N > 1 the state is
partitioned over the servers (`partition`, `follower`). With `cluster="ray"`
the workers and servers are Ray actors and the script is the Ray driver
(`ray_workers`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax

from meshfit.runtime import cluster as jax_cluster
from meshfit.strategies.base import Capabilities, Strategy, TrainFunction
from meshfit.strategies.parameter_server import launcher, partition, transport
from meshfit.strategies.parameter_server.coordinator import Coordinator, RemoteWorkers
from meshfit.strategies.parameter_server.engines import AsyncEngine, SyncEngine
from meshfit.strategies.parameter_server.follower import FollowerEngine, FollowerLink
from meshfit.strategies.parameter_server.server import ServerLayout
from meshfit.strategies.parameter_server.threads import LocalWorkers

if TYPE_CHECKING:
    from meshfit.core.state import TrainState
    from meshfit.steps.builtin import StepFunctions

MODES = ("async", "sync")


class ParameterServerStrategy(Strategy):
    """Parameter-server training: local devices as workers, or worker processes.

    `mode="async"` (default): each batch goes whole to the next free worker,
    which pulls the current parameters, computes gradients and pushes them;
    the server applies each gradient with the optax optimizer as it arrives.
    Workers never wait for each other, so a slow worker does not slow the
    others. A gradient computed on parameters more than `max_staleness`
    versions old is dropped and its batch redone. The logs report the mean
    and maximum staleness of the applied gradients (`staleness`,
    `max_staleness`).

    `mode="sync"`: each global batch is split over the workers; their
    gradients are averaged (weighted by real rows) and applied once — the
    same updates as MirroredStrategy on the same batches for modules without
    randomness (each part of a round draws its own dropout masks, salted by
    step and part, where MirroredStrategy draws one for the global batch).

    Evaluation and prediction run on the server device with the current
    parameters. Module state updated in the forward pass (BatchNorm
    statistics) is taken from the worker whose gradient was applied last.

    Under `meshfit launch --ps S --workers N` only the S server ranks run the
    script; the worker ranks run `python -m meshfit.strategies.parameter_server.worker`
    and receive the gradient computation from rank 0. Creating the strategy
    in a process whose `MESHFIT_PS_ROLE` is `worker` raises a RuntimeError.

    Args:
        mode: "async" or "sync".
        workers: worker devices (all local devices by default).
        server_device: where parameters and optimizer state live: one device
            (the host CPU by default; the server's first device under
            `meshfit launch --ps 1`), or a list of devices to partition them over, like
            tf.distribute's variable partitioner: each parameter with at least
            `min_shard_size` elements is split along its largest dimension
            that divides by the number of servers, its optimizer state with
            it, and every server device applies the update to its part. Under
            `meshfit launch --ps N` with N > 1 leave it unset: the state is
            partitioned over the first device of each server process.
        min_shard_size: parameters with fewer elements stay whole (replicated
            on every server device) when the state is partitioned.
        max_staleness: in parameter versions; None for no bound.
        worker_delays: {worker index: seconds} slept after each gradient, to
            simulate stragglers in tests and benchmarks.
        worker_timeout: seconds a worker process (or Ray actor) may hold a
            batch before it is taken for lost (hung, stopped, cut off): it is
            dropped and its batch redone elsewhere. Worker processes only.
        cluster: None (this host's devices, or `meshfit launch --ps`), or
            "ray": workers and servers are actors on the Ray cluster this
            process initialized (`ray.init(address=...)`, `RAY_ADDRESS`), or on
            a local one it starts and shuts down at exit. Needs
            `pip install "meshfit[ray]"`; see docs/parameter_server.md.
        num_workers: worker actors (`cluster="ray"`).
        num_servers: server actors the state is partitioned over
            (`cluster="ray"`, by `min_shard_size` as above); each applies the
            optimizer update to its part.
        worker_options: Ray actor options for the workers (`num_cpus`,
            `num_gpus`, `resources`, `scheduling_strategy`, `runtime_env`,
            ...), over meshfit's defaults (`num_cpus=1`; restarted by Ray).
        server_options: the same for the servers (not restarted: a lost
            server ends `fit`).
        server_timeout: seconds a server actor may leave a call unanswered
            before fit ends with an error naming it (`cluster="ray"`).
    """

    capabilities = Capabilities(
        stages_batches=False,  # each batch goes whole to one worker, from the host
        loss_scaling=False,  # workers compute gradients, the server applies them
        scalar_loss_refusal="its workers compute gradients apart from the server (on parts of each batch in "
        "sync mode), with one gradient program for every batch",
    )

    def __init__(
        self,
        mode: str = "async",
        workers: Sequence[jax.Device] | None = None,
        server_device: jax.Device | Sequence[jax.Device] | None = None,
        max_staleness: int | None = None,
        worker_delays: dict[int, float] | None = None,
        worker_timeout: float = 60.0,
        min_shard_size: int = 2**12,
        cluster: str | None = None,
        num_workers: int | None = None,
        num_servers: int = 1,
        worker_options: dict[str, Any] | None = None,
        server_options: dict[str, Any] | None = None,
        server_timeout: float = 60.0,
    ):
        role = transport.role()
        if role == "worker":
            raise RuntimeError(
                f"This process has {launcher.ENV_PS_ROLE}=worker: a parameter-server worker, which runs "
                f"`python -m {launcher.PS_WORKER_MODULE}`, not the training script. Start the script with "
                f"`meshfit launch --ps S --workers N script.py`, or unset {launcher.ENV_PS_ROLE} to train here."
            )
        if mode not in MODES:
            raise ValueError(f"`mode` must be one of {MODES}. Received: mode={mode!r}.")
        if role is not None and (workers is not None or worker_delays):
            raise ValueError(
                "`workers` and `worker_delays` apply to one-host training; "
                "under `meshfit launch --ps` the worker processes are the workers."
            )
        servers = transport.server_count() if role is not None else 1
        if servers > 1 and server_device is not None:
            raise ValueError(
                f"Under `meshfit launch --ps {servers}` each server process holds its part of the "
                "state on its first device; leave `server_device` unset. "
                f"Received: server_device={server_device!r}."
            )
        if max_staleness is not None and (not isinstance(max_staleness, int) or max_staleness < 0):
            raise ValueError(f"`max_staleness` must be a non-negative int or None. Received: {max_staleness!r}.")
        if not isinstance(worker_timeout, (int, float)) or worker_timeout <= 0:
            raise ValueError(f"`worker_timeout` must be a positive number of seconds. Received: {worker_timeout!r}.")
        self.cluster = self._check_cluster(cluster, role, workers, server_device, num_workers, num_servers)
        if self.cluster == "ray":
            self._use_ray(num_workers, num_servers, worker_options, server_options, server_timeout)
        if servers > 1:
            jax_cluster.initialize()  # the server processes' own jax.distributed job
            server_device = partition.server_devices()
        self.mode = mode
        self.worker_timeout = float(worker_timeout)
        self.workers = list(workers) if workers is not None else jax.local_devices()
        if not self.workers:
            raise ValueError("ParameterServerStrategy needs at least one worker device. Received: workers=[].")
        if server_device is None:
            try:
                server_device = jax.local_devices(backend="cpu")[0]
            except RuntimeError:
                server_device = self.workers[0]
            if role is not None:
                server_device = jax.local_devices()[0]
        self.servers = ServerLayout(server_device, min_shard_size)
        self.server_device = self.servers.devices[jax.process_index() if servers > 1 else 0]
        self.max_staleness = max_staleness
        self.worker_delays = dict(worker_delays or {})
        self.num_replicas_in_sync = len(self.workers) if mode == "sync" else 1
        if self.cluster == "ray":
            self.num_replicas_in_sync = self.num_workers if mode == "sync" else 1
        self._coordinator = self._link = None
        if role is not None:
            worker_processes = int(os.environ[launcher.ENV_PS_WORKERS])
            self.num_replicas_in_sync = worker_processes if mode == "sync" else 1
            if role == "coordinator":
                self._coordinator = Coordinator(worker_processes, servers, worker_timeout=self.worker_timeout)
            else:
                self._link = FollowerLink()

    @staticmethod
    def _check_cluster(cluster, role, workers, server_device, num_workers, num_servers) -> str | None:
        if cluster not in (None, "ray"):
            raise ValueError(f'`cluster` must be None or "ray". Received: cluster={cluster!r}.')
        if cluster is None:
            if num_workers is not None or num_servers != 1:
                raise ValueError(
                    '`num_workers` and `num_servers` count Ray actors; pass cluster="ray" with them. '
                    f"Received: num_workers={num_workers!r}, num_servers={num_servers!r}, cluster=None."
                )
            return None
        if role is not None:
            raise ValueError(
                'cluster="ray" runs workers and servers as Ray actors; do not start the script with '
                "`meshfit launch --ps`: run it as a plain script (the Ray driver)."
            )
        if workers is not None or server_device is not None:
            raise ValueError(
                'With cluster="ray" the workers and servers are Ray actors: leave `workers` and `server_device` '
                "unset and use `num_workers`, `num_servers`, `worker_options` and `server_options`."
            )
        for name, value in (("num_workers", num_workers), ("num_servers", num_servers)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f'`{name}` must be a positive int with cluster="ray". Received: {name}={value!r}.')
        return cluster

    def _use_ray(self, num_workers, num_servers, worker_options, server_options, server_timeout) -> None:
        """Checks the Ray arguments, then joins the initialized Ray cluster or starts a local one."""
        from meshfit.strategies.parameter_server import ray_cluster, ray_workers

        if not isinstance(server_timeout, (int, float)) or server_timeout <= 0:
            raise ValueError(f"`server_timeout` must be a positive number of seconds. Received: {server_timeout!r}.")
        self.num_workers, self.num_servers, self.server_timeout = num_workers, num_servers, float(server_timeout)
        self.worker_options = ray_cluster.options(ray_workers.WORKER_DEFAULTS, worker_options, "worker_options")
        self.server_options = ray_cluster.options(ray_workers.SERVER_DEFAULTS, server_options, "server_options")
        self.started_ray = ray_cluster.connect(num_workers + num_servers)

    def server_traffic(self) -> list[dict[str, int]]:
        """What each server actor received since it started (`cluster="ray"`): gradient `bytes`, `gradients`,
        and updates `applied`: a measurement, asked of the actors of the last train function built."""
        if getattr(self, "_ray_workers", None) is None or self._ray_workers.servers is None:
            raise RuntimeError(
                'server_traffic() counts what Ray server actors received: train with cluster="ray" first.'
            )
        return self._ray_workers.traffic()

    @property
    def batch_block(self) -> tuple[int, int]:
        return 0, 1  # every server process reads whole batches; only rank 0 hands them out

    def place_state(self, state: TrainState, param_hints: Any = None) -> TrainState:
        return self.servers.place_state(state)

    def replicate(self, tree: Any) -> Any:
        return self.servers.replicate(tree)

    def distribute_batch(self, host_batch: Any, stacked: bool = False) -> Any:
        return host_batch  # workers (or the server, for evaluation) take their rows themselves

    def train_function(self, steps: StepFunctions, stacked: bool) -> TrainFunction:
        if stacked:
            raise ValueError("ParameterServerStrategy runs one batch per step; compile with steps_per_execution=1.")
        if self._link is not None:
            return FollowerEngine(self, steps, self._link, asynchronous=self.mode == "async")
        if self.cluster == "ray":
            from meshfit.strategies.parameter_server.ray_workers import RayWorkers

            workers = self._ray_workers = RayWorkers(self, steps)
        elif self._coordinator is not None:
            workers = RemoteWorkers(self, steps, self._coordinator)
        else:
            workers = LocalWorkers(self, steps, threads=self.mode == "async")
        return (AsyncEngine if self.mode == "async" else SyncEngine)(self, steps, workers)

    def __repr__(self) -> str:
        if self.cluster == "ray":
            return (
                f"ParameterServerStrategy(mode={self.mode!r}, cluster='ray', num_workers={self.num_workers}, "
                f"num_servers={self.num_servers})"
            )
        return f"ParameterServerStrategy(mode={self.mode!r}, workers={len(self.workers)})"
