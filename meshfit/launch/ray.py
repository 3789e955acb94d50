"""`meshfit launch --ray`: the ranks of a `jax.distributed` job as processes of Ray actors on a Ray cluster.

One actor per rank, each in its own bundle of a placement group (`--resources-per-proc`, `--placement`);
each actor runs the script as its subprocess with the environment the local launcher gives that rank
(`launch.process_env`, the job's `JobLayout`), except that the coordinator is rank 0's node's IP and a
free port found on that node. The launcher prints every rank's output with its rank, and ends the job
by `launch`'s rules: a failed rank stops the others (named with its node), SIGTERM to the launcher is
passed on to every rank, which gets `--grace-period` seconds for its preemption backup. As Ray Train's
JAX trainer does, but for meshfit's own strategies (MultiWorkerMirrored, Mesh) and scripts.

With `BackupAndRestore(memory_freq=K)` in the script, a snapshot keeper runs on each node that runs ranks
for the whole launch (`meshfit.launch.ray_keepers`): a restart after a lost node resumes from the replicas
on the nodes left. With `--min-nprocs M`, a restart whose ranks the cluster cannot all place within
`--elastic-wait` seconds (a node gone for good) runs the largest number of ranks down to M that it places
(`RayRunner._place`, sizes from `ray_placement.placeable`), resuming onto the smaller world.

The script (and `cwd`) must be where every node can read it: the same path on a shared filesystem, or
in the image every node runs. Ray is imported only here, only for `--ray`.

Security is the cluster's: run it with Ray's token authentication (`RAY_AUTH_MODE=token`), and keep the
nodes on a private network, since the ranks' own ports (meshfit's handshake and JAX's coordination service
on rank 0's node address, gloo's TCP in every rank) listen there without authentication
(docs/multi_host.md, "Securing a `--ray` job").
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, TextIO

from meshfit.launch.local import (
    FAILURE_GRACE_SECONDS,
    GLOO_CONNECTED,
    LaunchConfig,
    Outcome,
    Signals,
    die_with_parent,
    free_port,
    process_command,
    process_env,
)
from meshfit.runtime import exit_report
from meshfit.runtime.job_layout import DistributedJob, JobStart, status_text

PLACEMENTS = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
#: Seconds to wait for the cluster to place every rank's bundle before giving up.
PLACEMENT_TIMEOUT = 120.0
#: With `--min-nprocs`: seconds a restart waits for each placement group (every rank first, then fewer)
#: before it tries a smaller one.
ELASTIC_WAIT = 10.0
LOST = 1  # the job's status when a rank's actor (its node) was lost: no exit status to pass on


@dataclass(frozen=True)
class RayOptions:
    """Where and how the ranks run on Ray."""

    #: The cluster to join ("ray://...", "HOST:PORT", "auto"); None: `RAY_ADDRESS`, a running local cluster,
    #: else a new local one.
    address: str | None = None
    #: Each rank's bundle of the placement group, in Ray's resource names ({"CPU": 1, "GPU": 1}).
    resources: dict[str, float] = field(default_factory=lambda: {"CPU": 1})
    #: The placement group's strategy: PACK (fewest nodes), SPREAD (a node each where possible), STRICT_*.
    placement: str = "PACK"
    #: With `--min-nprocs`: seconds a restart waits for the cluster to place each size it tries
    #: (`--elastic-wait`), from every rank down to the fewest.
    elastic_wait: float = ELASTIC_WAIT


def parse_resources(text: str) -> dict[str, float]:
    """`--resources-per-proc` JSON as a bundle, or a ValueError naming the argument."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if (
        not isinstance(value, dict)
        or not value
        or not all(isinstance(k, str) and isinstance(v, int | float) and v >= 0 for k, v in value.items())
    ):
        raise ValueError(
            "--resources-per-proc expected a JSON object of Ray resources and amounts, e.g. "
            f'\'{{"CPU": 4, "GPU": 1}}\'. Received: {text!r}.'
        )
    return value


class _Rank:
    """One rank: a Ray actor that runs the script as its subprocess and hands its output to the launcher."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.lines: queue.Queue = queue.Queue()
        self.status: int | None = None
        self.done = threading.Event()
        self.reports = tempfile.mkdtemp(prefix="meshfit-exits-")  # mode 0700, on the rank's node

    def where(self) -> tuple[str, str]:
        """This actor's node: (node id, IP)."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def free_port(self) -> int:
        """A port free on this node, for the coordinator."""
        return free_port()

    def start(self, config: LaunchConfig, rank: int, start: JobStart, attempt: int, cwd: str) -> int:
        """Starts the script as rank `rank`; returns its pid."""
        import ray

        if ray.get_gpu_ids():  # Ray gave this actor GPUs (CUDA_VISIBLE_DEVICES): the rank keeps them
            config = replace(config, devices_per_proc=None)
        env = process_env(config, rank, start, attempt, gpus=0)
        env[exit_report.ENV_EXIT_REPORT] = os.path.join(self.reports, "report.json")
        self.proc = subprocess.Popen(
            process_command(config, rank),
            env=env,
            cwd=cwd if os.path.isdir(cwd) else None,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            preexec_fn=die_with_parent(),  # an actor killed (or its node lost) takes its rank along
        )
        threading.Thread(target=self._pump, daemon=True).start()
        return self.proc.pid

    def _pump(self) -> None:
        for line in iter(self.proc.stdout.readline, ""):
            self.lines.put(line if line.endswith("\n") else line + "\n")
        self.proc.stdout.close()
        self.status = self.proc.wait()
        self.done.set()
        self.lines.put(None)

    def read(self, timeout: float) -> tuple[list[str], int | None]:
        """The lines written since the last read (waiting up to `timeout` for one), and the exit status once
        the process ended and all its output was read."""
        lines = []
        try:
            item = self.lines.get(timeout=timeout)
            while True:
                if item is None:
                    return lines, self.status
                lines.append(item)
                item = self.lines.get_nowait()
        except queue.Empty:
            return lines, None

    def report(self) -> dict | None:
        """What the rank reported of the exception that ended it (`exit_report`); None if nothing. Removes the
        report's directory: the actor's last call."""
        said = exit_report.read(os.path.join(self.reports, "report.json"))
        shutil.rmtree(self.reports, ignore_errors=True)
        return said

    def signal(self, signum: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum)

    def stop(self, grace: float) -> tuple[int | None, bool]:
        """SIGTERM, then SIGKILL after `grace` seconds; returns (exit status, whether it was killed)."""
        if self.proc is None:
            return None, False
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace)
            killed = False
        except subprocess.TimeoutExpired:
            self.proc.kill()
            killed = True
        self.done.wait(10)
        return self.proc.wait(), killed


def _connect(ray, options: RayOptions, nprocs: int) -> None:
    if ray.is_initialized():
        return
    if options.address:
        ray.init(address=options.address)
    else:
        from meshfit.strategies.parameter_server import ray_cluster

        ray_cluster.connect(nprocs)


def _bundle_options(resources: dict[str, float]) -> dict[str, Any]:
    """The actor's own request: its whole bundle (so Ray sets CUDA_VISIBLE_DEVICES to its GPUs)."""
    rest = {k: v for k, v in resources.items() if k not in ("CPU", "GPU", "memory")}
    return {
        "num_cpus": resources.get("CPU", 0),
        "num_gpus": resources.get("GPU", 0),
        **({"memory": resources["memory"]} if "memory" in resources else {}),
        **({"resources": rest} if rest else {}),
    }


class RayRunner:
    """Runs one start of a job on Ray (a `launch.Runner`): `launch(config, runner=RayRunner(options))`."""

    def __init__(self, options: RayOptions):
        if options.placement not in PLACEMENTS:
            raise ValueError(f"--placement expected one of {', '.join(PLACEMENTS)}. Received: {options.placement!r}.")
        self.options = options
        self.keepers = None  # the memory tier's keepers (`ray_keepers.NodeKeepers`), for the whole launch
        self.nodes: list[tuple[str, str]] = []  # the last start's ranks' nodes (node id, IP)

    #: `launch` lets `--min-nprocs` through to this runner, which sizes each restart itself (`_place`).
    elastic = True

    def close(self) -> None:
        """Ends the launch's snapshot keepers (after its last start)."""
        if self.keepers is not None:
            self.keepers.close()
            self.keepers = None

    def __call__(self, config: LaunchConfig, attempt: int, log: TextIO = sys.stderr) -> Outcome:
        if not isinstance(config.layout, DistributedJob):
            raise ValueError(
                "meshfit launch --ray runs --nprocs N jobs (MultiWorkerMirrored, Mesh). Received another kind "
                f"of job ({type(config.layout).__name__}); on Ray, use ParameterServerStrategy(cluster='ray')."
            )
        from meshfit.strategies.parameter_server.ray_cluster import import_ray

        ray = import_ray("meshfit launch --ray")
        _connect(ray, self.options, config.nprocs)
        from ray.util.placement_group import remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group, n = self._place(ray, config, attempt, log)
        if n != config.nprocs:
            layout = config.layout.resized(n)
            assert layout is not None  # `launch` refuses --min-nprocs for layouts that cannot resize
            config = replace(config, layout=layout)
        actors = []
        try:
            remote = ray.remote(_Rank)
            actors = [
                remote.options(
                    max_concurrency=4,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank),
                    **_bundle_options(self.options.resources),
                ).remote()
                for rank in range(n)
            ]
            if config.layout.keeps_snapshots and self.keepers is None:
                from meshfit.launch.ray_keepers import NodeKeepers

                self.keepers = NodeKeepers(ray, log)
            job = _Job(ray, config, actors, attempt, log, self.keepers)
            self.nodes = job.nodes
            return job.run()
        finally:
            for actor in actors:
                ray.kill(actor)
            remove_placement_group(group)

    def _group(self, ray, n: int, wait: float):
        """A placement group of `n` ranks' bundles once placed within `wait` seconds; None (removed) if not."""
        from ray.util.placement_group import placement_group, remove_placement_group

        group = placement_group([dict(self.options.resources)] * n, strategy=self.options.placement)
        if group.wait(timeout_seconds=wait):
            return group
        remove_placement_group(group)
        return None

    def _place(self, ray, config: LaunchConfig, attempt: int, log: TextIO):
        """The placement group of this start and its number of ranks.

        Every rank, waiting up to `PLACEMENT_TIMEOUT`; with `--min-nprocs M` in a restart, every rank if the
        cluster places them within `elastic_wait` seconds, else the largest n >= M that it places (sizes
        from what the live nodes can hold, `ray_placement.placeable`, down to M, `elastic_wait` each; M
        itself up to `PLACEMENT_TIMEOUT`).
        """
        from meshfit.launch.ray_placement import placeable

        n, fewest = config.nprocs, config.min_nprocs
        elastic = attempt > 0 and fewest is not None and fewest < n
        group = self._group(ray, n, self.options.elastic_wait if elastic else PLACEMENT_TIMEOUT)
        if group is not None:
            return group, n
        if elastic:
            assert fewest is not None
            alive = [node for node in ray.nodes() if node.get("Alive")]
            fits = placeable(
                [node.get("Resources", {}) for node in alive], self.options.resources, self.options.placement, n - 1
            )
            for size in range(max(fits, fewest), fewest - 1, -1):
                group = self._group(ray, size, self.options.elastic_wait if size > fewest else PLACEMENT_TIMEOUT)
                if group is not None:
                    log.write(
                        f"[launch] {self._why(alive, n)}; restarting with {size} of {n} processes "
                        f"(--min-nprocs {fewest}).\n"
                    )
                    log.flush()
                    return group, size
            n = fewest
        raise ValueError(
            f"the Ray cluster could not place {n} bundles of --resources-per-proc "
            f"{json.dumps(self.options.resources)} ({self.options.placement}) within {PLACEMENT_TIMEOUT:g} s. "
            f"Received: cluster resources {ray.cluster_resources()}. Ask for fewer processes or resources."
        )

    def _why(self, alive: list[dict], n: int) -> str:
        """Why a restart cannot place every rank: the nodes of the last start that are gone, if any."""
        ids = {node.get("NodeID") for node in alive}
        gone = sorted({(node_id, ip) for node_id, ip in self.nodes if node_id not in ids})
        if gone:
            names = ", ".join(f"{ip} (node id {node_id[:12]})" for node_id, ip in gone)
            return f"node{'s' if len(gone) > 1 else ''} {names} {'are' if len(gone) > 1 else 'is'} gone"
        return (
            f"the cluster cannot place {n} bundles of {json.dumps(self.options.resources)} "
            f"({self.options.placement}) within {self.options.elastic_wait:g} s"
        )


class _Job:
    """One start of the job: the ranks' actors, their output, their exits."""

    def __init__(self, ray, config: LaunchConfig, actors: list, attempt: int, log: TextIO, keepers=None):
        self.ray, self.config, self.actors, self.log = ray, config, actors, log
        self.nodes = ray.get([actor.where.remote() for actor in actors])
        if keepers is not None:  # the memory tier: each rank's node's keeper, its replicas, the step to resume
            config = self.config = replace(config, env={**config.env, **keepers.env(self.nodes)})
        self.pids: list[int | None] = [None] * len(actors)
        port = ray.get(actors[0].free_port.remote())
        start = JobStart(
            coordinator_port=port,
            control_port=0,
            heartbeat_timeout=config.heartbeat_timeout,
            coordinator_host=self.nodes[0][1],
        )
        self.pids = ray.get(
            [actor.start.remote(config, rank, start, attempt, os.getcwd()) for rank, actor in enumerate(actors)]
        )
        for rank in range(len(actors)):
            log.write(f"[launch] rank {rank} runs on {self.where(rank)}.\n")
        log.flush()
        self.reads = {actor.read.remote(0.2): rank for rank, actor in enumerate(actors)}
        self.order: list[tuple[int, int]] = []  # (rank, status), in the order the launcher learnt of them

    def where(self, rank: int) -> str:
        node_id, ip = self.nodes[rank]
        return f"node {ip} (node id {node_id[:12]}), pid {self.pids[rank]}"

    def _poll(self, timeout: float) -> None:
        """Prints the output that came, records the exits."""
        if not self.reads:
            time.sleep(timeout)
            return
        ready, _ = self.ray.wait(list(self.reads), num_returns=len(self.reads), timeout=timeout)
        for ref in ready:
            rank = self.reads.pop(ref)
            try:
                lines, status = self.ray.get(ref)
            except self.ray.exceptions.RayActorError as error:
                self.log.write(
                    f"[launch] rank {rank}'s actor on {self.where(rank)} died (its node lost, or the actor killed): "
                    f"{str(error).splitlines()[0]}\n"
                )
                self.order.append((rank, LOST))
                continue
            for line in lines:
                if self.config.verbose or not GLOO_CONNECTED.match(line):
                    sys.stdout.write(f"[rank {rank}] {line}")
            sys.stdout.flush()
            if status is None:
                self.reads[self.actors[rank].read.remote(0.2)] = rank
            else:
                self.order.append((rank, status))

    def run(self) -> Outcome:
        """Runs the start to its end; its outcome, with the failed ranks' reports (`exit_report`)."""
        layout = self.config.layout
        judged: set[int] = set()
        with Signals() as signals:
            try:
                status = None
                while status is None:
                    self._poll(0.1)
                    if signals.received is not None:
                        name = signal.Signals(signals.received).name
                        self.log.write(
                            f"[launch] received {name}: sending SIGTERM to every rank and waiting up to "
                            f"{self.config.grace_period:g} s for their preemption backups.\n"
                        )
                        status = -signals.received
                        break
                    for rank, code in self.order:
                        if code != 0 and rank not in judged:
                            judged.add(rank)
                            verdict = layout.judge_exit(rank, code)
                            self.log.write(f"[launch] {verdict.message} Rank {rank} ran on {self.where(rank)}.\n")
                            if verdict.ends_job:
                                status = code
                                break
                    if status is None and layout.is_complete(dict(self.order)):
                        status = 0
            except KeyboardInterrupt:
                status = -signal.SIGINT
            signalled = signals.received is not None or status == -signal.SIGINT
            if signalled:
                grace = self.config.grace_period
            else:  # after a failure, nothing the others could still do is worth waiting for (`launch.local`)
                grace = self.config.stop_grace if status == 0 else min(self.config.stop_grace, FAILURE_GRACE_SECONDS)
            failures = tuple((rank, code) for rank, code in self.order if code != 0)
            self._stop(grace, signalled)
        if signalled or not failures:
            return Outcome(status)
        reports = {}
        for rank, ref in {rank: self.actors[rank].report.remote() for rank, _ in failures}.items():
            try:
                said = self.ray.get(ref, timeout=30)
            except (self.ray.exceptions.RayError, self.ray.exceptions.GetTimeoutError):
                said = None  # a lost node: no report
            if said is not None:
                reports[rank] = said
        return Outcome(status, failed_rank=failures[0][0], failures=failures, reports=reports)

    def _stop(self, grace: float, report: bool) -> None:
        """Stops every rank still running, drains their output; with `report`, writes how each ended."""
        ended = dict(self.order)
        stops = {rank: actor.stop.remote(grace) for rank, actor in enumerate(self.actors) if rank not in ended}
        for rank, ref in stops.items():
            try:
                code, killed = self.ray.get(ref, timeout=grace + 30)
            except (self.ray.exceptions.RayError, self.ray.exceptions.GetTimeoutError):
                continue
            ended[rank] = code
            if killed:
                self.log.write(f"[launch] rank {rank} on {self.where(rank)} did not end within {grace:g} s: killed.\n")
        deadline = time.monotonic() + 5
        while self.reads and time.monotonic() < deadline:  # the output written before the ranks ended
            self._poll(0.2)
        if report:
            for rank in range(len(self.actors)):
                self.log.write(
                    f"[launch] rank {rank} on {self.where(rank)} ended with status "
                    f"{status_text(ended[rank]) if ended.get(rank) is not None else 'unknown'}.\n"
                )
