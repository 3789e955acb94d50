"""MeshStrategy: FSDP and tensor parallelism over a named device mesh."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshfit.pipeline import layer_stacks, one_f_one_b
from meshfit.pipeline.settings import STAGE_AXIS, Pipeline
from meshfit.pipeline.stage_layout import StageLayout
from meshfit.runtime import cluster
from meshfit.strategies import layout, placement
from meshfit.strategies.base import Strategy
from meshfit.strategies.context_layout import CONTEXT_AXIS, ContextLayout, SequenceAxis, expect_attention
from meshfit.strategies.current import get_strategy
from meshfit.strategies.device_mesh import DeviceMeshStrategy, build_mesh

if TYPE_CHECKING:
    from meshfit.steps.builtin import StepFunctions

DEFAULT_AXES = {"data": -1, "fsdp": 1, "tensor": 1}

#: The mesh axes meshfit gives a meaning to; any other must be named by a rule, `batch_axes` or `fsdp_axis`.
KNOWN_AXES = ("data", "fsdp", "tensor", STAGE_AXIS, CONTEXT_AXIS)


def _axis_sizes(axes: Mapping[str, int], n_devices: int) -> dict[str, int]:
    sizes = dict(axes)
    unknown = [name for name, size in sizes.items() if size == -1]
    if len(unknown) > 1:
        raise ValueError(f"At most one mesh axis may be -1 (inferred). Received axes={dict(axes)}.")
    known = int(np.prod([s for s in sizes.values() if s != -1]))
    if any(s == 0 or s < -1 for s in sizes.values()):
        raise ValueError(f"Mesh axis sizes must be positive or -1. Received axes={dict(axes)}.")
    if unknown:
        if n_devices % known:
            raise ValueError(f"{n_devices} devices do not divide into axes {dict(axes)}.")
        sizes[unknown[0]] = n_devices // known
    if int(np.prod(list(sizes.values()))) != n_devices:
        raise ValueError(
            f"Mesh axes {dict(axes)} need {int(np.prod(list(sizes.values())))} devices; there are {n_devices}. "
            "Use -1 for one axis to infer its size."
        )
    return sizes


class MeshStrategy(DeviceMeshStrategy):
    """Shards parameters, optimizer state and batches over a named device mesh.

    The batch is split over the data-like axes (`batch_axes`); each parameter is
    laid out by `rules`, then Flax sharding metadata, then a default that shards
    large parameters over `fsdp` (see `meshfit.strategies.layout`). Optimizer
    state follows its parameter. The step is compiled with `jax.jit` and
    `NamedSharding` (GSPMD inserts the collectives). Spans all processes of a
    `jax.distributed` job. Inside `scope()` the mesh is JAX's current mesh, so
    modules created there are sharded as they are built (Flax eager sharding),
    and `constrain` can pin activation layouts.

    Args:
        axes: mesh axis names and sizes, in order; one size may be -1 (inferred).
        rules: sequence of `(regex, spec)` (or a mapping of them); `spec` a `PartitionSpec`
            or a tuple of axis names / None per dimension. Every rule must match a parameter.
            Or a `keras.distribution.LayoutMap`: its items are rules on the same paths (each
            key a regex, its layout's `axes` the spec), and the axes it names must be the mesh's.
        logical_axis_rules: mapping (or pairs) from logical axis names in Flax
            metadata to mesh axes, e.g. `{"embed": "fsdp", "mlp": "tensor"}`.
        batch_axes: mesh axes the batch dimension is split over.
        fsdp_axis: the axis the default rule shards large parameters over.
        min_shard_size: parameters with fewer elements are replicated by default.
        devices: devices to use; all devices of all processes by default.
        sequence_axis: with a `context` axis, which dimension of each input and target is the sequence it
            splits: one for all (default 1, `(batch, seq, ...)`), or a mapping from an input's or target's
            name ("x", "y", or a dict input's key) to its dimension, None to keep that one whole.
        pipeline: how a `stage` axis runs the model's `meshfit.pipeline.Stages` (`Pipeline`);
            with a `stage` axis and no `pipeline`, GPipe with one microbatch per stage.
            A batch size must give each data replica a multiple of M rows; a batch an iterable
            yields, and the last partial batch, are padded to a multiple of the replicas times M.

    A `context` axis splits each batch's sequence dimension over its devices (context parallelism): the
    model's attention must then be `meshfit.layers.dot_product_attention`, which runs ring or all-gather
    attention over the axis (`docs/sharding.md`, "Context parallelism").

    Example:
        >>> strategy = MeshStrategy(axes={"data": 2, "fsdp": 2, "tensor": 2},
        ...                         rules=[(r"mlp/up/kernel", (None, "tensor")),
        ...                                (r"mlp/down/kernel", ("tensor", None))])
    """

    def __init__(
        self,
        axes: Mapping[str, int] = DEFAULT_AXES,
        rules: layout.Rules | Mapping[str, Any] = (),
        logical_axis_rules: Mapping[str, Any] | Sequence[tuple[str, Any]] | None = None,
        batch_axes: Sequence[str] = ("data", "fsdp"),
        fsdp_axis: str = "fsdp",
        min_shard_size: int = 2**12,
        devices: Sequence[jax.Device] | None = None,
        pipeline: Pipeline | None = None,
        sequence_axis: SequenceAxis = 1,
    ):
        from_layout_map = layout.is_layout_map(rules)
        rules = layout.rules_of(rules)
        _check_axis_names(axes, rules, logical_axis_rules, batch_axes, fsdp_axis)
        if devices is None:
            cluster.initialize()
            devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        sizes = _axis_sizes(axes, len(devices))
        if from_layout_map:
            _check_layout_map_axes(rules, sizes)
        super().__init__(build_mesh(devices, sizes), tuple(a for a in batch_axes if a in sizes))
        self.rules = [(pattern, layout.as_spec(spec)) for pattern, spec in rules]
        if isinstance(logical_axis_rules, Mapping):
            logical_axis_rules = list(logical_axis_rules.items())
        self.logical_axis_rules = list(logical_axis_rules or [])
        self.fsdp_axis = fsdp_axis
        self.min_shard_size = min_shard_size
        self.pipeline = _pipeline(sizes, pipeline)
        self._context = _context_layout(self.mesh, self.batch_axes, sizes, sequence_axis)

    @property
    def context_layout(self) -> ContextLayout | None:
        """How a `context` axis splits sequences (None without one, or with one of size 1)."""
        return self._context

    @property
    def stages(self) -> int:
        """The size of the `stage` axis (1 without one)."""
        return int(self.mesh.shape.get(STAGE_AXIS, 1))

    @property
    def batch_multiple(self) -> int:
        microbatches = self.pipeline.microbatches if self.pipeline is not None else 1
        return self.num_replicas_in_sync * microbatches

    def check_batch_size(self, batch_size: int) -> None:
        if self.pipeline is not None:
            self.pipeline.check_batch_size(batch_size, self.num_replicas_in_sync)

    @property
    def stage_layout(self) -> StageLayout | None:
        """The `stage` axis a `meshfit.pipeline.Stages` stack runs pipelined over (None without one): this
        mesh, its `Pipeline`, the data replicas, and the leading batch axes before `fsdp_axis`, along which a
        stage's devices hold whole copies of its parameters."""
        if self.pipeline is None:
            return None
        whole_copies: list[str] = []
        for axis in self.batch_axes:
            if axis in (self.fsdp_axis, STAGE_AXIS):
                break
            whole_copies.append(axis)
        return StageLayout(self.mesh, self.pipeline, self.num_replicas_in_sync, tuple(whole_copies))

    def step_functions(self, steps: StepFunctions) -> StepFunctions:
        """`steps` as they are, or, under the "1f1b" schedule and a module holding a `Stages` stack, a copy
        whose training objective is the fused 1F1B loop (`meshfit.pipeline.one_f_one_b`)."""
        stage_layout = self.stage_layout
        if stage_layout is None or stage_layout.pipeline.schedule != "1f1b":
            return steps
        module = getattr(getattr(steps, "adapter", None), "module", None)  # a custom train_step's steps have none
        objective = one_f_one_b.pipelined_objective(module, stage_layout)
        return steps if objective is None else steps.with_pipelined_objective(objective)

    @contextlib.contextmanager
    def scope(self) -> Iterator[MeshStrategy]:
        from flax.core import spmd

        with super().scope(), jax.set_mesh(self.mesh), spmd.logical_axis_rules(self.logical_axis_rules):
            yield self

    # -- layout ------------------------------------------------------------------

    def param_specs(self, params: Any, hints: Any = None) -> Any:
        """One PartitionSpec per parameter (rules, then metadata, then the default)."""
        if self.pipeline is not None:
            self._check_stages(params, hints)
        specs = layout.resolve_specs(
            params,
            self.mesh,
            rules=self.rules,
            hints=hints,
            logical_axis_rules=dict(self.logical_axis_rules),
            fsdp_axis=self.fsdp_axis,
            min_shard_size=self.min_shard_size,
        )
        if self.pipeline is not None:
            self._check_stages(params, specs, required=True)
        return specs

    def _check_stages(self, params: Any, specs: Any, required: bool = False) -> None:
        """Raises unless each stack `specs` puts on `stage` splits evenly (and, if `required`, there is one)."""
        assert self.pipeline is not None
        if specs is None:
            return
        names = {layout.path_name(path): spec for path, spec in layout.flatten_specs(specs)}
        staged = [
            layers
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
            if (layers := layer_stacks.stack_layers(np.shape(leaf), names.get(layout.path_name(path)))) is not None
        ]
        if required and not staged:
            raise ValueError(
                f"MeshStrategy has a '{STAGE_AXIS}' axis of size {self.stages}, but no parameter of the model lies "
                "on it. Build the pipelined blocks with meshfit.pipeline.Stages, or drop the 'stage' axis."
            )
        for layers in staged:
            self.pipeline.check_layers(layers, self.stages)

    def state_specs(self, state: Any, param_hints: Any = None) -> Any:
        """Specs for a whole TrainState: parameters by rule, the rest following them."""
        params = self.param_specs(state.params, param_hints)
        model_state = layout.resolve_specs(
            state.model_state, self.mesh, fsdp_axis=self.fsdp_axis, min_shard_size=self.min_shard_size
        )
        replicated = lambda tree: jax.tree.map(lambda _: P(), tree)  # noqa: E731
        opt_state = None if state.opt_state is None else layout.follow_params(state.opt_state, state.params, params)
        rng = None if state.rng is None else P()
        loss_scale = replicated(state.loss_scale)
        return type(state)(params, model_state, opt_state, replicated(state.metrics), P(), rng, loss_scale)

    def state_shardings(self, state: Any, param_hints: Any = None) -> Any:
        specs = self.state_specs(state, param_hints)
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs, is_leaf=lambda s: isinstance(s, P))

    # -- batches, compilation, results ----------------------------------------

    @property
    def batch_block(self) -> tuple[int, int]:
        rows, shard = self.batch_multiple, self.batch_multiple // self.num_replicas_in_sync
        starts = sorted(
            {index[0].start or 0 for index in self.batch_sharding().addressable_devices_indices_map((rows,)).values()}
        )
        if starts != list(range(starts[0], starts[0] + shard * len(starts), shard)):
            raise ValueError(
                "This process's devices do not hold one contiguous block of the batch. "
                "Put the batch axes first in `axes`."
            )
        local = shard * len(starts)
        return starts[0] // local, rows // local

    def compile(self, fn: Callable, *, donate_argnums: tuple[int, ...] = ()) -> Callable:
        """`jax.jit` whose first output keeps the layout of the first donated argument."""

        def in_scope(*args):
            # `constrain` inside the model finds this strategy, `Stages` its stage layout, and a context axis
            # checks that the model attends through meshfit.layers (the one attention that splits sequences).
            with Strategy.scope(self), expect_attention(self._context):
                return fn(*args)

        return layout.jit_keeping_layout(
            in_scope, donate_argnums[0] if donate_argnums else None, donate_argnums=donate_argnums
        )

    def distribute_batch(self, host_batch: Any, stacked: bool = False) -> Any:
        """Rows over the batch axes; with a `context` axis, each input's and target's sequence over it too."""
        if self._context is None:
            return super().distribute_batch(host_batch, stacked)
        shardings = self._context.batch_shardings(host_batch, self.batch_sharding(stacked), stacked)
        return jax.tree.map(placement.put_local_rows, host_batch, shardings)

    def constrain(self, x: jax.Array, *spec: Any) -> jax.Array:
        """Pins `x` to `spec` on this mesh. Inside a pipeline's stage loop (a `shard_map` manual over `stage`
        and the data axes), `x` is already one device's part along the loop's axes: they are dropped from
        `spec`, and what is left pins `x` on the mesh as the loop sees it, so blocks keep their constraints.
        A model written for context parallelism pins its sequence dimension to `context`; on a mesh without
        that axis the name is dropped, so the same model runs on any mesh."""
        if CONTEXT_AXIS not in self.mesh.shape:
            spec = tuple(_without(entry, {CONTEXT_AXIS}) for entry in spec)
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty or STAGE_AXIS not in mesh.manual_axes:
            return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, P(*spec)))
        manual = set(mesh.manual_axes)  # the loop's own axes: `x` is already this device's part along them
        spec = tuple(_without(entry, manual) for entry in spec)
        if all(entry is None for entry in spec):
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))

    def __repr__(self) -> str:
        axes = ", ".join(f"{k}={v}" for k, v in self.mesh.shape.items())
        return f"MeshStrategy({axes})"


def _without(entry: Any, axes: set[str]) -> Any:
    """A `PartitionSpec` entry (None, an axis name or a tuple of them) without `axes`."""
    names = (entry,) if isinstance(entry, str) else tuple(entry or ())
    kept = tuple(name for name in names if name not in axes)
    return None if not kept else kept[0] if len(kept) == 1 else kept


def _check_layout_map_axes(rules: layout.Rules, sizes: Mapping[str, int]) -> None:
    """Raises unless every axis a `keras.distribution.LayoutMap`'s layouts name is one of the mesh's."""
    for pattern, spec in rules:
        for entry in layout.as_spec(spec):
            for axis in (entry,) if isinstance(entry, str) else entry or ():
                if axis not in sizes:
                    raise ValueError(
                        f"keras.distribution.LayoutMap key {pattern!r} lays its variables out as {tuple(spec)}, "
                        f"naming mesh axis {axis!r}, but MeshStrategy's mesh has axes {tuple(sizes)}. Give the "
                        "MeshStrategy the axes the LayoutMap's DeviceMesh names (e.g. axes={'batch': 2, "
                        "'model': 4}, batch_axes=('batch',)), or change the LayoutMap's layouts."
                    )


def _check_axis_names(axes, rules, logical_axis_rules, batch_axes, fsdp_axis) -> None:
    """Raises unless every mesh axis is one meshfit knows or one the rules, `batch_axes` or `fsdp_axis` name:
    an axis nothing names would silently act as one more copy of everything."""
    named = set(KNOWN_AXES) | set(batch_axes) | {fsdp_axis}
    for _, spec in rules:
        named |= {a for entry in layout.as_spec(spec) for a in ((entry,) if isinstance(entry, str) else entry or ())}
    pairs = logical_axis_rules.items() if isinstance(logical_axis_rules, Mapping) else (logical_axis_rules or ())
    for _, target in pairs:
        named |= {target} if isinstance(target, str) else set(target or ())
    unknown = [name for name in axes if name not in named]
    if unknown:
        raise ValueError(
            f"MeshStrategy does not know mesh axis {unknown[0]!r}. Received axes={dict(axes)}. "
            f"Known axes: {', '.join(KNOWN_AXES)}; another name must be named by `rules`, "
            "`logical_axis_rules`, `batch_axes` or `fsdp_axis`."
        )
    if CONTEXT_AXIS in batch_axes:
        raise ValueError(
            f"'{CONTEXT_AXIS}' splits the sequence, not the batch. Received batch_axes={tuple(batch_axes)}. "
            f"Leave '{CONTEXT_AXIS}' out of batch_axes."
        )


def _context_layout(mesh, batch_axes, sizes: Mapping[str, int], sequence_axis) -> ContextLayout | None:
    """The strategy's context layout: None without a `context` axis (or with one of size 1)."""
    if sizes.get(CONTEXT_AXIS, 1) == 1:
        return None
    if not isinstance(sequence_axis, int | Mapping) or isinstance(sequence_axis, bool):
        raise TypeError(
            "`sequence_axis` must be an int or a mapping from input names to an int or None. "
            f"Received: sequence_axis={sequence_axis!r}."
        )
    head_axis = "tensor" if sizes.get("tensor", 1) > 1 else None
    return ContextLayout(mesh, tuple(batch_axes), head_axis, sequence_axis)


def _pipeline(sizes: Mapping[str, int], pipeline: Pipeline | None) -> Pipeline | None:
    """The strategy's pipeline: `pipeline`, GPipe by default with a `stage` axis, None without one."""
    if STAGE_AXIS not in sizes:
        if pipeline is not None:
            raise ValueError(
                f"`pipeline` needs a '{STAGE_AXIS}' mesh axis to run over. Received axes={dict(sizes)}. "
                f'Add one, e.g. axes={{"{STAGE_AXIS}": 4, "data": -1}}.'
            )
        return None
    pipeline = pipeline if pipeline is not None else Pipeline(microbatches=sizes[STAGE_AXIS])
    if not isinstance(pipeline, Pipeline):
        raise TypeError(f"`pipeline` must be a meshfit.strategies.Pipeline. Received: {type(pipeline).__name__}.")
    pipeline.check(sizes[STAGE_AXIS])
    return pipeline


def constrain(x: jax.Array, *spec: Any) -> jax.Array:
    """Pins the layout of an activation inside a model, e.g. `constrain(h, ("data", "fsdp"), None, "tensor")`.

    The current strategy answers (`Strategy.constrain`): a no-op unless a
    MeshStrategy is tracing the step, so model code runs unchanged on any strategy.
    """
    return get_strategy().constrain(x, *spec)
