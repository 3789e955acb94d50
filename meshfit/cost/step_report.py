"""What one compiled training step costs, read from XLA: FLOPs, bytes and memory per device.

`Model.step_report()` lowers and compiles the model's train step for its
batch shape and strategy and reads XLA's own analyses: the cost analysis of
the lowered program (FLOPs and bytes of the whole step, before XLA rewrites
matrix products into library calls whose FLOPs its analysis of the compiled
GPU program no longer counts), divided over the devices, and the memory
analysis of the compiled program (arguments, outputs and temporaries per
device). Nothing is run. `meshfit.callbacks.Throughput` turns the FLOPs into
FLOP/s and MFU.

XLA's cost analysis counts a loop's body once and a `shard_map` body once at
one device's shapes. Where the step has either (a `Stages` stack's scan, a
pipeline's ticks, an explicit data-parallel step), the matrix products and
convolutions XLA left out are counted from the step's jaxpr and added
(`meshfit.cost.jaxpr_work`): every loop by its trip count, every `shard_map`
body once per device; a step with neither keeps XLA's figure as it is. Where
the backend gives no cost analysis of a lowered program (the CUDA plugin), the
FLOPs are the jaxpr's matrix products and convolutions alone (`jaxpr_flops`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

import jax
from jax.extend import core as jax_core

from meshfit.cost.context_cost import ContextCost
from meshfit.cost.jaxpr_work import Work, jaxpr_work
from meshfit.cost.pipeline_cost import PipelineCost

#: HLO collective kinds `StepReport.collectives` counts (asynchronous `-start` forms count as their kind).
COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


@dataclasses.dataclass(frozen=True)
class StepReport:
    """One training step of a compiled model, per device.

    Attributes:
        flops: the useful floating-point operations of one step over all its devices,
            divided by the number of devices: the model's FLOPs per device. XLA's count of
            the lowered program (matrix products, elementwise work), in which work the
            compiler replicates on every device counts once, plus the matrix products and
            convolutions it leaves out of loops and `shard_map` bodies: each loop counts
            by its trip count (a pipeline's idle ticks too: its devices run them), each
            `shard_map` body once per device, less `redundant_flops`. So every pipeline
            schedule of one model reports about the same FLOPs: a head that GPipe's
            compiler runs on every stage (replicated, counted once) and one that a
            pipeline's loop runs on every stage and keeps on the last (`redundant_flops`)
            count the same.
            Elementwise work in a loop body counts once. A step without loops or
            `shard_map` keeps XLA's figure unchanged.
        bytes_accessed: bytes of the step (XLA's estimate of the lowered program, which counts a loop's
            body and a `shard_map` body once: not corrected as `flops` is), over the devices.
        batch_size: rows of the global batch the step was compiled for.
        num_devices: devices the step runs on (all processes).
        device_kind: the kind of those devices, as JAX names it (e.g. "NVIDIA H200").
        memory: bytes per device from XLA's memory analysis of the compiled step:
            "arguments" (state and batch), "outputs" (new state, logs),
            "temporaries" (scratch: activations kept for the backward pass) and
            "peak" (their sum less the outputs that reuse donated arguments).
        collectives: bytes each collective kind ("all-reduce", "all-gather",
            "reduce-scatter", "all-to-all", "collective-permute") takes as operands
            per step on one device, in the compiled program: the buffers it
            reduces or gathers (the traffic on the wire follows from the algorithm:
            a ring all-reduce sends 2(N-1)/N of its operand).
        lowered_collectives: the same for the collectives written into the program
            before the backend compiled it (`shard_map` collectives; XLA's own, which
            GSPMD adds while compiling, are not there). A kind with more bytes in
            `collectives` was widened by the backend (XLA:CPU reduces bfloat16 in float32).
        device_flops: FLOPs of one device's compiled (partitioned) program, XLA's
            count: work replicated on every device counts on each (as `flops` does
            not), but matrix products XLA hands to a library (cuBLAS on GPU) are
            missing. XLA counts a loop's body once; the matrix products and convolutions of
            the other trips are added, those of all devices spread evenly over them (exact
            for loops in a `shard_map` over every device, as a pipeline's are; an estimate
            for loops the compiler partitions). Redundant work counts: the device runs it.
            0 where the backend gives no cost analysis of a compiled program.
        device_bytes_accessed: bytes of one device's compiled program, likewise (loop bodies once).
        pipeline: under a `stage` axis, what the pipeline costs a stage (`PipelineCost`: its
            parameters, the activations its schedule keeps, point-to-point bytes, bubble); else None.
        redundant_flops: FLOPs per device (as `flops` counts them) that devices run and throw away,
            left out of `flops`: in a `shard_map`, work every device does whose result a `jnp.where`
            keyed to the device's position keeps on some devices only: a pipeline's tail (the layers
            after `Stages` and the loss) run on every stage and kept on the last is P - 1 copies of
            its work here (under a `lax.cond` on the stage, it runs on the last only and is not).
            0 for a step without such masks.
        context: under a `context` axis, what it costs (`ContextCost`: the K/V bytes context-parallel
            attention moves per device); else None.
    """

    flops: float
    bytes_accessed: float
    batch_size: int
    num_devices: int
    device_kind: str
    memory: dict
    collectives: dict
    lowered_collectives: dict
    device_flops: float = 0.0
    device_bytes_accessed: float = 0.0
    pipeline: PipelineCost | None = None
    redundant_flops: float = 0.0
    context: ContextCost | None = None

    @property
    def flops_per_sample(self) -> float:
        """FLOPs of all devices for one row of the batch."""
        return self.flops * self.num_devices / max(self.batch_size, 1)

    @property
    def widened_collectives(self) -> list[str]:
        """Kinds whose compiled operands are larger than the program asked for (the backend promoted them)."""
        return [k for k, n in self.lowered_collectives.items() if self.collectives.get(k, 0) > n]


def _cost(stage: jax.stages.Lowered | jax.stages.Compiled) -> dict:
    cost = stage.cost_analysis()
    if isinstance(cost, (list, tuple)):  # one dict per program in some JAX versions
        cost = cost[0] if cost else {}
    return cost or {}


def memory(compiled: jax.stages.Compiled) -> dict:
    """Per-device bytes of a compiled program: arguments, outputs, temporaries, aliased and peak."""
    analysis = compiled.memory_analysis()
    sizes = {
        name: int(getattr(analysis, attr, 0) or 0)
        for name, attr in (
            ("arguments", "argument_size_in_bytes"),
            ("outputs", "output_size_in_bytes"),
            ("temporaries", "temp_size_in_bytes"),
            ("aliased", "alias_size_in_bytes"),
        )
    }
    sizes["peak"] = sizes["arguments"] + sizes["outputs"] + sizes["temporaries"] - sizes["aliased"]
    return sizes


def analyse(
    lowered: jax.stages.Lowered,
    compiled: jax.stages.Compiled,
    batch_size: int,
    devices: list,
    jaxpr: Callable[[], Any] | None = None,
) -> StepReport:
    """A `StepReport` of a train step, from its lowered and compiled forms and `jaxpr()`, which returns
    its jaxpr: traced where the lowered program has a loop or a `shard_map` (what XLA's count leaves out
    is counted from it) or the backend has no cost analysis of a lowered program."""
    cost = _cost(lowered)
    device_cost = _cost(compiled)
    count = max(len(devices), 1)
    flops = cost.get("flops")
    device_flops = float(device_cost.get("flops", 0.0) or 0.0)
    work = Work(0.0, 0.0, 0.0, 0.0)
    if jaxpr is not None and (flops is None or has_loops_or_shards(lowered)):
        work = jaxpr_work(jaxpr())
        flops = work.run if flops is None else float(flops) + work.run - work.xla
        if device_flops:
            device_flops += (work.run - work.xla_trips) / count
    return StepReport(
        flops=(float(flops or 0.0) - work.redundant) / count,
        bytes_accessed=float(cost.get("bytes accessed", 0.0)) / count,
        batch_size=int(batch_size),
        num_devices=len(devices),
        device_kind=devices[0].device_kind if devices else "",
        memory=memory(compiled),
        collectives=compiled_collectives(compiled.as_text()),
        lowered_collectives=lowered_collectives(lowered),
        device_flops=device_flops,
        device_bytes_accessed=float(device_cost.get("bytes accessed", 0.0) or 0.0),
        redundant_flops=work.redundant / count,
    )


def has_loops_or_shards(lowered: jax.stages.Lowered) -> bool:
    """Whether a lowered program has a `while` loop or a `shard_map` body (manual computation): the
    parts XLA's cost analysis counts once."""
    from jaxlib.mlir import ir  # noqa: PLC0415  (part of jaxlib; only needed here)

    found = []

    def visit(op: Any) -> Any:
        name = op.name
        if name in ("stablehlo.while", "sdy.manual_computation") or (
            name == "stablehlo.custom_call" and "FullToShard" in str(op.attributes["call_target_name"])
        ):
            found.append(name)
            return ir.WalkResult.INTERRUPT
        return ir.WalkResult.ADVANCE

    lowered.compiler_ir("stablehlo").operation.walk(visit)
    return bool(found)


# -- collectives ---------------------------------------------------------------------------------

_KINDS = "|".join(COLLECTIVE_KINDS)
_HLO_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.-]+\s*=\s*(?P<shape>.+?)\s+(?P<kind>" + _KINDS + r")(?P<start>-start)?\("
)
_HLO_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9]\w*)?)\[([0-9,]*)\]")
_HLO_GROUPS = re.compile(r"replica_groups=(\{\{[0-9,]*\}|\[[0-9]+,([0-9]+)\]|mesh\[([^\]]*)\]\s*\{([^}]*)\})")


def compiled_collectives(hlo_text: str) -> dict:
    """Operand bytes per collective kind in a compiled HLO module's text (one device, one run).

    A result's size is the operand's for all-reduce, all-to-all and
    collective-permute; an all-gather's result is its operand times the group,
    a reduce-scatter's its operand divided by it. An asynchronous `-start`
    returns its operands with its results; only the operands are counted.
    """
    totals: dict[str, int] = {}
    for line in hlo_text.splitlines():
        match = _HLO_COLLECTIVE.match(line)
        if not match:
            continue
        kind, shape = match["kind"], match["shape"]
        arrays = [_array_bytes(dtype, dims) for dtype, dims in _HLO_ARRAY.findall(shape)]
        group = _group_size(line)
        if match["start"]:
            arrays = _start_operands(kind, shape, arrays, group)
        result = sum(arrays)
        if kind == "all-gather" and not match["start"]:
            result //= group
        elif kind == "reduce-scatter":
            result *= group
        totals[kind] = totals.get(kind, 0) + result
    return totals


def _start_operands(kind: str, shape: str, arrays: list[int], group: int) -> list[int]:
    """The operands among an asynchronous start's outputs.

    XLA prints `((operands...), results...)` (GPU, jax 0.11) or, in older
    forms, the operands and results side by side (an all-reduce's results alone).
    """
    if shape.startswith("(("):
        inner = shape[2 : shape.index(")")]
        return [_array_bytes(dtype, dims) for dtype, dims in _HLO_ARRAY.findall(inner)]
    if kind == "all-reduce":
        return arrays
    if kind == "collective-permute":
        return arrays[:1]
    half = len(arrays) // 2
    if kind == "all-gather":
        return arrays[:half] if half else [arrays[0] // max(group, 1)]
    return arrays[:half] or arrays


def _group_size(line: str) -> int:
    """Devices in each replica group: from `{{0,1,...}}`, the iota form `[groups,size]<=[...]`,
    or the mesh form `mesh['data'=2,'fsdp'=4] {'fsdp'}` (the product of the named axes' sizes)."""
    match = _HLO_GROUPS.search(line)
    if not match:
        return 1
    if match.group(2):
        return int(match.group(2))
    if match.group(3) is not None:
        sizes = {name: int(size) for name, size in re.findall(r"'([^']+)'=([0-9]+)", match.group(3))}
        return math.prod(sizes.get(name, 1) for name in re.findall(r"'([^']+)'", match.group(4)))
    return len(match.group(1).strip("{}").split(","))


def _array_bytes(dtype: str, dims: str) -> int:
    count = math.prod(int(d) for d in dims.split(",") if d)
    return count * _dtype_bytes(dtype)


def _dtype_bytes(dtype: str) -> int:
    if dtype == "pred":
        return 1
    digits = re.search(r"[0-9]+", dtype)
    return max(int(digits.group()) // 8, 1) if digits else 4


_MLIR_COLLECTIVES = {
    "stablehlo.all_reduce": "all-reduce",
    "stablehlo.all_gather": "all-gather",
    "stablehlo.reduce_scatter": "reduce-scatter",
    "stablehlo.all_to_all": "all-to-all",
    "stablehlo.collective_permute": "collective-permute",
}
_MLIR_TENSOR = re.compile(r"tensor<((?:[0-9]+x)*)([a-z]+[0-9]*\w*)>")


def lowered_collectives(lowered: jax.stages.Lowered) -> dict:
    """Operand bytes per collective kind written into a lowered (StableHLO) program."""
    from jaxlib.mlir import ir  # noqa: PLC0415  (part of jaxlib; only needed here)

    totals: dict[str, int] = {}

    def visit(op: Any) -> Any:
        kind = _MLIR_COLLECTIVES.get(op.name)
        if kind is not None:
            for operand in op.operands:
                totals[kind] = totals.get(kind, 0) + _tensor_bytes(str(operand.type))
        return ir.WalkResult.ADVANCE

    lowered.compiler_ir("stablehlo").operation.walk(visit)
    return totals


def _tensor_bytes(text: str) -> int:
    match = _MLIR_TENSOR.search(text)
    if not match:
        return 0
    dims, dtype = match.groups()
    count = math.prod(int(d) for d in dims.split("x") if d)
    return count * _dtype_bytes(dtype)


def jaxpr_flops(jaxpr: jax_core.ClosedJaxpr | jax_core.Jaxpr) -> float:
    """FLOPs of the matrix products and convolutions of a (closed) jaxpr over all its devices, 2 per multiply-add.

    Sub-programs count as often as they run: a `scan` body `length` times, a
    `while` body by its trip count where that is static (else once), a
    `shard_map` body once per device of its manual axes (at one device's
    shapes), the costliest `cond` branch (in a `shard_map`, where the index is
    the device's position, each branch where it is taken). Redundant work counts (see
    `meshfit.cost.jaxpr_work.Work`). Elementwise work is left out: in a model it
    is a small share.
    """
    return jaxpr_work(jaxpr).run
