"""Adam as Keras computes it, as an optax transformation: `get("adam")` takes Keras's steps, not near them.

optax's `adam` divides the bias-corrected first moment by
`sqrt(bias-corrected second moment) + eps`; Keras's folds both corrections
into the step size, `lr * sqrt(1 - b2^t) / (1 - b1^t)`, and adds `eps` to
the raw `sqrt(v)`. The two are the same update with `eps` scaled by
`sqrt(1 - b2^t)`: far apart in the first steps, where that factor is about
0.03, and 1e-4 apart in a fit's losses after a few epochs. A Keras program
ported to meshfit should get Keras's numbers, so "adam" and "adamw" are these.
`amsgrad` keeps the maximum of the raw second moment, as Keras does
(optax's `amsgrad` takes that of the bias-corrected one).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class ScaleByKerasAdamState(NamedTuple):
    """The step count and both moments (and, with `amsgrad`, the largest second moment seen)."""

    count: jax.Array
    mu: Any
    nu: Any
    nu_max: Any


def scale_by_keras_adam(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-7, amsgrad: bool = False
) -> optax.GradientTransformation:
    """Scales gradients to Keras's Adam direction: `m * sqrt(1 - b2^t) / (1 - b1^t) / (sqrt(v) + eps)`."""

    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return ScaleByKerasAdamState(
            jnp.zeros([], jnp.int32), zeros, jax.tree.map(jnp.zeros_like, params), zeros if amsgrad else None
        )

    def update(updates, state, params=None):
        del params
        mu = jax.tree.map(lambda g, m: m + (g - m) * (1 - b1), updates, state.mu)
        nu = jax.tree.map(lambda g, v: v + (jnp.square(g) - v) * (1 - b2), updates, state.nu)
        nu_max = jax.tree.map(jnp.maximum, state.nu_max, nu) if amsgrad else None
        count = optax.safe_increment(state.count)
        step = count.astype(jnp.float32)
        # In float32 whatever the moments' dtype: in bfloat16, 0.999 rounds to 1 and the step would be 0.
        alpha = jnp.sqrt(1 - jnp.float32(b2) ** step) / (1 - jnp.float32(b1) ** step)

        def direction(m, v):
            wide = m.astype(jnp.float32) * alpha / (jnp.sqrt(v.astype(jnp.float32)) + eps)
            return wide.astype(m.dtype)

        scaled = jax.tree.map(direction, mu, nu_max if amsgrad else nu)
        return scaled, ScaleByKerasAdamState(count, mu, nu, nu_max)

    return optax.GradientTransformation(init, update)


def adam(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-7,
    amsgrad: bool = False,
) -> optax.GradientTransformation:
    """Keras's `Adam` step: `param -= learning_rate * scale_by_keras_adam(...)`."""
    return optax.chain(scale_by_keras_adam(b1, b2, eps, amsgrad), optax.scale_by_learning_rate(learning_rate))


def adamw(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-7,
    weight_decay: float = 0.004,
    mask: Any = None,
    amsgrad: bool = False,
) -> optax.GradientTransformation:
    """Keras's `AdamW`: the Adam step plus `learning_rate * weight_decay * param`, decoupled from the moments."""
    return optax.chain(
        scale_by_keras_adam(b1, b2, eps, amsgrad),
        optax.add_decayed_weights(weight_decay, mask),
        optax.scale_by_learning_rate(learning_rate),
    )
