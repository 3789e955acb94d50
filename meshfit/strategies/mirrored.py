"""MirroredStrategy: synchronous data parallelism over the devices of one host."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax

from meshfit.strategies import data_parallel
from meshfit.strategies.base import Capabilities
from meshfit.strategies.device_mesh import DeviceMeshStrategy, build_mesh

if TYPE_CHECKING:
    from meshfit.steps.builtin import StepFunctions

DATA_AXIS = "data"


class MirroredStrategy(DeviceMeshStrategy):
    """Replicates the state on every device and splits each global batch over them.

    A one-axis mesh (`"data"`), as Keras 3's `DataParallel`: the step is
    compiled with `jax.jit`, the batch is sharded on its first dimension,
    parameters and optimizer state are replicated. Losses and metrics are sums
    and counts over the global batch, so results equal one device's on the
    same global batch. `batch_size` in `fit` is the global batch size; a batch
    that does not divide by the number of devices is padded and masked.

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

    def __init__(
        self,
        devices: Sequence[jax.Device] | None = None,
        *,
        reduction: str | None = None,
        gradient_compression: str | None = None,
    ):
        self.reduction = data_parallel.check_options(reduction, gradient_compression)
        self.gradient_compression = gradient_compression
        devices = list(devices) if devices is not None else jax.local_devices()
        if not devices:
            raise ValueError("MirroredStrategy needs at least one device. Received: devices=[].")
        self.devices = devices
        super().__init__(build_mesh(devices, {DATA_AXIS: len(devices)}), (DATA_AXIS,))

    @property
    def capabilities(self) -> Capabilities:
        if self.reduction == "explicit":
            return Capabilities(
                scalar_loss_refusal="reduction='explicit' computes each replica's loss on its own rows, "
                "and a scalar of each replica's rows is not the scalar of the batch"
            )
        return super().capabilities

    def step_functions(self, steps: StepFunctions) -> StepFunctions:
        if self.reduction == "auto":
            return steps
        gradients = data_parallel.replica_gradients(steps, self.mesh, DATA_AXIS, self.gradient_compression)
        return steps.with_replica_gradients(gradients)

    def __repr__(self) -> str:
        options = "" if self.reduction == "auto" else f", reduction={self.reduction!r}"
        if self.gradient_compression:
            options += f", gradient_compression={self.gradient_compression!r}"
        return f"{type(self).__name__}(num_replicas_in_sync={self.num_replicas_in_sync}{options})"
