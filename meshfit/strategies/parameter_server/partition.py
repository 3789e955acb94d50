"""How one server state is split over several parameter-server processes, and put back together.

Under `meshfit launch --ps N` with N > 1, the server processes form a
`jax.distributed` job of their own. Workers stay outside it, so a dead worker
takes nobody down, while a dead server fails the job, as it must. The server
state is one set of global arrays over a one-axis mesh with one device of each
server process (`ServerLayout`): each large parameter and its optimizer state
are split over the servers, and every update is one SPMD program in which each
server updates its part.

Workers take each server's part of the parameters from that server
(`Partition`). Results come back whole to rank 0, which must have a worker's
whole result before it applies it; rank 0 then sends each other server its
part (`TransferPlan`). How rank 0 drives the others is in
`coordinator.ServerGroup` and `follower`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from meshfit.core.trees import encode
from meshfit.strategies import layout
from meshfit.strategies.parameter_server.server import SERVER_AXIS, local


class Partition:
    """How the leaves of a tree are split over `count` server processes.

    `dims[i]` is the dimension leaf i is split along, in `count` equal parts in
    server order, or None for a leaf kept whole: a worker takes it from server
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


def state_partitions(params, opt_state, count: int, min_shard_size: int) -> tuple[Partition, Partition]:
    """How the parameters and the optimizer state split over `count` servers that share no mesh (Ray actors).

    The same rule as `ServerLayout` lays out over a mesh: each parameter with
    at least `min_shard_size` elements along its largest dimension that
    divides by `count`, its optimizer state with it, the rest whole.
    """
    mesh = jax.sharding.AbstractMesh((count,), (SERVER_AXIS,))
    specs = layout.resolve_specs(params, mesh, fsdp_axis=SERVER_AXIS, min_shard_size=min_shard_size)
    opt_specs = layout.follow_params(opt_state, params, specs)

    def dims(tree):
        found = layout.spec_tree_leaves(tree)
        return [next((d for d, axis in enumerate(spec) if axis == SERVER_AXIS), None) for spec in found]

    return Partition(dims(specs), count), Partition(dims(opt_specs), count)


def server_devices() -> list:
    """The first device of each server process, in process order: the servers' mesh."""
    first = {}
    for device in sorted(jax.devices(), key=lambda d: (d.process_index, d.id)):
        first.setdefault(device.process_index, device)
    return list(first.values())


def local_tree(tree):
    return jax.tree.map(local, tree)


class TransferPlan:
    """What moves between workers and server processes for states shaped like `state`.

    The part of the parameters and module state each server sends workers
    (`offered`), the part of a worker's result each server takes
    (`result_parts`), and how parts become global arrays over the servers
    again (`build`).
    """

    def __init__(self, layout, state, count: int):
        self.layout = layout
        self.count = count
        model_state = jax.eval_shape(encode, state.model_state)
        self.pulled = Partition.of((state.params, model_state), count)  # what workers are sent
        self.grads = Partition.of(state.params, count)
        self.grad_shardings = [p.sharding for p in jax.tree.leaves(state.params)]
        self.grad_avals = [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in jax.tree.leaves(state.params)]
        rest = (model_state, state.metrics)
        self.rest_avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in jax.tree.leaves(rest)]
        self.trees = jax.tree.structure(state.params), jax.tree.structure(rest)

    def offered(self, state, server: int) -> list:
        """Server `server`'s part of the parameters and module state, as workers are sent it (this process's)."""
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
