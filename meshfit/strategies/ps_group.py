"""Several parameter-server processes holding one partitioned state, kept in lockstep.

Under `meshfit launch --ps N` with N > 1, the server processes form a
`jax.distributed` job of their own. Workers stay outside it, so a dead worker
takes nobody down, while a dead server fails the job, as it must. The server
state is one set of global arrays over a one-axis mesh with one device of each
server process (`ServerLayout`): each large parameter and its optimizer state
are split over the servers, and every update is one SPMD program in which each
server updates its part.

Every server process runs the user's script, so evaluation, callbacks and
checkpoints run on all of them, as in any multi-process job. Only rank 0 talks
to workers and decides what happens when. It sends each decision to the other
servers over the authenticated control channel, and they replay it:

    ("offer", pull_ids)        offer this server's part of the parameters to workers
    ("apply", take_id, s)      pull this server's part of a worker's result from
                               rank 0 and apply it (s: its staleness, or None)
    ("return",)                the end of one call of the train function

Workers pull each server's part of the parameters from that server. Results
come back whole to rank 0, which must have a worker's whole result before it
applies it; rank 0 then hands each other server its part.
"""

from __future__ import annotations

import datetime

import jax
import jax.numpy as jnp

from meshfit.checkpoint import encode
from meshfit.strategies.ps_server import SERVER_AXIS, ServerUpdates, local

#: How long an offered array waits to be pulled before its transfer server lets it go.
HOLD_TIMEOUT = datetime.timedelta(seconds=120)
PULL_TIMEOUT = datetime.timedelta(seconds=30)


def deadline(delta: datetime.timedelta = PULL_TIMEOUT) -> datetime.datetime:
    return datetime.datetime.now() + delta


class Partition:
    """How the leaves of a tree are split over `count` server processes.

    `dims[i]` is the dimension leaf i is split along, in `count` equal parts in
    server order, or None for a leaf kept whole: a worker pulls it from server
    0, and every server holds a copy in the server state.
    """

    def __init__(self, dims: list[int | None], count: int):
        self.dims = list(dims)
        self.count = count

    @classmethod
    def of(cls, tree, count: int) -> Partition:
        """The split of each leaf of `tree` as laid out over the servers' mesh (none for one server process)."""

        def dim(leaf):
            spec = getattr(getattr(leaf, "sharding", None), "spec", ())
            return next((d for d, axis in enumerate(spec) if axis == SERVER_AXIS), None)

        return cls([dim(leaf) if count > 1 else None for leaf in jax.tree.leaves(tree)], count)

    def holds(self, dim, server: int, whole_everywhere: bool = False) -> bool:
        """Whether server `server` has a part of a leaf split along `dim` (None: kept whole)."""
        return dim is not None or server == 0 or whole_everywhere

    def parts(self, leaves, server: int, whole_everywhere: bool = False) -> list:
        """Server `server`'s part of each leaf it holds.

        Whole leaves come from server 0 only, unless `whole_everywhere` (what
        each server needs of a gradient: a copy of every unsplit leaf).
        """
        out = []
        for leaf, dim in zip(leaves, self.dims, strict=True):
            if not self.holds(dim, server, whole_everywhere):
                continue
            if dim is not None:
                size = leaf.shape[dim] // self.count
                leaf = jax.lax.slice_in_dim(leaf, server * size, (server + 1) * size, axis=dim)
            out.append(leaf)
        return out

    def part_avals(self, avals, server: int, whole_everywhere: bool = False) -> list[tuple[tuple, object]]:
        """`(shape, dtype)` of each of `parts(...)` for leaves of these avals."""
        out = []
        for aval, dim in zip(avals, self.dims, strict=True):
            if not self.holds(dim, server, whole_everywhere):
                continue
            shape = tuple(aval.shape)
            if dim is not None:
                shape = shape[:dim] + (shape[dim] // self.count,) + shape[dim + 1 :]
            out.append((shape, aval.dtype))
        return out

    def assemble(self, parts_by_server: list[list]) -> list:
        """Whole leaves from every server's `parts` (what a worker computes on)."""
        parts = [iter(pieces) for pieces in parts_by_server]
        return [
            next(parts[0]) if dim is None else jnp.concatenate([next(p) for p in parts], axis=dim) for dim in self.dims
        ]


def server_devices() -> list:
    """The first device of each server process, in process order: the servers' mesh."""
    first = {}
    for device in sorted(jax.devices(), key=lambda d: (d.process_index, d.id)):
        first.setdefault(device.process_index, device)
    return list(first.values())


def specs(avals, device) -> list[jax.ShapeDtypeStruct]:
    """What a transfer pull expects: these `(shape, dtype)` pairs, on `device`."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    return [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in avals]


def local_tree(tree):
    return jax.tree.map(local, tree)


class StateView:
    """What the servers exchange about a server state: which parts each one holds, and their layouts."""

    def __init__(self, layout, state, count: int):
        self.layout = layout
        self.count = count
        model_state = jax.eval_shape(encode, state.model_state)
        self.pulled = Partition.of((state.params, model_state), count)  # what workers pull
        self.grads = Partition.of(state.params, count)
        self.grad_shardings = [p.sharding for p in jax.tree.leaves(state.params)]
        self.grad_avals = [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in jax.tree.leaves(state.params)]
        rest = (model_state, state.metrics)
        self.rest_avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in jax.tree.leaves(rest)]
        self.trees = jax.tree.structure(state.params), jax.tree.structure(rest)

    def offered(self, state, server: int) -> list:
        """Server `server`'s part of the parameters and module state, as workers pull it (this process's)."""
        leaves = jax.tree.leaves((state.params, encode(local_tree(state.model_state))))
        if self.count == 1:  # one process, perhaps several devices: whole leaves from the first
            return jax.tree.leaves(self.layout.gather(leaves))
        return [
            local(leaf) for leaf, dim in zip(leaves, self.pulled.dims, strict=True) if self.pulled.holds(dim, server)
        ]

    def result_parts(self, server: int, grads, model_state, increments) -> list:
        """Server `server`'s part of a worker's result: its gradient parts; module state and increments whole."""
        return self.grads.parts(jax.tree.leaves(grads), server, whole_everywhere=True) + jax.tree.leaves(
            (model_state, increments)
        )

    def result_specs(self, server: int, device) -> list[jax.ShapeDtypeStruct]:
        avals = self.grads.part_avals(self.grad_avals, server, whole_everywhere=True)
        return specs(avals + [(a.shape, a.dtype) for a in self.rest_avals], device)

    def build(self, parts: list):
        """Global arrays over the servers from this process's parts: (grads, encoded module state, increments)."""
        n = len(self.grad_avals)
        grads = [
            jax.make_array_from_single_device_arrays(a.shape, sharding, [part])
            for a, sharding, part in zip(self.grad_avals, self.grad_shardings, parts[:n], strict=True)
        ]
        replicated = self.layout.replicated
        rest = [
            jax.make_array_from_single_device_arrays(a.shape, replicated, [part])
            for a, part in zip(self.rest_avals, parts[n:], strict=True)
        ]
        model_state, increments = jax.tree.unflatten(self.trees[1], rest)
        return jax.tree.unflatten(self.trees[0], grads), model_state, increments


class ServerGroup:
    """Rank 0's side of the servers: what workers pull, where results go, what the others replay.

    With one server process it only offers rank 0's state and places results
    on its devices; with several it also sends each decision to the others.
    """

    def __init__(self, layout, transfer, followers, ids):
        self.layout = layout
        self.transfer = transfer  # rank 0's transfer server
        self.followers = followers  # [(conn, transfer address)] of ranks 1.., in rank order
        self.ids = ids  # the ids rank 0's transfer server offers under, shared with the coordinator
        self.view: StateView | None = None

    @property
    def count(self) -> int:
        return 1 + len(self.followers)

    @property
    def addresses(self) -> list[str]:
        """Each server's transfer address, in rank order: where workers pull the parameters."""
        return [self.transfer.address()] + [address for _, address in self.followers]

    def describe(self, state) -> StateView:
        if self.view is None:
            self.view = StateView(self.layout, state, self.count)
        return self.view

    def offer(self, state, pull_ids: list[int]) -> None:
        """Offers each server's part of `state` to workers, once per id."""
        if not pull_ids:
            return
        self._send(("offer", pull_ids))
        variables = self.describe(state).offered(state, 0)
        for pull_id in pull_ids:
            self.transfer.await_pull(pull_id, variables, timeout=deadline(HOLD_TIMEOUT))

    def take(self, state, grads, model_state, increments, staleness: int | None):
        """A worker's whole result (on rank 0) as server arrays; the other servers take their parts."""
        if self.count == 1:
            return self.layout.take(state, grads, model_state, increments)
        view = self.describe(state)
        for server, (conn, _) in enumerate(self.followers, start=1):
            take_id = next(self.ids)
            self.transfer.await_pull(
                take_id, view.result_parts(server, grads, model_state, increments), timeout=deadline(HOLD_TIMEOUT)
            )
            conn.send(("apply", take_id, staleness))
        return view.build(view.result_parts(0, grads, model_state, increments))

    def finish(self) -> None:
        """Ends one call of the train function on every server."""
        self._send(("return",))

    def _send(self, message) -> None:
        for conn, _ in self.followers:
            conn.send(message)


class FollowerTraining(ServerUpdates):
    """The train function of server ranks 1..N-1: replays rank 0's decisions on this server's part.

    Called exactly as often as rank 0's (every server runs the same script over
    the same data); each call applies what rank 0 applied in its call.
    """

    def __init__(self, strategy, steps, link):
        super().__init__(strategy, steps)
        self.link = link
        self.view: StateView | None = None

    def __call__(self, state, batch):
        return self._replay(state)

    def _replay(self, state):
        if state is not self.state:
            self.state, self.staleness = state, []
        if self.view is None:
            self.view = StateView(self.strategy.servers, state, self.link.count)
        server, device = self.link.rank, self.strategy.server_device
        while True:
            op = self.link.recv()
            if op[0] == "offer":
                variables = self.view.offered(self.state, server)
                for pull_id in op[1]:
                    self.link.transfer.await_pull(pull_id, variables, timeout=deadline(HOLD_TIMEOUT))
            elif op[0] == "apply":
                _, take_id, staleness = op
                parts = self.link.coordinator.pull(take_id, self.view.result_specs(server, device), timeout=deadline())
                self.state, self.logs = self.apply_encoded(self.state, *self.view.build(list(parts)))
                if staleness is not None:
                    self.staleness.append(staleness)
            elif op[0] == "return":
                return self.state, self.current_logs()
            else:
                raise RuntimeError(f"Unexpected message from the coordinator (rank 0): {op[0]!r}.")


class AsyncFollowerTraining(FollowerTraining):
    """`FollowerTraining` for async mode, whose train function also has `drain()`."""

    def drain(self):
        return self._replay(self.state)
