"""Stages: a stack of identical blocks that runs in one scan anywhere, and pipelined over a `stage` axis."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from meshfit.pipeline import capture, schedules, stage_layout
from meshfit.pipeline.settings import STAGE_AXIS


class Stages(nnx.Module):
    """`layers` blocks made by `make_block(rngs=rngs)`, their parameters stacked on a leading layer axis.

    Called as `stages(x)`, it runs the blocks in order on `x` (each block maps
    an array to one of the same shape and dtype). Without a `stage` mesh axis
    the blocks run in one `nnx.scan`, so the model trains on any strategy;
    under a `MeshStrategy` with a `stage` axis of size P (whose scope sets the
    `meshfit.pipeline.stage_layout.StageLayout` the stack reads), the layer axis
    is split over the stages (each stage's devices hold only its layers'
    parameters) and the blocks run pipelined as the strategy's `Pipeline` says.
    Under a circular pipeline with v repeats the layer axis is stored
    repeat-major, (v, layers / v, ...), so each stage's devices hold the blocks
    it runs in every round and no step moves parameters between stages
    (`meshfit.pipeline.layer_stacks`); weights and checkpoints show the
    natural (layers, ...) form under every layout, so a checkpoint restores under any.
    Pipelined blocks hold only `nnx.Param`s (no dropout streams or batch statistics).
    The fused 1F1B train step splits the enclosing module at the call
    (`meshfit.pipeline.capture`): the call then records itself and returns its
    input, or returns the stage output it is handed.

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
        layout = stage_layout.current()
        if layout is not None:
            layout.pipeline.check_layers(layers, layout.stages)
        mesh = jax.sharding.get_abstract_mesh()
        lead = STAGE_AXIS if not mesh.empty and STAGE_AXIS in mesh.shape else None
        # The rounds the layer axis is stored in: a circular pipeline's repeats (repeat-major), else 1.
        self.repeats = layout.pipeline.repeats if layout is not None and lead is not None else 1

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return make_block(rngs=rngs)  # by keyword, as Flax modules take it: `Block.__init__(self, *, rngs)`

        self.blocks = create(rngs)
        for _, variable in nnx.iter_graph(self.blocks):
            if isinstance(variable, nnx.Param):
                if self.repeats > 1:
                    value = variable.get_value()
                    variable.set_value(value.reshape(self.repeats, layers // self.repeats, *value.shape[1:]))
                _mark_stacked(variable, lead, self.repeats)

    def __call__(self, x: jax.Array) -> jax.Array:
        layout, mode = stage_layout.current(), capture.mode()
        if layout is None and mode is None:
            return _scan(self.blocks, x, self.repeats)
        graphdef, params, rest = nnx.split(self.blocks, nnx.Param, ...)
        if jax.tree.leaves(rest):
            names = sorted({"/".join(map(str, path)) for path, _ in nnx.to_flat_state(rest)})
            raise ValueError(
                "Pipelined Stages run blocks that hold only nnx.Param variables. Received blocks that also "
                f"hold {names}. Drop them from the block (e.g. no Dropout), or train without a 'stage' axis."
            )
        params = nnx.to_pure_dict(params)
        repeat_major = layout is not None and self.repeats > 1 and self.repeats == layout.pipeline.repeats
        if self.repeats > 1 and not repeat_major:  # stored for another schedule: run in order, moved each step
            params = _in_order(params)
        call = capture.StackCall(_block_apply(graphdef), params, x)
        if mode is not None:  # the fused 1f1b step splits the module here
            return capture.intercept(call)
        assert layout is not None
        return schedules.run(call.apply, call.params, x, layout, repeat_major=repeat_major)


def _mark_stacked(variable: nnx.Variable, lead: str | None, repeats: int = 1) -> None:
    """Names `lead` (the stage axis, or None on a mesh without one) as the variable's layer axis sharding
    entry: the first, or the second after None for a repeat-major stack (`repeats` > 1).

    The block's own names follow; a block without any keeps none on a mesh without a stage axis, so
    the strategy's default layout applies to it. The name is given only where the current mesh has
    the axis: Flax lays out variables by their names as they are created.
    """
    names = variable.get_metadata("out_sharding", None)
    if lead is None and names is None:
        return
    layer_axes = (None, lead) if repeats > 1 else (lead,)
    block_ndim = variable.get_value().ndim - len(layer_axes)
    inner = tuple(names)[-block_ndim:] if names is not None and block_ndim > 0 else (None,) * block_ndim
    variable.set_metadata("out_sharding", (*layer_axes, *inner))


def _in_order(params: Any) -> Any:
    """A repeat-major stack's parameters, (v, layers / v, ...), in the natural form (layers, ...)."""
    return jax.tree.map(lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]), params)


def _block_apply(graphdef: Any) -> Callable[[Any, jax.Array], jax.Array]:
    """`(params of one layer, x) -> block(x)` for the blocks of `graphdef`."""

    def apply(layer_params: Any, x: jax.Array) -> jax.Array:
        return nnx.merge(graphdef, layer_params, copy=True)(x)

    return apply


def _scan(blocks: nnx.Module, x: jax.Array, repeats: int = 1) -> jax.Array:
    if repeats > 1:  # a repeat-major stack outside its pipeline: its layers in order
        graphdef, params, rest = nnx.split(blocks, nnx.Param, ...)
        blocks = nnx.merge(graphdef, _in_order(params), rest)

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def forward(x, block):
        return block(x)

    return forward(x, blocks)
