"""MirroredStrategy: synchronous data parallelism over the devices of one host."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshfit.strategies import data_parallel, placement
from meshfit.strategies.base import Strategy

DATA_AXIS = "data"


class MirroredStrategy(Strategy):
    """Replicates the state on every device and splits each global batch over them.

    The step is compiled with `jax.jit` over a one-axis mesh (`"data"`): the
    batch is sharded on its first dimension, parameters and optimizer state are
    replicated. Losses and metrics are sums and counts over the global batch,
    so results equal one device's on the same global batch. `batch_size` in
    `fit` is the global batch size; a batch that does not divide by the number
    of devices is padded and masked.

    Who reduces the gradients (`reduction`):
      * `"auto"` (the default without compression): XLA (GSPMD) inserts the
        all-reduce into the step compiled over the sharded batch.
      * `"explicit"`: each replica computes its gradients, loss sums and metric
        increments on its rows under `jax.shard_map`, and meshfit sums them with
        `lax.psum` over `"data"` (`meshfit.strategies.data_parallel`). BatchNorm
        statistics are averaged over the replicas after each step.
    `gradient_compression="bf16"` or `"fp16"` (explicit only) casts the gradients
    before the all-reduce and back after it: half the bytes on the wire.

    Args:
        devices: the devices to use; all local devices by default.
        reduction: "auto" or "explicit"; None picks "explicit" when compressing, else "auto".
        gradient_compression: None, "bf16" or "fp16".
    """

    def __init__(self, devices=None, *, reduction: str | None = None, gradient_compression: str | None = None):
        self._init_reduction(reduction, gradient_compression)
        devices = list(devices) if devices is not None else jax.local_devices()
        if not devices:
            raise ValueError("MirroredStrategy needs at least one device. Received: devices=[].")
        self._init_mesh(devices)

    def _init_reduction(self, reduction, gradient_compression) -> None:
        self.reduction = data_parallel.check_options(reduction, gradient_compression)
        self.gradient_compression = gradient_compression

    def _init_mesh(self, devices) -> None:
        self.devices = devices
        self.mesh = Mesh(np.array(devices), (DATA_AXIS,), axis_types=(AxisType.Auto,))
        self.num_replicas_in_sync = len(devices)
        self._replicated = NamedSharding(self.mesh, P())
        self._batch = NamedSharding(self.mesh, P(DATA_AXIS))
        self._stacked_batch = NamedSharding(self.mesh, P(None, DATA_AXIS))

    def step_functions(self, steps):
        if self.reduction == "auto":
            return steps
        gradients = data_parallel.replica_gradients(steps, self.mesh, DATA_AXIS, self.gradient_compression)
        return steps.with_replica_gradients(gradients)

    def scalar_loss_refusal(self) -> str | None:
        if self.reduction == "explicit":
            return (
                "reduction='explicit' computes each replica's loss on its own rows, "
                "and a scalar of each replica's rows is not the scalar of the batch"
            )
        return super().scalar_loss_refusal()

    def state_shardings(self, state, param_hints=None):
        return jax.tree.map(lambda _: self._replicated, state)

    def replicate(self, tree):
        return placement.put(tree, self._replicated)

    def distribute_batch(self, host_batch, stacked: bool = False):
        return placement.put_local_rows(host_batch, self._stacked_batch if stacked else self._batch)

    def compile(self, fn, *, donate_argnums=()):
        return jax.jit(fn, donate_argnums=donate_argnums)

    def to_host(self, tree):
        return placement.fetch(tree)

    def __repr__(self):
        options = "" if self.reduction == "auto" else f", reduction={self.reduction!r}"
        if self.gradient_compression:
            options += f", gradient_compression={self.gradient_compression!r}"
        return f"{type(self).__name__}(num_replicas_in_sync={self.num_replicas_in_sync}{options})"
