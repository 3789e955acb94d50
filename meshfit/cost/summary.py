"""`model.summary()`: one row per weight, with totals; under a mesh, its layout and bytes per device."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import NamedSharding

if TYPE_CHECKING:
    from meshfit.cost.pipeline_cost import PipelineCost
    from meshfit.cost.step_report import StepReport
    from meshfit.strategies import Strategy


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


def bytes_per_device(leaf: jax.Array) -> int:
    """Bytes of the largest shard of `leaf` (read from its sharding, no transfer)."""
    sharding = getattr(leaf, "sharding", None)
    shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
    return int(np.prod(shape)) * leaf.dtype.itemsize


def _sharded(tree: Any) -> bool:
    return any(isinstance(getattr(leaf, "sharding", None), NamedSharding) for leaf in jax.tree.leaves(tree))


def format_step_report(report: StepReport) -> str:
    """Lines for `Model.summary()` after the first fit: a step's memory, FLOPs and collectives per device."""
    mem = report.memory
    lines = [
        f"Train step (batch {report.batch_size}; per device, {report.num_devices} x {report.device_kind}): "
        f"peak {human_bytes(mem['peak'])} = arguments {human_bytes(mem['arguments'])} + outputs "
        f"{human_bytes(mem['outputs'])} + temporaries {human_bytes(mem['temporaries'])} - reused "
        f"{human_bytes(mem['aliased'])}; {report.flops / 1e9:,.3f} GFLOP"
        + (f" (and {report.redundant_flops / 1e9:,.3f} GFLOP run redundantly)" if report.redundant_flops else "")
    ]
    if report.collectives:
        parts = ", ".join(f"{kind} {human_bytes(n)}" for kind, n in report.collectives.items())
        widened = report.widened_collectives
        note = f" (the backend widened {', '.join(widened)}: lowered {report.lowered_collectives})" if widened else ""
        lines.append(f"Collectives per step: {parts}{note}")
    if report.pipeline is not None:
        lines.append(format_pipeline_cost(report.pipeline))
    if report.context is not None:
        lines.append(
            f"Context parallelism (context={report.context.size}; per device): attention sends "
            f"{human_bytes(report.context.kv_bytes)} of K/V (and their gradients) per step"
        )
    return "\n".join(lines)


def format_pipeline_cost(cost: PipelineCost) -> str:
    """One line: what a pipelined step costs a stage (per device)."""
    schedule = cost.schedule + (f" x{cost.repeats}" if cost.repeats > 1 else "")
    return (
        f"Pipeline ({cost.stages} stages, {cost.microbatches} microbatches, {schedule}; per device): "
        f"bubble {cost.bubble:.1%}, point-to-point {human_bytes(cost.p2p_bytes)} per step, stage parameters "
        f"{human_bytes(cost.stage_param_bytes)}, activations kept {human_bytes(cost.activation_bytes)}"
    )


def format_summary(
    name: str, strategy: Strategy, names: list[str], params: Any, non_trainable: Any, opt_state: Any
) -> str:
    """The text `model.summary()` prints (shapes and shardings only; no device transfer).

    `names` are the weight names of `params` then `non_trainable` leaves; `opt_state` adds
    optimizer bytes per device under a mesh.
    """
    leaves = jax.tree.leaves(params) + jax.tree.leaves(non_trainable)
    n_params = len(jax.tree.leaves(params))
    sharded = _sharded((params, non_trainable))
    header = ["Weight", "Shape", "Dtype", "Trainable", "Params", "Bytes"] + (
        ["Sharding", "Bytes/device"] if sharded else []
    )
    rows = []
    for i, (weight, leaf) in enumerate(zip(names, leaves, strict=True)):
        count = int(np.prod(leaf.shape))
        trainable = "yes" if i < n_params else "no"
        row = [
            weight,
            str(tuple(leaf.shape)),
            str(leaf.dtype),
            trainable,
            f"{count:,}",
            human_bytes(count * leaf.dtype.itemsize),
        ]
        if sharded:
            spec = leaf.sharding.spec if isinstance(leaf.sharding, NamedSharding) else "-"
            row += [str(spec), human_bytes(bytes_per_device(leaf))]
        rows.append(row)
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    line = "-" * (sum(widths) + 2 * (len(widths) - 1))
    left = {0, 1, 2, 3, 6}

    def fmt(row: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )

    def total(tree_leaves: list) -> tuple[int, int]:
        return sum(int(np.prod(a.shape)) for a in tree_leaves), sum(a.nbytes for a in tree_leaves)

    t_count, t_bytes = total(leaves[:n_params])
    f_count, f_bytes = total(leaves[n_params:])
    out = [
        f'Model: "{name}"  strategy: {strategy!r}',
        line,
        fmt(header),
        line,
        *(fmt(r) for r in rows),
        line,
        f"Total params: {t_count + f_count:,} ({human_bytes(t_bytes + f_bytes)})",
        f"Trainable params: {t_count:,} ({human_bytes(t_bytes)})",
        f"Non-trainable params: {f_count:,} ({human_bytes(f_bytes)})",
    ]
    if sharded:
        opt_leaves = jax.tree.leaves(opt_state)
        out.append(
            f"Total bytes per device: {human_bytes(sum(bytes_per_device(a) for a in leaves))} of weights"
            + (
                f", {human_bytes(sum(bytes_per_device(a) for a in opt_leaves))} of optimizer state"
                if opt_leaves
                else ""
            )
        )
    return "\n".join(out)
