"""What one compiled training step costs, read from XLA: FLOPs, bytes and memory per device.

`Model.step_report()` lowers and compiles the model's train step for its
batch shape and strategy and reads XLA's own analyses: the cost analysis of
the lowered program (FLOPs and bytes of the whole step, before XLA rewrites
matrix products into library calls whose FLOPs its analysis of the compiled
GPU program no longer counts), divided over the devices, and the memory
analysis of the compiled program (arguments, outputs and temporaries per
device). Where the backend gives no cost analysis of a lowered program (the
CUDA plugin), the FLOPs are counted from the step's matrix products and
convolutions in its jaxpr (`jaxpr_flops`). Nothing is run.
`meshfit.callbacks.Throughput` turns the FLOPs into FLOP/s and MFU.
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jax.extend import core as jax_core


@dataclasses.dataclass(frozen=True)
class StepReport:
    """One training step of a compiled model, per device.

    Attributes:
        flops: floating-point operations of one step over all its devices (XLA's
            count of the lowered program: matrix products, elementwise work),
            divided by the number of devices: the model's FLOPs per device,
            with work replicated on every device counted once.
        bytes_accessed: bytes of the step (XLA's estimate), per device in the same way.
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


def _cost(stage) -> dict:
    cost = stage.cost_analysis()
    if isinstance(cost, (list, tuple)):  # one dict per program in some JAX versions
        cost = cost[0] if cost else {}
    return cost or {}


def analyse(
    lowered: jax.stages.Lowered, compiled: jax.stages.Compiled, batch_size: int, devices: list, jaxpr=None
) -> StepReport:
    """A `StepReport` of a train step, from its lowered and compiled forms (and `jaxpr()`, which
    returns its jaxpr, for FLOPs where the backend has no cost analysis of a lowered program)."""
    cost = _cost(lowered)
    flops = cost.get("flops")
    if flops is None and jaxpr is not None:
        flops = jaxpr_flops(jaxpr())
    memory = compiled.memory_analysis()
    count = max(len(devices), 1)
    return StepReport(
        flops=float(flops or 0.0) / count,
        bytes_accessed=float(cost.get("bytes accessed", 0.0)) / count,
        batch_size=int(batch_size),
        devices=len(devices),
        device_kind=devices[0].device_kind if devices else "",
        argument_bytes=int(getattr(memory, "argument_size_in_bytes", 0)),
        output_bytes=int(getattr(memory, "output_size_in_bytes", 0)),
        temp_bytes=int(getattr(memory, "temp_size_in_bytes", 0)),
    )


def jaxpr_flops(jaxpr) -> float:
    """FLOPs of the matrix products and convolutions of a (closed) jaxpr, 2 per multiply-add.

    Sub-programs count as often as they run: a `scan` body `length` times, a
    `while` body once (its trip count is not known), the costliest `cond`
    branch. Elementwise work is left out: in a model it is a small share.
    """
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            lhs = eqn.invars[0].aval
            (contracting, _), _ = eqn.params["dimension_numbers"]
            out = eqn.outvars[0].aval
            total += 2.0 * math.prod(out.shape) * math.prod(lhs.shape[d] for d in contracting)
        elif name == "conv_general_dilated":
            rhs, out = eqn.invars[1].aval, eqn.outvars[0].aval
            out_features = rhs.shape[eqn.params["dimension_numbers"].rhs_spec[0]]
            total += 2.0 * math.prod(out.shape) * math.prod(rhs.shape) / out_features
        inner = [_sub_flops(v) for v in eqn.params.values()]
        if name == "cond":
            total += max(inner, default=0.0)
        elif name == "scan":
            total += eqn.params["length"] * sum(inner)
        else:
            total += sum(inner)
    return total


def _sub_flops(value) -> float:
    if isinstance(value, (jax_core.ClosedJaxpr, jax_core.Jaxpr)):
        return jaxpr_flops(value)
    if isinstance(value, (tuple, list)):
        return sum(_sub_flops(v) for v in value)
    return 0.0
