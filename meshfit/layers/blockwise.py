"""Attention over one block of keys at a time, combined by an online softmax (as flash and ring attention do).

A `Partial` holds what a query has seen so far: the output not yet divided by
the softmax's denominator, the running maximum of the scores, and the running
denominator. Two partials over disjoint keys combine exactly (`combine`);
`finish` divides. The maximum is only a stabiliser (the result does not depend
on it), so it carries no gradient.

Queries are grouped by key head: `(batch, seq, kv_heads, group, head_dim)`,
keys and values `(batch, seq, kv_heads, head_dim)` (grouped-query attention
when `group > 1`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

#: A score that masks a key: finite, so a block whose keys are all masked for a query leaves no NaN behind.
MASKED = -1e30


class Partial(NamedTuple):
    """Attention of some queries over some keys, before normalisation.

    Attributes:
        out: the probability-weighted sum of values, `(batch, q, kv_heads, group, head_dim)`, float32.
        max: the largest score of each query, `(batch, kv_heads, group, q)`.
        total: the sum of `exp(score - max)` of each query, `(batch, kv_heads, group, q)`.
    """

    out: jax.Array
    max: jax.Array
    total: jax.Array


def group_heads(q: jax.Array, kv_heads: int) -> jax.Array:
    """`(batch, seq, heads, d)` queries as `(batch, seq, kv_heads, heads // kv_heads, d)`."""
    b, s, h, d = q.shape
    return q.reshape(b, s, kv_heads, h // kv_heads, d)


def block(q: jax.Array, k: jax.Array, v: jax.Array, scale: float, mask: jax.Array | None = None) -> Partial:
    """The partial attention of grouped queries `q` over one block of keys `k` and values `v`.

    `mask`, `(q, k)` booleans, says which query sees which key (None: all).
    """
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, preferred_element_type=jnp.float32) * scale
    if mask is not None:
        scores = jnp.where(mask, scores, MASKED)
    top = jax.lax.stop_gradient(jnp.max(scores, axis=-1))
    weights = jnp.exp(scores - top[..., None])
    if mask is not None:
        weights = jnp.where(mask, weights, 0.0)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", weights, v.astype(jnp.float32))
    return Partial(out, top, weights.sum(axis=-1))


def empty(q: jax.Array, head_dim: int) -> Partial:
    """The partial of grouped queries `q` that have seen no key yet (`combine`'s identity)."""
    b, s, h, g, _ = q.shape
    stats = jnp.zeros((b, h, g, s), jnp.float32)
    return Partial(jnp.zeros((b, s, h, g, head_dim), jnp.float32), stats + MASKED, stats)


def _per_query(stat: jax.Array) -> jax.Array:
    """`(batch, kv_heads, group, q)` as `(batch, q, kv_heads, group, 1)`, to scale an output."""
    return jnp.moveaxis(stat, -1, 1)[..., None]


def combine(a: Partial, b: Partial) -> Partial:
    """The partial of the same queries over the keys of `a` and of `b` together."""
    top = jnp.maximum(a.max, b.max)
    scale_a, scale_b = jnp.exp(a.max - top), jnp.exp(b.max - top)
    out = a.out * _per_query(scale_a) + b.out * _per_query(scale_b)
    return Partial(out, top, a.total * scale_a + b.total * scale_b)


def concat(parts: list[Partial]) -> Partial:
    """Partials of consecutive query blocks as one partial over all of them."""
    return Partial(
        jnp.concatenate([p.out for p in parts], axis=1),
        jnp.concatenate([p.max for p in parts], axis=-1),
        jnp.concatenate([p.total for p in parts], axis=-1),
    )


def finish(p: Partial, dtype) -> jax.Array:
    """The attention output, `(batch, q, heads, head_dim)` in `dtype`."""
    out = p.out / _per_query(p.total)
    b, s, h, g, d = out.shape
    return out.reshape(b, s, h * g, d).astype(dtype)
