"""Stages: a stack of identical blocks that runs in one scan anywhere, and pipelined over a `stage` axis."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from meshfit.pipeline import capture, schedules
from meshfit.strategies.current import get_strategy
from meshfit.strategies.mesh import MeshStrategy
from meshfit.strategies.pipeline import STAGE_AXIS


class Stages(nnx.Module):
    """`layers` blocks made by `make_block(rngs=rngs)`, their parameters stacked on a leading layer axis.

    Called as `stages(x)`, it runs the blocks in order on `x` (each block maps
    an array to one of the same shape and dtype). Without a `stage` mesh axis
    the blocks run in one `nnx.scan`, so the model trains on any strategy;
    under a `MeshStrategy` with a `stage` axis of size P, the layer axis is split
    over the stages (each stage's devices hold only its layers' parameters)
    and the blocks run pipelined as the strategy's `Pipeline` says. The stack
    is the same tree under every layout, so a checkpoint restores under any.
    Pipelined blocks hold only `nnx.Param`s (no dropout streams or batch statistics).

    Args:
        make_block: a function taking `rngs=` (an `nnx.Rngs`) and returning one block (an `nnx.Module`):
            a block class whose `__init__` takes `rngs` (keyword-only or not), or
            `lambda rngs: Block(128, rngs=rngs)`.
        layers: how many blocks.
        rngs: the random streams the blocks are initialised from (split once per layer).

    Example:
        >>> decoder = Stages(lambda rngs: Block(128, rngs=rngs), 8, rngs=nnx.Rngs(0))
        >>> h = decoder(h)
    """

    def __init__(self, make_block: Callable[..., nnx.Module], layers: int, *, rngs: nnx.Rngs):
        if not isinstance(layers, int) or layers < 1:
            raise ValueError(f"Stages needs a positive int number of `layers`. Received: layers={layers!r}.")
        self.layers = layers
        strategy = get_strategy()
        if isinstance(strategy, MeshStrategy) and strategy.pipeline is not None:
            strategy.pipeline.check_layers(layers, strategy.stages)
        mesh = jax.sharding.get_abstract_mesh()
        lead = STAGE_AXIS if not mesh.empty and STAGE_AXIS in mesh.shape else None

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return make_block(rngs=rngs)  # by keyword, as Flax modules take it: `Block.__init__(self, *, rngs)`

        self.blocks = create(rngs)
        for _, variable in nnx.iter_graph(self.blocks):
            if isinstance(variable, nnx.Param):
                _mark_stacked(variable, lead)

    def __call__(self, x: jax.Array) -> jax.Array:
        strategy = get_strategy()
        if isinstance(strategy, MeshStrategy) and strategy.pipeline is not None:
            graphdef, params, rest = nnx.split(self.blocks, nnx.Param, ...)
            if jax.tree.leaves(rest):
                names = sorted({"/".join(map(str, path)) for path, _ in nnx.to_flat_state(rest)})
                raise ValueError(
                    "Pipelined Stages run blocks that hold only nnx.Param variables. Received blocks that also "
                    f"hold {names}. Drop them from the block (e.g. no Dropout), or train without a 'stage' axis."
                )
            call = capture.Captured(
                _block_apply(graphdef),
                nnx.to_pure_dict(params),
                x,
                mesh=strategy.mesh,
                pipeline=strategy.pipeline,
                replicas=strategy.num_replicas_in_sync,
                data_axes=_whole_copy_axes(strategy),
            )
            injected = capture.intercept(call)  # the fused 1f1b step splits the module here
            if injected is not None:
                return injected
            return schedules.run(
                call.apply,
                call.params,
                x,
                mesh=call.mesh,
                pipeline=call.pipeline,
                replicas=call.replicas,
                data_axes=call.data_axes,
            )
        return _scan(self.blocks, x)


def _whole_copy_axes(strategy: MeshStrategy) -> tuple[str, ...]:
    """The leading batch axes before the fsdp axis: a stage's devices along them hold whole parameter copies."""
    axes: list[str] = []
    for axis in strategy.batch_axes:
        if axis in (strategy.fsdp_axis, STAGE_AXIS):
            break
        axes.append(axis)
    return tuple(axes)


def _mark_stacked(variable: nnx.Variable, lead: str | None) -> None:
    """Names `lead` (the stage axis, or None on a mesh without one) as the variable's first sharding entry.

    The block's own names follow; a block without any keeps none on a mesh without a stage axis, so
    the strategy's default layout applies to it. The name is given only where the current mesh has
    the axis: Flax lays out variables by their names as they are created.
    """
    names = variable.get_metadata("out_sharding", None)
    if lead is None and names is None:
        return
    ndim = variable.get_value().ndim
    inner = tuple(names)[-(ndim - 1) :] if names is not None and ndim > 1 else (None,) * (ndim - 1)
    variable.set_metadata("out_sharding", (lead, *inner))


def _block_apply(graphdef: Any) -> Callable[[Any, jax.Array], jax.Array]:
    """`(params of one layer, x) -> block(x)` for the blocks of `graphdef`."""

    def apply(layer_params: Any, x: jax.Array) -> jax.Array:
        return nnx.merge(graphdef, layer_params, copy=True)(x)

    return apply


def _scan(blocks: nnx.Module, x: jax.Array) -> jax.Array:
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def forward(x, block):
        return block(x)

    return forward(x, blocks)
