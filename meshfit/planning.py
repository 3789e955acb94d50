"""`meshfit.plan`: which layout, batch size and rematerialisation fit a model on these devices, and which is fastest.

Before any parameter exists: for every layout of the devices (`Mirrored`,
and every `data` x `fsdp` x `tensor` factorisation as a `MeshStrategy`),
every global batch size and every rematerialisation choice the model's
factory offers, the plan builds the model abstractly (`Model(...,
abstract=True)`: shapes and shardings, the factory run under `nnx.eval_shape`
only), compiles the train step exactly as `fit` would (`model.step_report`:
the strategy's compilation of the model's own steps) and reads XLA's memory
and cost analyses of it. Nothing runs. Each candidate's step time is
predicted by a roofline (`meshfit.roofline`), and candidates over the
memory limit are marked as not fitting.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from tqdm.std import tqdm

from meshfit import roofline
from meshfit.model import Model
from meshfit.roofline import DeviceSpec, StepTime
from meshfit.step_report import COLLECTIVE_KINDS, StepReport
from meshfit.strategies.layout import Rules
from meshfit.strategies.mesh import MeshStrategy
from meshfit.strategies.mirrored import MirroredStrategy

#: The mesh axes a plan factors the devices into, in `MeshStrategy` order.
MESH_AXES = ("data", "fsdp", "tensor")


@dataclasses.dataclass(frozen=True)
class Layout:
    """A way to lay the devices out: `MirroredStrategy` (`axes` None) or a `MeshStrategy` over `axes`."""

    axes: tuple[tuple[str, int], ...] | None = None

    @property
    def name(self) -> str:
        if self.axes is None:
            return "mirrored"
        return "mesh " + "x".join(str(size) for _, size in self.axes)

    def strategy(
        self,
        devices: Sequence[jax.Device],
        rules: Rules = (),
        logical_axis_rules: Any = None,
    ) -> MirroredStrategy | MeshStrategy:
        """A strategy over `devices` in this layout (with `rules` for a mesh)."""
        if self.axes is None:
            return MirroredStrategy(devices)
        return MeshStrategy(
            axes=dict(self.axes), rules=rules, logical_axis_rules=logical_axis_rules, devices=list(devices)
        )


def layouts(count: int) -> list[Layout]:
    """Mirrored, then every factorisation of `count` devices into data x fsdp x tensor (data first) but
    `count` x 1 x 1, which lays everything out as Mirrored does (a data-only mesh): compiled once, not twice."""
    found = [Layout()]
    for data in sorted((d for d in range(1, count + 1) if count % d == 0), reverse=True):
        rest = count // data
        for fsdp in sorted((f for f in range(1, rest + 1) if rest % f == 0), reverse=True):
            if data < count:
                found.append(Layout(tuple(zip(MESH_AXES, (data, fsdp, rest // fsdp), strict=True))))
    return found


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One compiled candidate: a layout, a global batch size and a remat choice, with what its step costs.

    Attributes:
        layout: how the devices are laid out (`Layout`).
        batch_size: the global batch size.
        remat: the value given to the factory's `remat=` argument (None: the factory has none).
        report: XLA's analyses of the compiled train step, per device (None where it did not compile).
        time: the roofline's step time (`meshfit.roofline.StepTime`, seconds; None without a report).
        memory_limit: bytes one device may hold (None: no limit).
        error: why the candidate could not be compiled (a rule that does not divide a dimension), else None.
    """

    layout: Layout
    batch_size: int
    remat: Any
    report: StepReport | None
    time: StepTime | None
    memory_limit: int | None
    error: str | None = None
    _strategy: Callable[[], Any] | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def peak_bytes(self) -> int | None:
        """Peak memory of one device: arguments + outputs + temporaries - aliased."""
        return None if self.report is None else self.report.memory["peak"]

    @property
    def margin(self) -> int | None:
        """`memory_limit - peak_bytes` (negative: over the limit by that much); None without a limit."""
        if self.memory_limit is None or self.report is None:
            return None
        return self.memory_limit - self.peak_bytes

    @property
    def fits(self) -> bool:
        """Compiled, and its peak within the memory limit."""
        return self.report is not None and (self.margin is None or self.margin >= 0)

    @property
    def step_seconds(self) -> float | None:
        return None if self.time is None else self.time.total

    @property
    def samples_per_second(self) -> float | None:
        """The predicted global samples per second."""
        if self.time is None or self.time.total <= 0:
            return None
        return self.batch_size / self.time.total

    def strategy(self) -> MirroredStrategy | MeshStrategy:
        """A ready strategy in this candidate's layout, over the plan's devices with its rules."""
        return self._strategy()


@dataclasses.dataclass(frozen=True)
class Plan:
    """The candidates of `meshfit.plan`, best first.

    Attributes:
        candidates: those that fit, by predicted samples/s (fastest first); then those over the
            memory limit (smallest peak first); then those that did not compile.
        device_kind: the kind of the planned devices.
        num_devices: how many.
        spec: the `DeviceSpec` the roofline used.
        memory_limit: bytes one device may hold (None: no limit).
        compiled: how many candidates were compiled (each once).
        seconds: how long planning took.
    """

    candidates: list[Candidate]
    device_kind: str
    num_devices: int
    spec: DeviceSpec
    memory_limit: int | None
    compiled: int
    seconds: float

    @property
    def best(self) -> Candidate:
        """The fastest candidate that fits; a ValueError when none does."""
        if not self.candidates or not self.candidates[0].fits:
            raise ValueError(
                f"No candidate fits in memory_limit={_bytes(self.memory_limit)} per device. Received: "
                f"{len(self.candidates)} candidates, the smallest peak "
                f"{_bytes(min((c.peak_bytes for c in self.candidates if c.report), default=None))}. "
                "Try smaller batch sizes, remat, or more devices."
            )
        return self.candidates[0]

    def __str__(self) -> str:
        return format_plan(self)


def plan(
    factory: Callable[..., Any],
    x: Any,
    y: Any,
    *,
    compile: Mapping[str, Any],  # noqa: A002  (as `Model.compile` is named)
    devices: Sequence[jax.Device] | None = None,
    memory_limit: int | None = None,
    batch_sizes: Sequence[int] | None = None,
    remat: Sequence[Any] | None = None,
    rules: Rules = (),
    logical_axis_rules: Any = None,
    device_spec: DeviceSpec | None = None,
    verbose: int | str = "auto",
) -> Plan:
    """Compiles the train step for every layout, batch size and remat choice, creating no parameter.

    The layouts are `MirroredStrategy` and a `MeshStrategy` for every factorisation of the devices into
    `data` x `fsdp` x `tensor` (`layouts`); each candidate is compiled once.

    Args:
        factory: a function returning a `flax.nnx.Module` (as `meshfit.Model` takes one); if it has a
            `remat` argument, each of its `remat` choices is planned.
        x: example inputs (an array or a pytree of them); their rows are repeated up to each batch size.
        y: example targets, likewise.
        compile: the arguments of `Model.compile`, e.g. `dict(optimizer="adam", loss="mse")`.
        devices: the devices to lay out (default: all of them).
        memory_limit: bytes one device may hold; default the device's `memory_stats()["bytes_limit"]`
            where the platform reports it (none on CPU: everything fits).
        batch_sizes: global batch sizes to plan (default: the rows of `x`).
        remat: the values of the factory's `remat` argument to plan (default `(False, True)` when it
            has one).
        rules: a `MeshStrategy`'s `rules` (regex, spec), for every mesh candidate.
        logical_axis_rules: a `MeshStrategy`'s logical axis rules, likewise.
        device_spec: the device's peaks for the roofline (default: `meshfit.roofline.DEVICE_SPECS` for
            the device kind; `HOST_CPU` on CPU).
        verbose: 1 shows a progress bar on stderr naming the candidate being compiled (a plan of a large
            model on many devices compiles for minutes); 0 shows nothing; "auto" (default) shows it when
            stderr is a terminal.

    Returns:
        A `Plan`: `plan.best.strategy()` is a ready strategy; `print(plan)` prints the table.

    Example:
        >>> p = mf.plan(lambda: MLP(rngs=nnx.Rngs(0)), x[:64], y[:64],
        ...             compile=dict(optimizer="adam", loss="sparse_categorical_crossentropy"),
        ...             batch_sizes=[64, 256])
        >>> print(p)
        >>> with p.best.strategy().scope(): ...
    """
    start = time.perf_counter()
    devices = list(devices) if devices is not None else jax.devices()
    if not devices:
        raise ValueError("plan needs at least one device. Received: devices=[].")
    if verbose not in (0, 1, "auto"):
        raise ValueError(f"`verbose` must be 0, 1 or 'auto'. Received: verbose={verbose!r}.")
    if not isinstance(compile, Mapping) or ("loss" not in compile and "optimizer" not in compile):
        raise ValueError(
            "`compile` takes the arguments of Model.compile, e.g. dict(optimizer='adam', loss='mse'). "
            f"Received: compile={compile!r}."
        )
    rows = _rows(x, "x")
    if _rows(y, "y") != rows:
        raise ValueError(f"`x` and `y` need the same rows. Received: {rows} rows of x, {_rows(y, 'y')} of y.")
    batch_sizes = [rows] if batch_sizes is None else list(batch_sizes)
    if not batch_sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in batch_sizes):
        raise ValueError(f"`batch_sizes` must be positive ints. Received: batch_sizes={batch_sizes!r}.")
    remats = _remat_choices(factory, remat)
    if memory_limit is None:
        memory_limit = (devices[0].memory_stats() or {}).get("bytes_limit")
    elif isinstance(memory_limit, bool) or not isinstance(memory_limit, int) or memory_limit <= 0:
        raise ValueError(f"`memory_limit` must be a positive number of bytes or None. Received: {memory_limit!r}.")
    spec = device_spec or _default_spec(devices[0])

    def strategy_of(layout: Layout) -> Callable[[], Any]:
        return functools.partial(layout.strategy, devices, rules, logical_axis_rules)

    jobs = [
        (layout, batch_size, choice)
        for layout in layouts(len(devices))
        for batch_size in batch_sizes
        for choice in remats
    ]

    def compile_one(job: tuple[Layout, int, Any]) -> Candidate:
        layout, batch_size, choice = job
        try:
            report = _compile(factory, choice, strategy_of(layout)(), compile, x, y, batch_size)
        except ValueError as error:  # a layout rule or batch this mesh cannot take
            return Candidate(layout, batch_size, choice, None, None, memory_limit, str(error), strategy_of(layout))
        time_ = roofline.step_time(report, spec)
        return Candidate(layout, batch_size, choice, report, time_, memory_limit, None, strategy_of(layout))

    # One after another: compiling in a pool of threads took as long on a 2-core host (RESULTS.md).
    candidates = [compile_one(job) for job in _progress(jobs, verbose)]
    if all(c.error for c in candidates):
        raise ValueError(f"No candidate compiled. The first error: {candidates[0].error}")
    return Plan(
        candidates=sorted(candidates, key=_rank),
        device_kind=devices[0].device_kind,
        num_devices=len(devices),
        spec=spec,
        memory_limit=memory_limit,
        compiled=sum(c.report is not None for c in candidates),
        seconds=time.perf_counter() - start,
    )


def _progress(jobs: list[tuple[Layout, int, Any]], verbose: int | str):
    """Yields `jobs`, showing on stderr (when `verbose` asks) a bar that names the candidate being compiled."""
    show = verbose == 1 or (verbose == "auto" and sys.stderr.isatty())
    with tqdm(jobs, desc="Compiling", unit="candidate", file=sys.stderr, disable=not show, leave=False) as bar:
        for job in bar:
            layout, batch_size, choice = job
            bar.set_postfix_str(f"{layout.name}, batch {batch_size}" + ("" if choice is None else f", remat {choice}"))
            yield job


def _compile(factory, remat, strategy, compile_args, x, y, batch_size: int) -> StepReport:
    """The step report of an abstract model under `strategy`, for a batch of `batch_size` rows."""
    build = factory if remat is None else functools.partial(factory, remat=remat)
    with strategy.scope():
        model = Model(build, abstract=True)
        model.compile(**compile_args)
    grow = lambda a: np.resize(np.asarray(a), (batch_size, *np.shape(a)[1:]))  # noqa: E731
    return model.step_report(jax.tree.map(grow, x), jax.tree.map(grow, y))


def _remat_choices(factory: Callable[..., Any], remat: Sequence[Any] | None) -> list[Any]:
    try:  # (a class's signature is its `__init__`'s, which a metaclass's `__call__` may hide)
        signature = inspect.signature(factory.__init__ if isinstance(factory, type) else factory)
        takes_remat = "remat" in signature.parameters
    except (TypeError, ValueError):
        takes_remat = False
    if remat is None:
        return [False, True] if takes_remat else [None]
    if not takes_remat:
        raise ValueError(
            "`remat` lists values of the factory's `remat=` argument, and this factory has none. "
            f"Received: remat={remat!r}. Add a `remat` argument to the factory, or leave `remat` out."
        )
    choices = list(remat)
    if not choices:
        raise ValueError("`remat` needs at least one choice, e.g. (False, True). Received: remat=[].")
    return choices


def _default_spec(device: jax.Device) -> DeviceSpec:
    spec = roofline.device_spec(device.device_kind)
    if spec is not None:
        return spec
    if device.platform == "cpu":
        return roofline.HOST_CPU
    raise ValueError(
        f"meshfit.roofline.DEVICE_SPECS has no peaks for device kind {device.device_kind!r}. "
        "Pass device_spec=meshfit.roofline.DeviceSpec(peak_flops, memory_bandwidth, interconnect_bandwidth) "
        "(`meshfit plan --device-spec FLOPS,BYTES/S,BYTES/S`)."
    )


def _rows(tree: Any, name: str) -> int:
    leaves = jax.tree.leaves(tree)
    if not leaves or any(np.ndim(a) == 0 for a in leaves):
        raise ValueError(f"`{name}` must be an array (or a pytree of arrays) with a batch dimension. Received: {name}.")
    return int(np.shape(leaves[0])[0])


def _rank(candidate: Candidate) -> tuple:
    if candidate.fits:
        return (0, -(candidate.samples_per_second or 0.0))
    if candidate.report is not None:
        return (1, candidate.peak_bytes)
    return (2, 0)


# -- the table ---------------------------------------------------------------------------------------

_SHORT = {
    "all-reduce": "AR",
    "all-gather": "AG",
    "reduce-scatter": "RS",
    "all-to-all": "A2A",
    "collective-permute": "CP",
}


def _bytes(n: float | None) -> str:
    if n is None:
        return "none"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{int(n)} B"


def format_plan(result: Plan) -> str:
    """The plan as a table: one row per candidate, best first."""
    spec = result.spec
    header = (
        f"Plan: {result.num_devices} x {result.device_kind}, memory limit {_bytes(result.memory_limit)} per device; "
        f"{result.compiled} candidates compiled in {result.seconds:.1f} s; roofline {spec.peak_flops / 1e12:g} "
        f"TFLOP/s, memory {spec.memory_bandwidth / 1e9:g} GB/s, interconnect {spec.interconnect_bandwidth / 1e9:g} GB/s"
    )
    columns = ("layout", "batch", "remat", "peak/device", "margin", "GFLOP/dev", "collectives/dev", "step", "samples/s")
    rows = []
    for c in result.candidates:
        remat = "-" if c.remat is None else str(c.remat)
        if c.report is None:
            rows.append((c.layout.name, str(c.batch_size), remat, "-", "does not compile", "", "", "", ""))
            continue
        collectives = " ".join(
            f"{_SHORT[k]} {_bytes(c.report.collectives[k])}" for k in COLLECTIVE_KINDS if c.report.collectives.get(k)
        )
        margin = "no limit" if c.margin is None else ("" if c.fits else "OVER ") + _bytes(abs(c.margin))
        rows.append(
            (
                c.layout.name,
                str(c.batch_size),
                remat,
                _bytes(c.peak_bytes),
                margin,
                f"{max(c.report.flops, c.report.device_flops) / 1e9:,.3f}",
                collectives or "none",
                f"{c.step_seconds * 1e3:,.2f} ms ({c.time.bound})",
                f"{c.samples_per_second:,.0f}",
            )
        )
    widths = [max(len(col), *(len(r[i]) for r in rows)) for i, col in enumerate(columns)]
    line = lambda cells: "  ".join(cell.ljust(w) for cell, w in zip(cells, widths, strict=True)).rstrip()  # noqa: E731
    text = [header, line(columns), line(["-" * w for w in widths])] + [line(r) for r in rows]
    errors = [c for c in result.candidates if c.error]
    if errors:
        text.append(f"Did not compile: {errors[0].layout.name}: {errors[0].error}")
    return "\n".join(text)
