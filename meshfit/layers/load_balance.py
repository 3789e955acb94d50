"""Load-balanced causal layout: each device of a `context` axis holds chunk i and chunk 2C-1-i.

A sequence split in C contiguous blocks puts the late positions, which attend to
the most keys, on the last devices. Cut in 2C chunks instead, device i holding
chunks i and 2C-1-i, every device has the same causal work (as MaxText's
load-balanced attention and Striped Attention do). The batch stays in natural
order (device i holds chunks 2i and 2i+1): `to_balanced` moves the chunks over
the axis before attention and `from_balanced` moves the output back, so the model
and the loss see the natural order.

Chunk j of 2C goes to device j if j < C, else to device 2C-1-j. Device i's two
chunks, 2i and 2i+1, are one even and one odd: each is a permutation of the axis,
one `lax.ppermute` each.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def owner(chunk: int, size: int) -> int:
    """The device of a `size`-device axis that holds `chunk` (of 2 * size) in the balanced layout."""
    return chunk if chunk < size else 2 * size - 1 - chunk


def _moves(size: int, parity: int) -> list[tuple[int, int]]:
    """`(from, to)`: where device i's chunk 2i + parity goes."""
    return [(i, owner(2 * i + parity, size)) for i in range(size)]


def positions(axis: str, size: int, chunk: int) -> jax.Array:
    """The global positions of this device's 2 * `chunk` rows in the balanced layout."""
    i = lax.axis_index(axis)
    first = i * chunk + jnp.arange(chunk)
    second = (2 * size - 1 - i) * chunk + jnp.arange(chunk)
    return jnp.concatenate([first, second])


def to_balanced(x: jax.Array, axis: str, size: int) -> jax.Array:
    """This device's natural block of `x` (sequence on dimension 1) as its balanced block: chunks i, 2C-1-i."""
    half = x.shape[1] // 2
    even = lax.ppermute(x[:, :half], axis, _moves(size, 0))
    odd = lax.ppermute(x[:, half:], axis, _moves(size, 1))
    low_is_even = lax.axis_index(axis) % 2 == 0  # chunk i came as an even chunk when i is even
    low = jnp.where(low_is_even, even, odd)
    high = jnp.where(low_is_even, odd, even)
    return jnp.concatenate([low, high], axis=1)


def from_balanced(x: jax.Array, axis: str, size: int) -> jax.Array:
    """`to_balanced`'s inverse: this device's balanced block of `x` back as its natural block."""
    half = x.shape[1] // 2
    low, high = x[:, :half], x[:, half:]
    low_is_even = lax.axis_index(axis) % 2 == 0
    even = jnp.where(low_is_even, low, high)
    odd = jnp.where(low_is_even, high, low)
    back = lambda moves: [(dst, src) for src, dst in moves]  # noqa: E731
    first = lax.ppermute(even, axis, back(_moves(size, 0)))
    second = lax.ppermute(odd, axis, back(_moves(size, 1)))
    return jnp.concatenate([first, second], axis=1)
