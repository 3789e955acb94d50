"""The training state: one pytree that flows through one donated, jitted step."""

from __future__ import annotations

import dis
import sys
from typing import Any, NamedTuple

import jax

_UNPACK = dis.opmap["UNPACK_SEQUENCE"]

#: Keras's JAX backend's `state` tuples, by length: train_step's, test_step's, predict_step's.
_KERAS_STATES = {
    4: "(trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables)",
    3: "(trainable_variables, non_trainable_variables, metrics_variables)",
    2: "(trainable_variables, non_trainable_variables)",
}


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
            (`meshfit.core.precision.LossScale`); None otherwise.
    """

    params: Any
    model_state: Any
    opt_state: Any
    metrics: Any
    step: jax.Array
    rng: jax.Array | None
    loss_scale: Any = None

    def __iter__(self):
        """The fields, as a tuple's; unpacking into another number of names (Keras's `state` tuples) raises
        a `ValueError` that shows the port, where Python would raise a bare "too many values to unpack"."""
        frame = sys._getframe(1)
        code = frame.f_code.co_code
        at = frame.f_lasti
        if at >= 0 and code[at] == _UNPACK and code[at + 1] != len(self._fields):
            keras = _KERAS_STATES.get(code[at + 1], f"{code[at + 1]} values")
            raise ValueError(
                f"`state` is a meshfit.TrainState with fields {self._fields}, not Keras's {keras}. "
                "Port: `params, model_state, opt_state, metrics = state.params, state.model_state, "
                "state.opt_state, state.metrics` (see docs/customizing_fit.md)."
            )
        return tuple.__iter__(self)
