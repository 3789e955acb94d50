"""The training state: one pytree that flows through one donated, jitted step."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax


class TrainState(NamedTuple):
    """Everything a training step reads and writes.

    Attributes:
        params: trainable variables (nested dict of arrays).
        model_state: non-trainable variables and RNG streams of the module.
        opt_state: the optax optimizer state.
        metrics: accumulators of the loss and each compiled metric (sums and counts).
        step: number of optimizer steps taken (int32 scalar).
        rng: raw PRNG key data (uint32), split each step, for modules that take
            an RNG argument (Linen dropout); None for NNX modules, which carry
            their RNG streams in `model_state`.
        loss_scale: the dynamic loss scale of the `mixed_float16` policy
            (`meshfit.precision.LossScale`); None otherwise.
    """

    params: Any
    model_state: Any
    opt_state: Any
    metrics: Any
    step: jax.Array
    rng: jax.Array | None
    loss_scale: Any = None
