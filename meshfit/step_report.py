"""What one compiled training step costs, read from XLA: FLOPs, bytes and memory per device.

`Model.step_report()` compiles the model's train step for its batch shape
and strategy and reads XLA's own analyses of the result: the cost analysis
(FLOPs and bytes accessed of the partitioned program, i.e. per device) and
the memory analysis (arguments, outputs and temporaries per device). Nothing
is run. `meshfit.callbacks.Throughput` turns the FLOPs into FLOP/s and MFU.
"""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class StepReport:
    """One training step of a compiled model, per device.

    Attributes:
        flops: floating-point operations one device runs per step (XLA's count
            of the partitioned program: matrix products, elementwise work).
        bytes_accessed: bytes one device reads and writes per step (XLA's estimate).
        batch_size: rows of the global batch the step was compiled for.
        devices: devices the step runs on (all processes).
        device_kind: the kind of those devices, as JAX names it (e.g. "NVIDIA H200").
        argument_bytes: per device: the step's inputs (state and batch).
        output_bytes: per device: the step's outputs (the new state, logs).
        temp_bytes: per device: XLA's scratch memory (activations kept for the backward pass).
    """

    flops: float
    bytes_accessed: float
    batch_size: int
    devices: int
    device_kind: str
    argument_bytes: int
    output_bytes: int
    temp_bytes: int

    @property
    def flops_per_sample(self) -> float:
        """FLOPs of all devices for one row of the batch."""
        return self.flops * self.devices / max(self.batch_size, 1)


def analyse(compiled: jax.stages.Compiled, batch_size: int, devices: list) -> StepReport:
    """A `StepReport` of a compiled train step."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # one dict per program in some JAX versions
        cost = cost[0] if cost else {}
    cost = cost or {}
    memory = compiled.memory_analysis()
    return StepReport(
        flops=float(cost.get("flops", 0.0)),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
        batch_size=int(batch_size),
        devices=len(devices),
        device_kind=devices[0].device_kind if devices else "",
        argument_bytes=int(getattr(memory, "argument_size_in_bytes", 0)),
        output_bytes=int(getattr(memory, "output_size_in_bytes", 0)),
        temp_bytes=int(getattr(memory, "temp_size_in_bytes", 0)),
    )
