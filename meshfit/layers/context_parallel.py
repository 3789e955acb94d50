"""Attention over a sequence split along a mesh axis, run per device inside `shard_map`.

Each function takes this device's queries, keys and values (its block of the
sequence, `(batch, seq / C, heads, head_dim)`) and returns its block of the
output; `axis` is the mesh axis the sequence is split over, `size` its length C.

* `all_gather_attention`: gathers every key and value (each device then holds
  the whole sequence's K and V) and attends its queries to them at once, with
  `jax.nn.dot_product_attention` (cuDNN's kernel when asked, on a GPU).
* `ring_attention`: passes K/V blocks around the axis with `lax.ppermute`, C - 1
  times, combining each block's partial attention by an online softmax; the next
  block's transfer is issued before the current block's compute, so XLA can
  overlap them. Under a causal mask the queries and keys are first put in the
  load-balanced layout (`load_balance`): the diagonal block is masked, and of
  every other block exactly half the work is needed, which a `lax.cond` picks
  (this device's queries against the earlier device's first chunk, or this
  device's second chunk against the later device's both).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from meshfit.layers import blockwise, load_balance


def all_gather_attention(
    q, k, v, *, axis: str, size: int, causal: bool, scale: float, implementation: str | None = None
) -> jax.Array:
    """This device's output block: its queries attending to the gathered keys and values, in one call of
    `jax.nn.dot_product_attention` (so `implementation="cudnn"` runs cuDNN's fused kernel on a GPU)."""
    keys = lax.all_gather(k, axis, axis=1, tiled=True)
    values = lax.all_gather(v, axis, axis=1, tiled=True)
    mask = None
    if causal:
        rows = q.shape[1]
        q_pos = lax.axis_index(axis) * rows + jnp.arange(rows)
        mask = (q_pos[:, None] >= jnp.arange(keys.shape[1])[None, :])[None, None]  # (1, 1, q, k)
    return jax.nn.dot_product_attention(q, keys, values, mask=mask, scale=scale, implementation=implementation)


def ring_attention(
    q, k, v, *, axis: str, size: int, causal: bool, scale: float, implementation: str | None = None
) -> jax.Array:
    """This device's output block: its queries attending to every device's K/V block as it passes by.

    The blocks are XLA's whatever `implementation` asks: combining them needs each block's log-sum-exp with
    its gradient, which cuDNN's kernel returns but does not differentiate (its backward drops that cotangent).
    """
    del implementation
    if causal:
        q, k, v = (load_balance.to_balanced(t, axis, size) for t in (q, k, v))
    grouped = blockwise.group_heads(q, k.shape[2])
    me = lax.axis_index(axis)
    chunk = q.shape[1] // 2
    shift = [(i, (i + 1) % size) for i in range(size)]
    kv = (k, v)
    seen = None
    for step in range(size):
        coming = lax.ppermute(kv, axis, shift) if step < size - 1 else None  # issued before this block's compute
        if step == 0:
            mask = None
            if causal:
                pos = load_balance.positions(axis, size, chunk)
                mask = pos[:, None] >= pos[None, :]
            part = blockwise.block(grouped, *kv, scale, mask)
        elif causal:
            source = (me - step) % size  # the device whose K/V block this is
            part = lax.cond(source < me, _earlier, _later, grouped, *kv, scale)
        else:
            part = blockwise.block(grouped, *kv, scale)
        seen = part if seen is None else blockwise.combine(seen, part)
        kv = coming
    out = blockwise.finish(seen, q.dtype)
    return load_balance.from_balanced(out, axis, size) if causal else out


def _earlier(q, k, v, scale) -> blockwise.Partial:
    """A K/V block from an earlier device: all of this device's queries see its first chunk, none its second."""
    half = k.shape[1] // 2
    return blockwise.block(q, k[:, :half], v[:, :half], scale)


def _later(q, k, v, scale) -> blockwise.Partial:
    """A K/V block from a later device: this device's second chunk sees all of it, its first chunk nothing."""
    half = q.shape[1] // 2
    first = blockwise.empty(q[:, :half], v.shape[-1])
    return blockwise.concat([first, blockwise.block(q[:, half:], k, v, scale)])


STRATEGIES = {"ring": ring_attention, "all_gather": all_gather_attention}
