"""Server and worker actors on a Ray cluster: the engines' `Workers` when `cluster="ray"`.

The driver (the training script) runs the engine, which decides what is
computed on which parameters, as on one host. `RayServers` are S actors, each
holding its part of the parameters and optimizer state (`partition`) and
applying the optimizer update to it; `RayWorkers` are N actors running the
exported gradient program. The driver moves references, not arrays: a job's
arguments name each server's offered part, a worker's results are one object
per server, and each server is handed the reference to its part.

Workers come and go: a worker actor that dies, or whose node is lost, is
dropped and its batch redone by another; Ray restarts it (`max_restarts`)
when the cluster has room, and it takes batches again. A lost server ends
`fit` with an error naming it and its node.
"""

from __future__ import annotations

import collections
import sys
import time
import weakref
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from meshfit.core.state import TrainState
from meshfit.core.trees import encode
from meshfit.strategies.parameter_server import ray_actors, ray_cluster
from meshfit.strategies.parameter_server.partition import state_partitions
from meshfit.strategies.parameter_server.server import Task, export_gradients

#: Worker actors are restarted by Ray, as often as it takes, when they die; a task in flight is not retried
#: (the engine redoes its batch elsewhere). Servers are never restarted: their state would be lost.
WORKER_DEFAULTS = {"max_restarts": -1, "max_task_retries": 0, "num_cpus": 1}
SERVER_DEFAULTS = {"max_restarts": 0, "num_cpus": 1}


def log(message: str) -> None:
    print(f"ParameterServerStrategy (Ray): {message}", file=sys.stderr, flush=True)


class ServerLost(RuntimeError):
    """A server actor died, or did not answer within `server_timeout`: the job cannot go on."""


class RemoteGradient(NamedTuple):
    """A gradient held in the object store: one reference per server for each part, and the parts' weights
    (None for one whole-batch gradient; a sync round's real rows per part)."""

    parts: list[list]
    weights: np.ndarray | None = None


def export_update(steps, params_part, opt_part) -> jax.export.Exported:
    """Each server's update program, `(param leaves, opt leaves, grad leaves) -> (param leaves, opt leaves)`.

    The optimizer step of `StepFunctions.apply_gradients` on one server's part
    (every server's part has the same shapes: split leaves in equal parts,
    whole leaves whole).
    """
    params_tree, opt_tree = jax.tree.structure(params_part), jax.tree.structure(opt_part)

    def update(param_leaves, opt_leaves, grad_leaves):
        params, grads = jax.tree.unflatten(params_tree, param_leaves), jax.tree.unflatten(params_tree, grad_leaves)
        state = TrainState(params, None, jax.tree.unflatten(opt_tree, opt_leaves), (), jnp.zeros((), jnp.int32), None)
        new = steps.apply_gradients(state, grads, None, (), None)
        return jax.tree.leaves(new.params), jax.tree.leaves(new.opt_state)

    def avals(tree):
        return [jax.ShapeDtypeStruct(np.shape(a), a.dtype) for a in jax.tree.leaves(tree)]

    return jax.export.export(jax.jit(update))(avals(params_part), avals(opt_part), avals(params_part))


class RayServers:
    """The S server actors as the driver sees them: load a state, offer parameters, apply, hand the state back.

    Calls from the driver to one actor run in the order made, so an offer made
    after an apply sees the update. Every reference the driver holds for a
    server is checked (`check`): a failed one, or one unanswered for
    `server_timeout` seconds, raises `ServerLost` naming the server and its node.
    """

    def __init__(self, ray, steps, state, count: int, min_shard_size: int, options: dict, timeout: float):
        self.ray = ray
        self.timeout = timeout
        self.params_split, self.opt_split = state_partitions(state.params, state.opt_state, count, min_shard_size)
        part = self._parts(state, 0)
        program = export_update(steps, *[jax.tree.unflatten(jax.tree.structure(t), p) for p, t in part])
        actor = ray.remote(ray_actors.ServerActor).options(**options)
        blob = bytes(program.serialize())
        self.actors = [actor.remote(k, count, blob, self.params_split.dims, self.opt_split.dims) for k in range(count)]
        self.placements: list[ray_cluster.Placement] = []
        self.placements = self._get([a.where.remote() for a in self.actors], "start")
        for k, placement in enumerate(self.placements):
            log(f"server {k} runs on {placement}")
        self.pending: list[collections.deque] = [collections.deque() for _ in self.actors]  # (ref, sent)
        self.known = None  # the (params, opt_state) objects the servers hold, as the driver last saw them
        self._offer, self._applied = None, 0

    @property
    def count(self) -> int:
        return len(self.actors)

    def name(self, k: int) -> str:
        return f"parameter server {k} ({self.placements[k]})" if k < len(self.placements) else f"parameter server {k}"

    def load(self, state) -> None:
        """Sends each server its part of `state` (set from outside: the first state, a restore, set_weights)."""
        for k, actor in enumerate(self.actors):
            (params, _), (opt_state, _) = self._parts(state, k)
            self._sent(k, actor.load.remote(params, opt_state))
        self.known = (state.params, state.opt_state)
        self._offer = None

    def holds(self, state) -> bool:
        """Whether the servers hold `state`'s parameters and optimizer state."""
        return self.known is not None and self.known[0] is state.params and self.known[1] is state.opt_state

    def offer(self) -> list:
        """References to each server's offered parameters as of the last update sent (made once per update)."""
        if self._offer is None:
            self._offer = [actor.offer.remote() for actor in self.actors]
            for k, ref in enumerate(self._offer):
                self._sent(k, ref)
        return self._offer

    def apply(self, gradient: RemoteGradient) -> None:
        """Hands each server the references to its parts of `gradient`; it fetches and applies them."""
        for k, actor in enumerate(self.actors):
            self._sent(k, actor.apply.remote(gradient.weights, [part[k] for part in gradient.parts]))
        self._offer = None
        self._applied += 1

    def settled(self, state):
        """`state` with the parameters and optimizer state the servers hold now (fetched to the driver)."""
        replies = self._get([actor.state.remote() for actor in self.actors], "hand back its state")
        params = self.params_split.assemble([list(p) for p, _, _ in replies])
        opt_state = self.opt_split.assemble([list(o) for _, o, _ in replies])
        device = jax.tree.leaves(state.params)[0].sharding
        params = jax.tree.unflatten(jax.tree.structure(state.params), jax.device_put(params, device))
        opt_state = jax.tree.unflatten(jax.tree.structure(state.opt_state), jax.device_put(opt_state, device))
        state = state._replace(params=params, opt_state=opt_state)
        self.known = (state.params, state.opt_state)
        return state

    def traffic(self) -> list[dict[str, int]]:
        """Each server's count of gradient bytes and gradients received and updates applied."""
        return self._get([actor.traffic.remote() for actor in self.actors], "report its traffic")

    def check(self) -> None:
        """Raises `ServerLost` for a server whose call failed or went unanswered for `server_timeout` s."""
        now = time.monotonic()
        for k, pending in enumerate(self.pending):
            while pending:
                ref, sent = pending[0]
                ready, _ = self.ray.wait([ref], timeout=0, fetch_local=False)
                if not ready:
                    if now - sent > self.timeout:
                        self._lost(k, f"it did not answer within server_timeout={self.timeout:g} s")
                    break
                pending.popleft()
                try:
                    answer = self.ray.get(ref, timeout=self.timeout)
                except self.ray.exceptions.RayError as error:
                    self._lost(k, f"{type(error).__name__}: {_first_line(error)}")
                if answer == ray_actors.PART_LOST:
                    log(f"a gradient's part for {self.name(k)} was lost with its worker's node; server {k} skipped it")

    def ping(self) -> None:
        """Asks every server to answer within `server_timeout` (after a worker's job failed: a server's fault?)."""
        self._get([actor.traffic.remote() for actor in self.actors], "answer")

    def close(self) -> None:
        for actor in self.actors:
            self.ray.kill(actor)

    def _sent(self, k: int, ref) -> None:
        self.pending[k].append((ref, time.monotonic()))

    def _get(self, refs: list, what: str) -> list:
        """Results of one call to each server, or `ServerLost` naming the first that failed or was silent."""
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=self.timeout)
        for k, ref in enumerate(refs):
            if ref not in ready:
                self._lost(k, f"it did not {what} within server_timeout={self.timeout:g} s")
            try:
                self.ray.get(ref)
            except self.ray.exceptions.RayError as error:
                self._lost(k, f"{type(error).__name__}: {_first_line(error)}")
        return self.ray.get(refs)

    def _lost(self, k: int, why: str):
        raise ServerLost(
            f"{self.name(k)} was lost: {why}. Its part of the training state is gone, so fit stops here; "
            "every backup is kept: run the script again to resume from BackupAndRestore."
        )

    def _parts(self, state, k: int):
        """Server k's part of the parameters and optimizer state, as host arrays with the trees they fill."""
        params = _host(self.params_split.parts(jax.tree.leaves(state.params), k, whole_everywhere=True))
        opt_state = _host(self.opt_split.parts(jax.tree.leaves(state.opt_state), k, whole_everywhere=True))
        return (params, state.params), (opt_state, state.opt_state)


def _host(leaves) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in leaves]


def _first_line(error) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else "no message"


class _Job(NamedTuple):
    task: Task
    version: int
    refs: list  # one per server (gradient parts), then the rest (module state, increments)
    started: float


class _Worker:
    """One worker actor: where it runs, its job, and whether it is taking jobs."""

    def __init__(self, index: int, actor):
        self.index = index
        self.actor = actor
        self.placement: ray_cluster.Placement | None = None
        self.probe = actor.where.remote()  # answered once the actor runs: it joins
        self.probed = time.monotonic()
        self.job: _Job | None = None
        self.alive = False

    def __str__(self) -> str:
        return f"worker {self.index} ({self.placement or 'not placed yet'})"


#: The driver's pools of actors: an idle one gives its actors up when another starts (`RayWorkers._start`).
_POOLS: weakref.WeakSet[RayWorkers] = weakref.WeakSet()


class RayWorkers:
    """Worker actors on a Ray cluster, with server actors holding the state: the engines' `Workers`.

    Jobs go to idle live workers with references to each server's current
    parameters. A job whose actor died (a node lost, a process killed) or that
    ran past `worker_timeout` is queued again at the front; the worker is
    dropped until Ray has restarted it and it answers again, when it rejoins.
    """

    encoded = True  # module state travels with its RNG keys as raw key data
    applies_updates = True  # the server actors apply the optimizer update

    def __init__(self, strategy, steps):
        self.strategy = strategy
        self.steps = steps
        self.ray = ray_cluster.import_ray()
        self.servers: RayServers | None = None
        self.workers: list[_Worker] = []
        self.pending: collections.deque[Task] = collections.deque()
        self.exported = None
        self.state, self.version = None, 0
        self._model_state = None  # (the module state object, its reference)
        self._settled = self._released = False

    @property
    def count(self) -> int:
        return sum(w.alive for w in self.workers)

    def prepare(self, state, task: Task) -> None:
        """Exports the gradient program for jobs like `task`; starts the servers with `state`, and the workers."""
        self.exported = export_gradients(self.steps, state, task)
        self._start(state)

    @property
    def idle(self) -> bool:
        """Whether the driver holds all the actors hold: nothing queued or computing, the state settled."""
        return self.servers is not None and self._settled and not self.pending and not any(w.job for w in self.workers)

    def release(self) -> None:
        """Ends the actors of an idle pool (the driver holds its state) or of a failed one (a server was lost);
        they start again, from the driver's state, if its model trains again."""
        log(f"the actors of {self.strategy!r} are released")
        self.close()
        self.servers, self.workers, self._released = None, [], True

    def _start(self, state) -> None:
        """Starts the servers with `state` and the workers, after releasing other idle pools' actors.

        A model that is done training keeps its strategy's actors until another
        starts: then they give their resources up, as the driver holds their state.
        """
        for other in list(_POOLS):
            if other is not self and other.idle:
                other.release()
        _POOLS.add(self)
        s = self.strategy
        self.servers = RayServers(
            self.ray, self.steps, state, s.num_servers, s.servers.min_shard_size, s.server_options, s.server_timeout
        )
        self.servers.load(state)
        actor = self.ray.remote(ray_actors.WorkerActor).options(**s.worker_options)
        blob, dims = bytes(self.exported.serialize()), self.servers.params_split.dims
        self.workers = [
            _Worker(i, actor.remote(blob, dims, s.num_servers, s.worker_delays.get(i, 0.0)))
            for i in range(s.num_workers)
        ]
        self._await_workers(s.worker_timeout, any_=False)
        self._settled, self._released = True, False

    def publish(self, state, version: int) -> None:
        if self._released:
            self._start(state)  # released while idle: this model trains again
        elif self.servers is not None and not self.servers.holds(state):
            self.servers.load(state)  # set from outside: a restore, set_weights
            self._settled = True
        self.state, self.version = state, version

    def submit(self, task: Task) -> None:
        self.pending.append(task)

    def collect(self, timeout: float) -> list[tuple[Task, int, tuple]]:
        try:
            return self._collect(timeout)
        except ServerLost:
            self.release()  # the job cannot go on: its resources go back to the cluster
            raise

    def _collect(self, timeout: float) -> list[tuple[Task, int, tuple]]:
        self.servers.check()
        self._probe()
        if not self.count:
            self._await_workers(self.strategy.worker_timeout, any_=True)
        self._dispatch()
        busy = [w for w in self.workers if w.job is not None]
        if not busy:
            return []
        rests = [w.job.refs[-1] for w in busy]
        ready, _ = self.ray.wait(rests, num_returns=1, timeout=timeout)
        if ready:
            ready, _ = self.ray.wait(rests, num_returns=len(rests), timeout=0)
        now, results = time.monotonic(), []
        for worker, rest in zip(busy, rests, strict=True):
            job = worker.job
            if rest not in ready:
                if now - job.started > self.strategy.worker_timeout:
                    self._drop(worker, f"no answer within worker_timeout={self.strategy.worker_timeout:g} s")
                    self.ray.kill(worker.actor, no_restart=False)  # Ray restarts it; it rejoins when it answers
                continue
            try:
                leaves = self.ray.get(rest)
            except self.ray.exceptions.RayError as error:
                self.servers.ping()  # a server's loss ends fit; a worker's is survived
                self._drop(worker, f"{type(error).__name__}: {_first_line(error)}")
                continue
            worker.job = None
            grads = RemoteGradient([job.refs[:-1]])
            _, model_state, increments = jax.tree.unflatten(
                self.exported.out_tree, [None] * len(self.servers.params_split.dims) + leaves
            )
            results.append((job.task, job.version, (grads, model_state, increments)))
        return results

    def combine(self, gradients: list[RemoteGradient], weights) -> RemoteGradient:
        """A sync round's gradients, weighted by real rows: each server averages its parts as it applies them."""
        return RemoteGradient([g.parts[0] for g in gradients], np.asarray(weights, np.float32))

    def take(self, state, result, staleness: int | None) -> tuple:
        grads, model_state, increments = result
        self.servers.apply(grads)
        self._settled = False
        return None, model_state, increments

    def settled(self, state):
        if self.servers is None:
            return state
        try:
            state = self.servers.settled(state)
        except ServerLost:
            self.release()
            raise
        self._settled = True
        return state

    def end_call(self) -> None:
        """Nothing to tell: the servers take their calls from the driver."""

    def close(self) -> None:
        """Ends the actors (nothing to end once Ray has shut down: at exit, it ended them)."""
        if not self.ray.is_initialized():
            return
        for worker in self.workers:
            self.ray.kill(worker.actor, no_restart=True)
        if self.servers is not None:
            self.servers.close()

    def traffic(self) -> list[dict[str, int]]:
        """Each server's gradient bytes and gradients received and updates applied (for benchmarks)."""
        return self.servers.traffic()

    # -- workers joining, lost, given jobs --------------------------------------------------

    def _probe(self) -> None:
        """Workers whose actor answers its placement probe join (at start, or restarted after a loss)."""
        now = time.monotonic()
        for worker in self.workers:
            if not worker.alive and worker.probe is None and now - worker.probed > 1.0:
                worker.probe, worker.probed = worker.actor.where.remote(), now  # ask a lost one again
        probes = [w for w in self.workers if not w.alive and w.probe is not None]
        if not probes:
            return
        ready, _ = self.ray.wait([w.probe for w in probes], num_returns=len(probes), timeout=0)
        for worker in probes:
            if worker.probe not in ready:
                continue
            try:
                worker.placement = self.ray.get(worker.probe)
            except self.ray.exceptions.RayError:
                worker.probe = None  # restarting, or gone for good: ask again later
                continue
            worker.probe, worker.alive = None, True
            log(f"{worker} joined")

    def _await_workers(self, timeout: float, any_: bool) -> None:
        """Waits up to `timeout` s for the first worker to join (`any_`) or for all of them to."""
        deadline = time.monotonic() + timeout
        while True:
            self._probe()
            if (self.count and any_) or self.count == len(self.workers):
                return
            if time.monotonic() > deadline:
                if self.count:
                    return  # start with those there; the others join when they can
                raise RuntimeError(
                    f"No parameter-server worker actor is running after {timeout:g} s (worker_timeout): the Ray "
                    f"cluster has no room for them with worker_options={self.strategy.worker_options!r} "
                    f"(see `ray status`), or they all were lost. Add nodes, or change worker_options."
                )
            time.sleep(0.05)

    def _drop(self, worker: _Worker, why: str) -> None:
        """A lost worker: its job is queued again, and it rejoins once Ray has restarted it."""
        if worker.job is not None:
            self.pending.appendleft(worker.job.task)
        worker.job, worker.alive = None, False
        worker.probe, worker.probed = None, time.monotonic()
        log(f"{worker} lost ({why}); its batch is redone elsewhere")

    def _model_state_ref(self, state):
        if self._model_state is None or self._model_state[0] is not state.model_state:
            leaves = _host(jax.tree.leaves(encode(state.model_state)))
            self._model_state = (state.model_state, self.ray.put(leaves))
        return self._model_state[1]

    def _dispatch(self) -> None:
        """Hands queued jobs to idle live workers, with references to each server's current parameters."""
        idle = [w for w in self.workers if w.alive and w.job is None]
        if not idle or not self.pending:
            return
        offer, model_state = self.servers.offer(), self._model_state_ref(self.state)
        for worker in idle:
            if not self.pending:
                return
            task = self.pending.popleft()
            batch = _host(jax.tree.leaves((task.batch, task.rng, task.salt)))
            refs = worker.actor.compute.options(num_returns=self.servers.count + 1).remote(batch, model_state, *offer)
            worker.job = _Job(task, self.version, list(refs), time.monotonic())
