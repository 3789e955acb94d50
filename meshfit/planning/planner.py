"""`meshfit.plan`: which layout, batch size and rematerialisation fit a model on these devices, and which is fastest.

Before any parameter exists: for every layout of the devices (`Mirrored`,
every `data` x `fsdp` x `tensor` factorisation as a `MeshStrategy`, and,
where the model holds `meshfit.pipeline.Stages`, `stage` x `data` layouts
whose stage counts divide its layers, each with every schedule that fits:
GPipe, 1f1b and circular, `stage_layouts`; where the inputs' sequences are
long, `context` x `data` layouts that split them, `context_layouts`),
every global batch size and every rematerialisation choice the model's
factory offers, the plan builds the model abstractly (`Model(...,
abstract=True)`: shapes and shardings, the factory run under `nnx.eval_shape`
only), compiles the train step exactly as `fit` would (`model.step_report`:
the strategy's compilation of the model's own steps) and reads XLA's memory
and cost analyses of it. Nothing runs. Each candidate's step time is
predicted by a roofline (`meshfit.cost.roofline`): a lower bound, as no step
runs faster than its device's peaks (on a GPU a real step took 3x it). So
`measure=K` times the K best-predicted candidates that fit with a few real
steps each (their parameters created then, one candidate at a time, each
freed before the next) and ranks those by the time measured. Candidates over
the memory limit are marked as not fitting, and those the strategy refuses
(a 1f1b schedule under a loss that is not a sum over rows) as not compiling,
with the reason.

A pipelined step's FLOPs count every tick of its loop, the idle ones too
(`meshfit.cost.step_report.StepReport.flops`: its devices run them), so where
compute binds, circular's smaller bubble puts it ahead of the other
pipelines; where activations bind the memory, a 1f1b candidate (a few
microbatches' activations kept) fits when GPipe's does not, and comes first.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import inspect
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from tqdm.std import tqdm

from meshfit.cost import roofline
from meshfit.cost.roofline import DeviceSpec, StepTime
from meshfit.cost.step_report import COLLECTIVE_KINDS, StepReport
from meshfit.model import Model
from meshfit.pipeline import Stages
from meshfit.pipeline.settings import STAGE_AXIS, Pipeline
from meshfit.steps.keras_module import is_keras_model
from meshfit.strategies.context_layout import CONTEXT_AXIS
from meshfit.strategies.layout import Rules
from meshfit.strategies.mesh import MeshStrategy
from meshfit.strategies.mirrored import MirroredStrategy

#: The mesh axes a plan factors the devices into, in `MeshStrategy` order.
MESH_AXES = ("data", "fsdp", "tensor")

#: From this many tokens a sequence (dimension 1 of the inputs) is long: a plan proposes `context` layouts.
LONG_SEQUENCE = 2048

#: Timed steps per measured candidate (after one untimed step that compiles).
MEASURE_STEPS = 3


@dataclasses.dataclass(frozen=True)
class Layout:
    """A way to lay the devices out: `MirroredStrategy` (`axes` None) or a `MeshStrategy` over `axes`
    (with `pipeline` where `axes` has a `stage` axis)."""

    axes: tuple[tuple[str, int], ...] | None = None
    pipeline: Pipeline | None = None

    @property
    def name(self) -> str:
        """ "mirrored", or the mesh's axes over more than one device: "fsdp=8", "data=2,fsdp=4", and with a
        pipeline its schedule, microbatches and (circular) repeats: "stage=4,data=2 gpipe M=8",
        "stage=2,data=4 circular M=8 v=2"."""
        if self.axes is None:
            return "mirrored"
        name = ",".join(f"{axis}={size}" for axis, size in self.axes if size > 1) or f"{self.axes[0][0]}=1"
        if self.pipeline is not None:
            name += f" {self.pipeline.schedule} M={self.pipeline.microbatches}"
            if self.pipeline.repeats > 1:
                name += f" v={self.pipeline.repeats}"
        return name

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
            axes=dict(self.axes),
            rules=rules,
            logical_axis_rules=logical_axis_rules,
            devices=list(devices),
            pipeline=self.pipeline,
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


def stage_layouts(count: int, layers: Sequence[int], batch_size: int) -> list[Layout]:
    """`stage` x `data` layouts of `count` devices for a model whose `Stages` stacks hold `layers` layers,
    each with every pipeline schedule that fits.

    A stage count P > 1 is proposed where it divides `count` and every stack's layers, and the batch's
    rows divide over the `count / P` data replicas. Its pipelines all cut each replica's rows into the
    same M microbatches, M the largest divisor of those rows up to 4P (the bubble (P - 1) / (v M + P - 1)
    shrinks as M grows; each microbatch must keep rows):

    * "gpipe";
    * "1f1b" (where the model holds one stack: it pipelines one): GPipe's bubble, the activations of
      min(2P - 1, M) passes kept instead of M + P - 1, the one that fits when activations bind;
    * "circular" with the smallest and the largest repeats v > 1 such that P v divides every stack's
      layers, where M >= P (a microbatch must be back at the first stage before its next round): the
      smallest bubble, for v M + P - 1 ticks of sends.

    At most four a stage count, so a plan compiles at most 4 x (divisors of `count`) pipelined programs
    per batch size and remat choice (at most 12 on 8 devices), each a full compilation: seconds for a
    small model on a few CPU cores, minutes for a large one. The rest lie between these: a v between the
    two lies between them in bubble and sends, another M moves the bubble as the formula says; build
    those by hand and read `model.step_report`. Each pipeline passes the `Pipeline`'s own checks
    (`check`, `check_layers`). None without stacks.
    """
    found: list[Layout] = []
    for stages in range(2, count + 1):
        if count % stages or not layers or any(n % stages for n in layers):
            continue
        data = count // stages
        if batch_size % data:
            continue
        rows = batch_size // data
        microbatches = max(m for m in range(1, min(rows, 4 * stages) + 1) if rows % m == 0)
        pipelines = [Pipeline(microbatches=microbatches)]
        if len(layers) == 1:
            pipelines.append(Pipeline(microbatches=microbatches, schedule="1f1b"))
        circular = [
            Pipeline(microbatches=microbatches, schedule="circular", repeats=repeats)
            for repeats in range(2, min(layers) // stages + 1)
        ]
        circular = [pipeline for pipeline in circular if _runs(pipeline, stages, layers)]
        pipelines += circular[:1] + circular[1:][-1:]  # the smallest and the largest repeats
        found += [Layout(((STAGE_AXIS, stages), ("data", data)), pipeline) for pipeline in pipelines]
    return found


def context_layouts(count: int, sequence: int | None) -> list[Layout]:
    """`context` x `data` layouts of `count` devices for inputs whose sequence has `sequence` tokens: one for
    each C > 1 dividing `count` such that the sequence cuts into 2C chunks (ring attention's load-balanced
    causal layout), with `fsdp` and `tensor` at 1 so rules naming them still apply. None without a sequence.

    The model must attend through `meshfit.layers.dot_product_attention`; a model that does not is listed
    as not compiling, with the reason.
    """
    if not sequence:
        return []
    sizes = [c for c in range(2, count + 1) if count % c == 0 and sequence % (2 * c) == 0]
    return [Layout(((CONTEXT_AXIS, c), ("data", count // c), ("fsdp", 1), ("tensor", 1))) for c in sizes]


def _sequence(x: Any) -> int | None:
    """The sequence length of the inputs: dimension 1 of the first input with two or more dimensions."""
    for leaf in jax.tree.leaves(x):
        if np.ndim(leaf) >= 2:
            return int(np.shape(leaf)[1])
    return None


def _runs(pipeline: Pipeline, stages: int, layers: Sequence[int]) -> bool:
    """Whether `pipeline` passes its own checks on `stages` stages of stacks of `layers` layers."""
    try:
        pipeline.check(stages)
        for count in layers:
            pipeline.check_layers(count, stages)
    except ValueError:
        return False
    return True


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One compiled candidate: a layout, a global batch size and a remat choice, with what its step costs.

    Attributes:
        layout: how the devices are laid out (`Layout`).
        batch_size: the global batch size.
        remat: the value given to the factory's `remat=` argument (None: the factory has none).
        report: XLA's analyses of the compiled train step, per device (None where it did not compile).
        time: the roofline's step time (`meshfit.cost.roofline.StepTime`, seconds; None without a report): a
            lower bound, the step at the device's peaks.
        memory_limit: bytes one device may hold (None: no limit).
        error: why the candidate could not be compiled (a rule that does not divide a dimension, a 1f1b
            schedule under a loss that is not a sum over rows), else None.
        measured_seconds: seconds per real step, where `plan(measure=K)` timed this candidate, else None.
        measure_error: why this candidate's real steps failed (out of memory, for one), else None.
    """

    layout: Layout
    batch_size: int
    remat: Any
    report: StepReport | None
    time: StepTime | None
    memory_limit: int | None
    error: str | None = None
    measured_seconds: float | None = None
    measure_error: str | None = None
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
        """Compiled, its peak within the memory limit, and (where measured) its real steps ran."""
        return self.report is not None and (self.margin is None or self.margin >= 0) and self.measure_error is None

    @property
    def step_seconds(self) -> float | None:
        """The roofline's step time: a lower bound."""
        return None if self.time is None else self.time.total

    @property
    def samples_per_second(self) -> float | None:
        """The predicted global samples per second (an upper bound, from the roofline's time)."""
        if self.time is None or self.time.total <= 0:
            return None
        return self.batch_size / self.time.total

    @property
    def measured_samples_per_second(self) -> float | None:
        """The global samples per second of the real steps, where measured."""
        if not self.measured_seconds:
            return None
        return self.batch_size / self.measured_seconds

    def strategy(self) -> MirroredStrategy | MeshStrategy:
        """A ready strategy in this candidate's layout, over the plan's devices with its rules."""
        return self._strategy()


@dataclasses.dataclass(frozen=True)
class Plan:
    """The candidates of `meshfit.plan`, best first.

    Attributes:
        candidates: those measured (`measure=K`), by measured samples/s; then the others that fit, by
            predicted samples/s (fastest first); then those over the memory limit (smallest peak first),
            or whose real steps failed; then those that did not compile.
        device_kind: the kind of the planned devices.
        num_devices: how many.
        spec: the `DeviceSpec` the roofline used.
        memory_limit: bytes one device may hold (None: no limit).
        compiled: how many candidates were compiled (each once).
        seconds: how long planning took.
        measured: how many candidates were timed with real steps (`measure=K`).
    """

    candidates: list[Candidate]
    device_kind: str
    num_devices: int
    spec: DeviceSpec
    memory_limit: int | None
    compiled: int
    seconds: float
    measured: int = 0

    @property
    def best(self) -> Candidate:
        """The fastest candidate that fits (measured, where `measure=K` timed some); a ValueError when none does."""
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
    measure: int = 0,
    verbose: int | str = "auto",
    context: bool | None = None,
) -> Plan:
    """Compiles the train step for every layout, batch size and remat choice, creating no parameter.

    The layouts are `MirroredStrategy` and a `MeshStrategy` for every factorisation of the devices into
    `data` x `fsdp` x `tensor` (`layouts`), and where the factory's module holds `meshfit.pipeline.Stages`,
    `stage` x `data` meshes with each `Pipeline` schedule valid for each batch size: GPipe, 1f1b and
    circular (`stage_layouts`); each candidate is compiled once. A pipelined candidate's row shows its
    bubble, the bytes a device sends to its neighbour stage per step, one stage's parameters per device
    and the activations its schedule keeps (and of how many microbatch passes). A candidate the strategy
    refuses (a 1f1b schedule whose loss is not a sum over rows, or whose layers after `Stages` update
    state) is listed as not compiling, with the reason. Where the inputs' sequences are long
    (`LONG_SEQUENCE` tokens or more on dimension 1), `context` x `data` layouts split them
    (`context_layouts`; context parallelism, for a model attending through `mf.layers.dot_product_attention`):
    their rows show the activation memory per device a split sequence saves.

    Args:
        factory: a function returning a `flax.nnx.Module` (as `meshfit.Model` takes one); if it has a
            `remat` argument, each of its `remat` choices is planned. Not a Keras model, nor a factory of
            one (a TypeError): plan one with `model.step_report(x, y)` under each strategy.
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
        device_spec: the device's peaks for the roofline (default: `meshfit.cost.roofline.DEVICE_SPECS` for
            the device kind; `HOST_CPU` on CPU).
        measure: how many of the best-predicted candidates that fit to time with real steps (default 0:
            none). Each is built for real, one at a time, trained for one step that compiles and then
            `MEASURE_STEPS` timed steps, and freed before the next; those measured are ranked by the
            time measured, ahead of the rest. The roofline's time is a lower bound; this is the real one.
        verbose: 1 shows a progress bar on stderr naming the candidate being compiled (a plan of a large
            model on many devices compiles for minutes); 0 shows nothing; "auto" (default) shows it when
            stderr is a terminal.
        context: whether to propose `context` layouts: None (default) where the sequence is long
            (`LONG_SEQUENCE`), True for any sequence that splits, False never.

    Returns:
        A `Plan`: `plan.best.strategy()` is a ready strategy; `print(plan)` prints the table.

    Example:
        >>> p = mf.plan(lambda: MLP(rngs=nnx.Rngs(0)), x[:64], y[:64],
        ...             compile=dict(optimizer="adam", loss="sparse_categorical_crossentropy"),
        ...             batch_sizes=[64, 256], measure=2)
        >>> print(p)
        >>> with p.best.strategy().scope(): ...
    """
    start = time.perf_counter()
    if is_keras_model(factory):
        raise _not_a_flax_factory(type(factory).__name__)
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
    if isinstance(measure, bool) or not isinstance(measure, int) or measure < 0:
        raise ValueError(
            "`measure` is how many of the best-predicted candidates to time with real steps, an int >= 0. "
            f"Received: measure={measure!r}."
        )
    if memory_limit is None:
        memory_limit = (devices[0].memory_stats() or {}).get("bytes_limit")
    elif isinstance(memory_limit, bool) or not isinstance(memory_limit, int) or memory_limit <= 0:
        raise ValueError(f"`memory_limit` must be a positive number of bytes or None. Received: {memory_limit!r}.")
    spec = device_spec or _default_spec(devices[0])

    def strategy_of(layout: Layout) -> Callable[[], Any]:
        return functools.partial(layout.strategy, devices, rules, logical_axis_rules)

    if context not in (None, True, False):
        raise ValueError(f"`context` must be None (by the sequence's length), True or False. Received: {context!r}.")
    stacks = _stage_layers(factory, remats[0])
    sequence = _sequence(x)
    if context is False or (context is None and (sequence or 0) < LONG_SEQUENCE):
        sequence = None
    jobs = [
        (layout, batch_size, choice)
        for batch_size in batch_sizes
        for layout in layouts(len(devices))
        + stage_layouts(len(devices), stacks, batch_size)
        + context_layouts(len(devices), sequence)
        for choice in remats
    ]

    def compile_one(job: tuple[Layout, int, Any]) -> Candidate:
        layout, batch_size, choice = job
        try:
            report = _compile(factory, choice, strategy_of(layout)(), compile, x, y, batch_size)
        except ValueError as error:  # a layout rule, batch or schedule this mesh or model cannot take
            return Candidate(
                layout, batch_size, choice, None, None, memory_limit, str(error), _strategy=strategy_of(layout)
            )
        time_ = roofline.step_time(report, spec)
        return Candidate(layout, batch_size, choice, report, time_, memory_limit, None, _strategy=strategy_of(layout))

    # One after another: a pool of threads compiles no faster on a host of few cores.
    candidates = [compile_one(job) for job in _progress(jobs, verbose)]
    if all(c.error for c in candidates):
        raise ValueError(f"No candidate compiled. The first error: {candidates[0].error}")
    candidates = sorted(candidates, key=_rank)
    timed = [c for c in candidates if c.fits][:measure]
    measured = {id(c): _measure(factory, c, compile, x, y) for c in timed}
    candidates = sorted((measured.get(id(c), c) for c in candidates), key=_rank)
    return Plan(
        candidates=candidates,
        device_kind=devices[0].device_kind,
        num_devices=len(devices),
        spec=spec,
        memory_limit=memory_limit,
        compiled=sum(c.report is not None for c in candidates),
        seconds=time.perf_counter() - start,
        measured=len(timed),
    )


def _stage_layers(factory: Callable[..., Any], remat: Any) -> list[int]:
    """The layers of each `meshfit.pipeline.Stages` stack in the factory's module (built abstractly)."""
    build = factory if remat is None else functools.partial(factory, remat=remat)

    def checked() -> Any:
        module = build()
        if is_keras_model(module):
            raise _not_a_flax_factory(f"a factory returning {type(module).__name__}")
        return module

    module = nnx.eval_shape(checked)
    return [node.layers for _, node in nnx.iter_graph(module) if isinstance(node, Stages)]


def _not_a_flax_factory(received: str) -> TypeError:
    return TypeError(
        "meshfit.plan takes a factory of a Flax module (a function returning a flax.nnx.Module), which it builds "
        "abstractly, creating no parameter; a Keras model creates its variables when it is built, so plan does "
        f"not take one. Received: {received} (a Keras model). For a Keras model, build it once and compare "
        "strategies with model.step_report(x, y) under each strategy's scope (docs/keras.md, 'Bring your Keras "
        "model')."
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


def _measure(factory, candidate: Candidate, compile_args, x, y) -> Candidate:
    """`candidate` with the seconds of its real steps: built, one untimed step (it compiles), then
    `MEASURE_STEPS` timed ones, each waited for; the model is freed (and JAX's caches cleared) before
    returning, so that the next candidate starts from the memory this one started from."""
    build = factory if candidate.remat is None else functools.partial(factory, remat=candidate.remat)
    grow = lambda a: np.resize(np.asarray(a), (candidate.batch_size, *np.shape(a)[1:]))  # noqa: E731
    xs, ys = jax.tree.map(grow, x), jax.tree.map(grow, y)
    model = None
    try:
        with candidate.strategy().scope():
            model = Model(build)
            model.compile(**compile_args)
        model.train_on_batch(xs, ys)  # compiles; not timed
        jax.block_until_ready(model.params)
        start = time.perf_counter()
        for _ in range(MEASURE_STEPS):
            model.train_on_batch(xs, ys)  # its logs are pulled to the host: each step is waited for
        jax.block_until_ready(model.params)
        seconds = (time.perf_counter() - start) / MEASURE_STEPS
        return dataclasses.replace(candidate, measured_seconds=seconds)
    except jax.errors.JaxRuntimeError as error:  # out of memory: the prediction was wrong, the row says so
        return dataclasses.replace(candidate, measure_error=str(error).strip().splitlines()[0][:200])
    finally:
        del model
        gc.collect()
        jax.clear_caches()


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
        f"meshfit.cost.roofline.DEVICE_SPECS has no peaks for device kind {device.device_kind!r}. "
        "Pass device_spec=meshfit.cost.roofline.DeviceSpec(peak_flops, memory_bandwidth, interconnect_bandwidth) "
        "(`meshfit plan --device-spec FLOPS,BYTES/S,BYTES/S`)."
    )


def _rows(tree: Any, name: str) -> int:
    leaves = jax.tree.leaves(tree)
    if not leaves or any(np.ndim(a) == 0 for a in leaves):
        raise ValueError(f"`{name}` must be an array (or a pytree of arrays) with a batch dimension. Received: {name}.")
    return int(np.shape(leaves[0])[0])


def _rank(candidate: Candidate) -> tuple:
    """Measured candidates first (by measured samples/s); then those that fit, by predicted samples/s (a
    pipeline's FLOPs count its idle ticks: circular ahead of GPipe where compute binds); then those over the
    memory limit, smallest peak first (so where activations bind, a 1f1b candidate fits or comes first);
    then those that did not compile."""
    if candidate.fits and candidate.measured_seconds is not None:
        return (0, -candidate.measured_samples_per_second)
    if candidate.fits:
        return (1, -(candidate.samples_per_second or 0.0))
    if candidate.report is not None:
        return (2, candidate.peak_bytes)
    return (3, 0)


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
        f"{result.compiled} candidates compiled{f', {result.measured} measured,' if result.measured else ''} in "
        f"{result.seconds:.1f} s; roofline {spec.peak_flops / 1e12:g} "
        f"TFLOP/s, memory {spec.memory_bandwidth / 1e9:g} GB/s, interconnect {spec.interconnect_bandwidth / 1e9:g} GB/s"
    )
    columns = (
        "layout",
        "batch",
        "remat",
        "peak/device",
        "margin",
        "GFLOP/dev",
        "collectives/dev",
        "bubble",
        "p2p/dev",
        "stage params",
        "kept act (passes)",
        "step ≥ (roofline)",
        "step measured",
        "samples/s",
    )
    rows = []
    for c in result.candidates:
        remat = "-" if c.remat is None else str(c.remat)
        if c.report is None:
            rows.append((c.layout.name, str(c.batch_size), remat, "-", "does not compile", *[""] * 9))
            continue
        collectives = " ".join(
            f"{_SHORT[k]} {_bytes(c.report.collectives[k])}" for k in COLLECTIVE_KINDS if c.report.collectives.get(k)
        )
        margin = "no limit" if c.margin is None else ("" if c.margin >= 0 else "OVER ") + _bytes(abs(c.margin))
        if c.measured_seconds is not None:
            measured, samples = f"{c.measured_seconds * 1e3:,.2f} ms", f"{c.measured_samples_per_second:,.0f}"
        else:
            measured, samples = ("failed" if c.measure_error else ""), f"≤ {c.samples_per_second:,.0f}"
        stage = c.report.pipeline
        pipelined = (
            (
                f"{stage.bubble:.1%}",
                _bytes(stage.p2p_bytes),
                _bytes(stage.stage_param_bytes),
                f"{_bytes(stage.activation_bytes)} ({stage.kept_passes})",
            )
            if stage is not None
            else ("-", "-", "-", "-")
        )
        rows.append(
            (
                c.layout.name,
                str(c.batch_size),
                remat,
                _bytes(c.peak_bytes),
                margin,
                f"{max(c.report.flops, c.report.device_flops) / 1e9:,.3f}",
                collectives or "none",
                *pipelined,
                f"{c.step_seconds * 1e3:,.2f} ms ({c.time.bound})",
                measured,
                samples,
            )
        )
    widths = [max(len(col), *(len(r[i]) for r in rows)) for i, col in enumerate(columns)]
    line = lambda cells: "  ".join(cell.ljust(w) for cell, w in zip(cells, widths, strict=True)).rstrip()  # noqa: E731
    text = [header, line(columns), line(["-" * w for w in widths])] + [line(r) for r in rows]
    text.append(
        "step ≥ (roofline): a lower bound, the step at the device's peak FLOP/s and bandwidths; real steps take longer."
    )
    if result.measured:
        text.append(
            f"step measured: {MEASURE_STEPS} real steps each of the {result.measured} best-predicted candidates that "
            "fit, ranked first by it; samples/s: measured, else ≤ the roofline's."
        )
    else:
        text.append("Time the best with real steps: measure=K (meshfit plan --measure K); samples/s: ≤ the roofline's.")
    if any(c.report is not None and c.report.pipeline is not None for c in result.candidates):
        text.append(
            "bubble: the share of a stage's ticks idle, (P - 1) / (v M + P - 1), whose FLOPs count in the step; "
            "p2p/dev: bytes a device sends to its neighbour stage per step; "
            "stage params: one stage's parameters per device; kept act: the activations its schedule keeps per "
            "device, of how many microbatch passes (gpipe, circular: v M + P - 1; 1f1b: min(2P - 1, M))."
        )
    reasons: dict[str, str] = {}  # each reason once, with the first layout it stopped
    for c in result.candidates:
        if c.error and c.error not in reasons:
            reasons[c.error] = c.layout.name
    text += [f"Did not compile: {name}: {error}" for error, name in reasons.items()]
    failed = [c for c in result.candidates if c.measure_error]
    if failed:
        text.append(f"Real steps failed: {failed[0].layout.name}: {failed[0].measure_error}")
    return "\n".join(text)
