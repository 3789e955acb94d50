"""What a `cluster="ray"` parameter server's actors run: a server holds its part of the state, a worker computes.

Both receive their programs as serialized StableHLO (`jax.export`), so no
actor needs the training script. Arrays move as Ray objects: a worker's
arguments include each server's offered part as an object reference, which
Ray resolves by fetching it from that server's node; a worker returns one
object per server (that server's part of the gradient), and the driver hands
each reference to its server, which fetches it from the worker's node. The
driver passes references, not arrays.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from meshfit.strategies.parameter_server import ray_cluster
from meshfit.strategies.parameter_server import transport as _transport  # noqa: F401 - registers Batch for jax.export
from meshfit.strategies.parameter_server.partition import Partition
from meshfit.strategies.parameter_server.server import weighted_mean

#: What `ServerActor.apply` answers when a gradient part could not be fetched (its worker's node was lost).
PART_LOST = -1


def _host(leaves) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in leaves]


class ServerActor:
    """One server: its part of the parameters and optimizer state, and the update program for that part.

    It holds every whole (unsplit) leaf as well, so each server applies the
    whole update to its part without talking to the others; workers pull the
    whole leaves from server 0 only. `traffic` counts the gradient bytes it
    received: about the parameter bytes / S per gradient.
    """

    def __init__(self, index: int, count: int, update: bytes, param_dims: list, opt_dims: list):
        self.index = index
        self.update = jax.export.deserialize(bytearray(update))
        self.params_split = Partition(param_dims, count)
        self.opt_split = Partition(opt_dims, count)
        self.device = jax.local_devices()[0]
        self.params = self.opt_state = None
        self.applied = self.gradients = self.bytes = 0
        self._mean = jax.jit(weighted_mean)

    def where(self) -> ray_cluster.Placement:
        return ray_cluster.here()

    def load(self, params: list, opt_state: list) -> int:
        """Takes this server's part of a state set by the driver (the first, or one set from outside)."""
        self.params, self.opt_state = jax.device_put((params, opt_state), self.device)
        return self.applied

    def offer(self) -> list[np.ndarray]:
        """The parameter leaves workers pull from this server: its parts, and the whole leaves on server 0."""
        return self._offered(self.params, self.params_split)

    def apply(self, weights, refs: list) -> int:
        """Fetches and applies one gradient (one reference), or a sync round's parts weighted by real rows.

        The references come in a list, so this server fetches them itself: a part lost with its worker's
        node (between the worker's answer and this fetch) is skipped (`PART_LOST`), not this server's end.
        """
        ray = ray_cluster.import_ray()
        try:
            parts = ray.get(refs)
        except ray.exceptions.RayError:
            return PART_LOST
        self.gradients += len(parts)
        self.bytes += sum(leaf.nbytes for part in parts for leaf in part)
        grads = jax.device_put(parts[0] if weights is None else self._mean(list(parts), weights), self.device)
        self.params, self.opt_state = self.update.call(self.params, self.opt_state, grads)
        self.applied += 1
        return self.applied

    def state(self) -> tuple[list, list, int]:
        """This server's parameters and optimizer state as the driver assembles them, and updates applied."""
        return (
            self._offered(self.params, self.params_split),
            self._offered(self.opt_state, self.opt_split),
            self.applied,
        )

    def traffic(self) -> dict[str, int]:
        """Gradient bytes and gradients received, updates applied."""
        return {"bytes": self.bytes, "gradients": self.gradients, "applied": self.applied}

    def _offered(self, leaves, split: Partition) -> list[np.ndarray]:
        return _host(leaf for leaf, dim in zip(leaves, split.dims, strict=True) if split.holds(dim, self.index))


class WorkerActor:
    """One worker: runs the exported gradient program on the parts it pulled from each server.

    `compute` returns S + 1 objects: server k's part of the gradient for each
    k (its split leaves and every whole leaf), then the module state and metric
    increments, which the driver takes.
    """

    def __init__(self, program: bytes, param_dims: list, count: int, delay: float = 0.0):
        self.exported = jax.export.deserialize(bytearray(program))
        self.params_split = Partition(param_dims, count)
        self.delay = delay

    def where(self) -> ray_cluster.Placement:
        return ray_cluster.here()

    def compute(self, batch_leaves: list, model_state: list, *parts: list) -> tuple:
        params = self.params_split.assemble([list(p) for p in parts])
        args = jax.tree.unflatten(self.exported.in_tree, params + list(model_state) + list(batch_leaves))
        out = jax.tree.leaves(self.exported.call(*args[0], **args[1]))
        n = len(self.params_split.dims)
        grads, rest = out[:n], out[n:]
        if self.delay:
            time.sleep(self.delay)
        by_server = [
            _host(self.params_split.parts(grads, k, whole_everywhere=True)) for k in range(self.params_split.count)
        ]
        return (*by_server, _host(rest))
