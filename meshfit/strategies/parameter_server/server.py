"""The parameter server's side, shared by every engine: where the state lives, how gradients are applied."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from meshfit.core.batch import Batch
from meshfit.core.trees import decode, encode, is_key
from meshfit.strategies import layout, placement

SERVER_AXIS = "ps"


class ServerLayout:
    """Where the server's state lives: one device, or partitioned over several.

    Partitioned, the devices form a one-axis mesh (`"ps"`): each large
    parameter is split along its largest dimension that divides by the number
    of servers (the default rule of `layout`), optimizer state follows its
    parameter, and everything else is replicated. Updates are then applied
    part by part on the device holding each part. The devices may belong to
    several server processes (`partition`), one device each.
    """

    def __init__(self, devices, min_shard_size: int):
        self.devices = list(devices) if isinstance(devices, (list, tuple)) else [devices]
        if not self.devices:
            raise ValueError("`server_device` must be a device or a non-empty list of devices. Received: [].")
        if len(set(self.devices)) != len(self.devices):
            raise ValueError(f"`server_device` lists a device twice: {self.devices}.")
        self.min_shard_size = min_shard_size
        self.mesh = jax.sharding.Mesh(np.array(self.devices), (SERVER_AXIS,)) if self.partitioned else None

    @property
    def partitioned(self) -> bool:
        return len(self.devices) > 1

    @property
    def replicated(self) -> jax.sharding.Sharding:
        """The layout of what every server holds whole."""
        if not self.partitioned:
            return jax.sharding.SingleDeviceSharding(self.devices[0])
        return jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())

    def replicate(self, tree):
        return placement.put(tree, self.replicated)

    def place_state(self, state):
        if not self.partitioned:
            return self.replicate(state)
        specs = layout.resolve_specs(state.params, self.mesh, fsdp_axis=SERVER_AXIS, min_shard_size=self.min_shard_size)
        placed = self.replicate(state._replace(params=None, opt_state=None))
        placed = placed._replace(params=placement.put(state.params, self._shardings(specs)))
        if state.opt_state is not None:
            opt_specs = layout.follow_params(state.opt_state, state.params, specs)
            placed = placed._replace(opt_state=placement.put(state.opt_state, self._shardings(opt_specs)))
        return placed

    def _shardings(self, specs):
        return jax.tree.map(
            lambda s: jax.sharding.NamedSharding(self.mesh, s),
            specs,
            is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec),
        )

    def take(self, state, grads, model_state, increments):
        """Puts a worker's results on this process's server devices: each gradient beside its parameter,
        the rest replicated (one server process; `coordinator.ServerGroup` places them over several)."""
        if not self.partitioned:
            return jax.device_put((grads, model_state, increments), self.devices[0])
        grads = jax.device_put(grads, jax.tree.map(lambda p: p.sharding, state.params))
        return grads, *self.replicate((model_state, increments))

    def gather(self, tree):
        """The whole of `tree` on the first server device (what a worker process pulls)."""
        return jax.device_put(tree, self.devices[0]) if self.partitioned else tree


def local(leaf):
    """This process's part of a server-state leaf: its shard, or its copy of a replicated leaf.

    Computing on it involves no other server process (rank 0 alone derives
    dropout keys and reads the step this way).
    """
    return leaf if not isinstance(leaf, jax.Array) or leaf.is_fully_addressable else leaf.addressable_data(0)


def split_rows(batch: Batch, parts: int) -> list[Batch]:
    """`parts` equal row blocks of a batch (padded to a multiple of `parts` by the loop)."""
    rows = batch.mask.shape[0] // parts
    return [jax.tree.map(lambda a, i=i: a[i * rows : (i + 1) * rows], batch) for i in range(parts)]


def weighted_mean(grads_per_worker, weights):
    """The gradients of a sync round's parts, weighted by their real rows: one global-batch gradient."""
    total = jnp.maximum(jnp.sum(weights), 1.0)
    return jax.tree.map(lambda *gs: sum(w * g for w, g in zip(weights, gs, strict=True)) / total, *grads_per_worker)


def sum_trees(trees):
    """The leaf-wise sum of several trees of one structure (a round's metric increments)."""
    return jax.tree.map(lambda *xs: sum(xs[1:], xs[0]), *trees)


def job_salt(*salts: int) -> np.ndarray:
    """The salt of one gradient job, e.g. (step, part): what makes its random draws its own."""
    return np.asarray(salts, np.uint32)


def _fold(key, salts):
    """`key` folded with each salt in turn; keys of any shape (vmapped)."""

    def fold(k):
        for salt in salts:
            k = jax.random.fold_in(k, salt)
        return k

    for _ in range(key.ndim):
        fold = jax.vmap(fold)
    return fold(key)


def salted(gradients):
    """`StepFunctions.gradients` taking one more argument, the job's salt (`job_salt`, two entries).

    A module that keeps its random streams in its state (NNX `Rngs`) would
    otherwise draw the same dropout masks on every worker that pulled the same
    state. Its keys are salted for the computation; the returned state keeps
    the original keys (with the streams' counts advanced as usual).
    """

    def run(params, model_state, batch, rng, salt):
        keyed = jax.tree.map(lambda leaf: _fold(leaf, salt) if is_key(leaf) else leaf, model_state)
        grads, new_state, increments = gradients(params, keyed, batch, rng)
        new_state = jax.tree.map(lambda new, old: old if is_key(old) else new, new_state, model_state)
        return grads, new_state, increments

    return run


def export_gradients(steps, state, task):
    """The worker's gradient program for jobs like `task` on states like `state`, exported (`jax.export`).

    Called as `(params, encoded module state, batch, rng, salt) -> (grads, encoded module state,
    increments)`: typed RNG keys travel as raw key data (`core.trees.encode`), so a worker needs nothing
    of the training script.
    """
    template = state.model_state
    salted_gradients = salted(steps.gradients)

    def gradients(params, encoded_model_state, batch, rng, salt):
        grads, model_state, increments = salted_gradients(
            params, decode(encoded_model_state, template), batch, rng, salt
        )
        return grads, encode(model_state), increments

    args = (state.params, jax.eval_shape(encode, state.model_state), task.batch, task.rng, task.salt)
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), args)
    return jax.export.export(jax.jit(gradients))(*shapes)


def job_rng(steps, state, *salts: int):
    """The dropout key of one gradient job (raw key data), or None for modules without randomness.

    Derived from the server's key and `salts` only, so a job redone by another
    worker draws the same masks.
    """
    if not steps.adapter.uses_rng:
        return None
    return jax.random.key_data(_fold(jax.random.wrap_key_data(local(state.rng)), salts))


class Task(NamedTuple):
    """One gradient job: a batch with its dropout key and salt; `index` orders a sync round's parts."""

    batch: Batch
    rng: jax.Array | None
    salt: np.ndarray
    index: int = 0


class ServerTrainFunction:
    """What every train function a server runs shares: the server state, gradients applied to it, the logs.

    `staleness` holds the staleness, in parameter versions, of each gradient
    applied since the state was last set from outside (epoch start,
    `set_weights`, a restore); the logs report its mean and maximum.
    """

    def __init__(self, strategy, steps):
        self.strategy = strategy
        self.steps = steps
        self.state = None
        self.logs = None
        self.staleness: list[int] = []
        self._apply = {
            False: layout.jit_keeping_layout(self._apply_and_log, 0),
            True: layout.jit_keeping_layout(self._apply_encoded_and_log, 0),
        }
        self._apply_rest = jax.jit(self._rest_and_log, static_argnums=0)

    def apply(self, grads, model_state, increments, *, encoded: bool) -> None:
        """Applies one gradient (server arrays) to `state`.

        `encoded`: the module state comes from a worker process, its RNG keys
        as raw key data (`core.trees.encode`), and is decoded on the server.
        """
        self.state, self.logs = self._apply[encoded](self.state, grads, model_state, increments)

    def apply_rest(self, model_state, increments, *, encoded: bool) -> None:
        """Takes a result whose optimizer update the servers applied to their parts (Ray's server actors):
        the module state, the metric sums and the step; the parameters and optimizer state stay as they are."""
        state = self.state
        rest, self.logs = self._apply_rest(
            encoded, state.model_state, state.metrics, state.step, model_state, increments
        )
        self.state = state._replace(**rest)

    def _rest_and_log(self, encoded, old_model_state, metrics, step, model_state, increments):
        if encoded:
            model_state = decode(model_state, old_model_state)
        metrics = jax.tree.map(jnp.add, metrics, increments)
        return dict(model_state=model_state, metrics=metrics, step=step + 1), self.steps.logs(metrics)

    def drain(self):
        """Nothing is in flight unless a subclass (asynchronous training) says otherwise."""
        return None

    def _apply_and_log(self, state, grads, model_state, increments):
        new_state = self.steps.apply_gradients(state, grads, model_state, increments, state.rng)
        return new_state, self.steps.logs(new_state.metrics)

    def _apply_encoded_and_log(self, state, grads, encoded_model_state, increments):
        return self._apply_and_log(state, grads, decode(encoded_model_state, state.model_state), increments)

    def current_logs(self) -> dict:
        """The server's latest logs, with `staleness` (mean) and `max_staleness` once gradients were applied."""
        logs = dict(self.logs) if self.logs is not None else dict(self.steps.logs(self.state.metrics))
        if self.staleness:
            logs["staleness"] = float(np.mean(self.staleness))
            logs["max_staleness"] = float(np.max(self.staleness))
        return logs
