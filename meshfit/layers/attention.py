"""`dot_product_attention`: `jax.nn.dot_product_attention` that also runs on a sequence split over devices.

Without a `context` axis in the current strategy (or with `context_parallel=None`)
it is plain attention (`jax.nn.dot_product_attention`, whose `implementation=`
picks cuDNN's fused kernel on a GPU). Under a `MeshStrategy` with a `context`
axis of size C, the sequence of `query`, `key` and `value` is split over it, and
the attention runs per device under `jax.shard_map` (`context_parallel`): the
batch stays split over the batch axes and the heads over `tensor` where they
divide.
"""

from __future__ import annotations

import math
from functools import partial

import jax
from jax.sharding import PartitionSpec as P

from meshfit.core import compat
from meshfit.layers.context_parallel import STRATEGIES
from meshfit.strategies.context_layout import CONTEXT_AXIS, ContextLayout, note_attention
from meshfit.strategies.current import get_strategy

#: The values `context_parallel` takes: how K and V reach every device's queries (None: GSPMD's own gathers).
CONTEXT_PARALLEL_CHOICES = ("ring", "all_gather", None)


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    causal: bool = True,
    context_parallel: str | None = "ring",
    scale: float | None = None,
    implementation: str | None = None,
) -> jax.Array:
    """Scaled dot-product attention, split over the `context` mesh axis when the strategy has one.

    Args:
        query: `(batch, seq, heads, head_dim)`.
        key: `(batch, seq, kv_heads, head_dim)`; `heads` a multiple of `kv_heads` (grouped-query attention).
        value: shaped like `key`.
        causal: each position attends only to itself and earlier ones.
        context_parallel: under a `context` axis, "ring" (K/V blocks passed around the axis, an online softmax;
            causal work load-balanced, so `seq` must divide by 2 x C) or "all_gather" (every device gathers the
            whole K and V; `seq` divisible by C); None leaves the layout to GSPMD. Ignored without the axis.
        scale: the scores' factor; 1 / sqrt(head_dim) by default.
        implementation: `jax.nn.dot_product_attention`'s ("xla", "cudnn" or None), for plain attention and
            for "all_gather"'s one call per device; "ring" combines XLA blocks (cuDNN's kernel does not
            differentiate the log-sum-exp the combination needs).

    Returns:
        `(batch, seq, heads, head_dim)`, in `query`'s dtype, in the natural order of the sequence.

    Example:
        >>> out = mf.layers.dot_product_attention(q, k, v, causal=True, context_parallel="ring")
    """
    _check(query, key, value, context_parallel)
    layout = get_strategy().context_layout
    if layout is not None:
        note_attention()
    if layout is None or context_parallel is None:
        return jax.nn.dot_product_attention(
            query, key, value, scale=scale, is_causal=causal, implementation=implementation
        )
    _check_sequence(query, key, layout.size, causal, context_parallel)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    kernel = partial(
        STRATEGIES[context_parallel],
        axis=CONTEXT_AXIS,
        size=layout.size,
        causal=causal,
        scale=scale,
        implementation=implementation,
    )
    context_mesh = jax.sharding.get_abstract_mesh()
    manual = frozenset(context_mesh.manual_axes)
    spec = _spec(layout, query.shape[0], query.shape[2], key.shape[2], manual)
    if not manual:
        return jax.shard_map(kernel, mesh=layout.mesh, in_specs=(spec, spec, spec), out_specs=spec)(query, key, value)
    # Inside another map's manual region (a pipeline stage's loop): the rest of the mesh is this map's.
    compat.fix_nested_shard_map_residuals()
    free = frozenset(context_mesh.axis_names) - manual
    attend = jax.shard_map(kernel, mesh=context_mesh, in_specs=(spec, spec, spec), out_specs=spec, axis_names=free)
    return attend(query, key, value)


def _spec(layout: ContextLayout, batch: int, heads: int, kv_heads: int, manual: frozenset = frozenset()) -> P:
    """How the per-device blocks are cut: rows over the batch axes (where they divide), the sequence over
    `context`, heads over the head axis (where both head counts divide). Axes already `manual` (those of an
    enclosing map, over which the arrays here are this device's share) are left out."""
    batch_axes = tuple(axis for axis in layout.batch_axes if axis not in manual)
    rows = batch_axes if batch_axes and batch % layout.axis_size(batch_axes) == 0 else None
    head = layout.head_axis if layout.head_axis not in manual else None
    size = layout.axis_size(head)
    head = head if head is not None and heads % size == 0 and kv_heads % size == 0 else None
    return P(rows, CONTEXT_AXIS, head, None)


def _check(query, key, value, context_parallel) -> None:
    if context_parallel not in CONTEXT_PARALLEL_CHOICES:
        raise ValueError(
            f"`context_parallel` must be one of {CONTEXT_PARALLEL_CHOICES}. Received: context_parallel="
            f"{context_parallel!r}. Use 'ring' (least memory) or 'all_gather' (fewest, larger transfers)."
        )
    shapes = tuple(getattr(t, "shape", ()) for t in (query, key, value))
    if any(len(shape) != 4 for shape in shapes):
        raise ValueError(
            f"dot_product_attention takes (batch, seq, heads, head_dim) query, key and value. Received shapes {shapes}."
        )
    (b, _, h, d), (kb, _, kh, kd) = shapes[0], shapes[1]
    if shapes[2] != shapes[1] or kb != b or kd != d or h % kh:
        raise ValueError(
            "dot_product_attention needs key and value of one shape, the query's batch and head_dim, and query "
            f"heads a multiple of key heads. Received query {shapes[0]}, key {shapes[1]}, value {shapes[2]}."
        )


def _check_sequence(query, key, size: int, causal: bool, context_parallel: str) -> None:
    seq = query.shape[1]
    blocks = 2 * size if causal and context_parallel == "ring" else size
    if key.shape[1] != seq:
        raise ValueError(
            f"Context-parallel attention needs query and key of one sequence length. Received {seq} and "
            f"{key.shape[1]}. Attend across sequences with context_parallel=None."
        )
    if seq % blocks:
        why = "load-balanced causal ring attention cuts it in 2 x C chunks" if blocks != size else "C blocks"
        raise ValueError(
            f"A sequence of {seq} does not split over {CONTEXT_AXIS}={size} ({why}: a multiple of {blocks} is "
            f"needed). Pad the sequence to {-(-seq // blocks) * blocks}, or use a smaller '{CONTEXT_AXIS}' axis."
        )
