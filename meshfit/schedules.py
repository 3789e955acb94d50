"""Keras's learning-rate schedules (`meshfit.optimizers.schedules`): step -> learning rate, written down by `save`.

Each is callable as `schedule(step)`, so it works wherever an optax schedule
does (`meshfit.optimizers.get("adam", learning_rate=CosineDecay(1e-3, 1000))`,
`optax.adam(ExponentialDecay(...))`), inside the compiled step as well. Unlike
an optax schedule, a closure that JSON cannot hold, each has `get_config()`
holding exactly what `__init__` takes, so a model compiled with one saves and
reloads with nothing passed again (`meshfit.checkpointing.serialization`). Names, arguments,
defaults and values are Keras 3's (`keras.optimizers.schedules`); where optax
has the same curve, the schedule is optax's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

__all__ = [
    "LearningRateSchedule",
    "CosineDecay",
    "ExponentialDecay",
    "InverseTimeDecay",
    "PiecewiseConstantDecay",
    "PolynomialDecay",
]


class LearningRateSchedule:
    """A learning rate as a function of the optimizer step, with a config to rebuild it (Keras's base class).

    A subclass computes the rate in `call(step)` with `jax.numpy` (it runs
    traced, inside the step) and returns `__init__`'s arguments from
    `get_config`.
    """

    def __call__(self, step: jax.typing.ArrayLike) -> jax.Array:
        return jnp.asarray(self.call(jnp.asarray(step, jnp.float32)), jnp.float32)

    def call(self, step: jax.Array) -> jax.Array:
        raise NotImplementedError(f"{type(self).__name__} must implement `call(step)`.")

    def get_config(self) -> dict[str, Any]:
        raise NotImplementedError(f"{type(self).__name__} must implement `get_config()`.")

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> LearningRateSchedule:
        """The schedule `get_config` describes: `cls(**config)`."""
        return cls(**config)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.get_config() == self.get_config()

    def __hash__(self) -> int:
        return hash(type(self))


def _positive_steps(decay_steps: Any) -> None:
    """Keras's check of `decay_steps`, with what to do."""
    if decay_steps <= 0:
        raise ValueError(f"Argument `decay_steps` must be > 0. Received: decay_steps={decay_steps}")


class _RateDecay(LearningRateSchedule):
    """What ExponentialDecay and InverseTimeDecay share: Keras's arguments, their check and their config."""

    def __init__(
        self,
        initial_learning_rate: float,
        decay_steps: int,
        decay_rate: float,
        staircase: bool = False,
        name: str | None = None,
    ) -> None:
        _positive_steps(decay_steps)
        self.initial_learning_rate = initial_learning_rate
        self.decay_steps = decay_steps
        self.decay_rate = decay_rate
        self.staircase = staircase
        self.name = type(self).__name__ if name is None else name

    def get_config(self) -> dict[str, Any]:
        return {
            "initial_learning_rate": self.initial_learning_rate,
            "decay_steps": self.decay_steps,
            "decay_rate": self.decay_rate,
            "staircase": self.staircase,
            "name": self.name,
        }


class ExponentialDecay(_RateDecay):
    """`initial_learning_rate * decay_rate ** (step / decay_steps)` (the exponent floored with `staircase`).

    Args:
        initial_learning_rate: the rate at step 0.
        decay_steps: steps over which the rate is multiplied by `decay_rate` (> 0).
        decay_rate: the factor per `decay_steps`.
        staircase: decay at whole multiples of `decay_steps` only.
        name: the schedule's name.
    """

    def call(self, step: jax.Array) -> jax.Array:
        schedule = optax.exponential_decay(
            self.initial_learning_rate,
            transition_steps=self.decay_steps,
            decay_rate=self.decay_rate,
            staircase=self.staircase,
        )
        return schedule(step)


class PiecewiseConstantDecay(LearningRateSchedule):
    """`values[0]` while `step <= boundaries[0]`, `values[i]` while `boundaries[i-1] < step <= boundaries[i]`,
    `values[-1]` after `boundaries[-1]`.

    Args:
        boundaries: increasing steps where the rate changes.
        values: the rates, one more than `boundaries`.
        name: the schedule's name.
    """

    def __init__(self, boundaries: Sequence[int], values: Sequence[float], name: str = "PiecewiseConstant") -> None:
        if len(boundaries) != len(values) - 1:
            raise ValueError(
                "The length of boundaries should be 1 less than the length of values. Received: "
                f"boundaries={boundaries} of length {len(boundaries)}, and values={values} of length {len(values)}."
            )
        self.boundaries = list(boundaries)
        self.values = list(values)
        self.name = name

    def __call__(self, step: jax.typing.ArrayLike) -> jax.Array:
        # The step as it comes (an int, as the optimizer counts), so that boundaries past 2**24 stay exact.
        return self.call(jnp.asarray(step))

    def call(self, step: jax.Array) -> jax.Array:
        passed = jnp.sum(step > jnp.asarray(self.boundaries))  # the boundaries the step is past
        return jnp.asarray(self.values, jnp.float32)[passed]

    def get_config(self) -> dict[str, Any]:
        return {"boundaries": self.boundaries, "values": self.values, "name": self.name}


class PolynomialDecay(LearningRateSchedule):
    """From `initial_learning_rate` to `end_learning_rate` over `decay_steps` as `(1 - step / decay_steps) ** power`.

    Args:
        initial_learning_rate: the rate at step 0.
        decay_steps: steps to reach `end_learning_rate` (> 0).
        end_learning_rate: the rate from `decay_steps` on.
        power: the polynomial's power.
        cycle: decay again over the next multiple of `decay_steps` instead of
            staying at `end_learning_rate`.
        name: the schedule's name.
    """

    def __init__(
        self,
        initial_learning_rate: float,
        decay_steps: int,
        end_learning_rate: float = 0.0001,
        power: float = 1.0,
        cycle: bool = False,
        name: str = "PolynomialDecay",
    ) -> None:
        _positive_steps(decay_steps)
        self.initial_learning_rate = initial_learning_rate
        self.decay_steps = decay_steps
        self.end_learning_rate = end_learning_rate
        self.power = power
        self.cycle = cycle
        self.name = name
        self._schedule = optax.polynomial_schedule(
            initial_learning_rate, end_learning_rate, power=power, transition_steps=decay_steps
        )

    def call(self, step: jax.Array) -> jax.Array:
        if not self.cycle:
            return self._schedule(step)
        # The first multiple of decay_steps at or beyond the step (1 at step 0), as Keras cycles.
        span = self.decay_steps * jnp.where(step == 0, 1.0, jnp.ceil(step / self.decay_steps))
        fraction = 1.0 - step / span
        return (self.initial_learning_rate - self.end_learning_rate) * fraction**self.power + self.end_learning_rate

    def get_config(self) -> dict[str, Any]:
        return {
            "initial_learning_rate": self.initial_learning_rate,
            "decay_steps": self.decay_steps,
            "end_learning_rate": self.end_learning_rate,
            "power": self.power,
            "cycle": self.cycle,
            "name": self.name,
        }


class InverseTimeDecay(_RateDecay):
    """`initial_learning_rate / (1 + decay_rate * step / decay_steps)` (the quotient floored with `staircase`).

    Args:
        initial_learning_rate: the rate at step 0.
        decay_steps: how often the decay applies (> 0).
        decay_rate: the decay rate.
        staircase: decay at whole multiples of `decay_steps` only.
        name: the schedule's name.
    """

    def call(self, step: jax.Array) -> jax.Array:
        p = step / self.decay_steps
        if self.staircase:
            p = jnp.floor(p)
        return self.initial_learning_rate / (1.0 + self.decay_rate * p)


class CosineDecay(LearningRateSchedule):
    """A cosine decay over `decay_steps` to `alpha` times its start, after an optional linear warmup.

    Without `warmup_target`, the rate decays from `initial_learning_rate`.
    With it, the rate rises linearly from `initial_learning_rate` to
    `warmup_target` over `warmup_steps`, then decays from `warmup_target`.

    Args:
        initial_learning_rate: the rate at step 0.
        decay_steps: steps of the cosine decay (> 0).
        alpha: the final rate as a fraction of the decay's start.
        name: the schedule's name.
        warmup_target: the rate the warmup reaches (None: no warmup).
        warmup_steps: steps of the warmup.
    """

    def __init__(
        self,
        initial_learning_rate: float,
        decay_steps: int,
        alpha: float = 0.0,
        name: str = "CosineDecay",
        warmup_target: float | None = None,
        warmup_steps: int = 0,
    ) -> None:
        _positive_steps(decay_steps)
        self.initial_learning_rate = initial_learning_rate
        self.decay_steps = decay_steps
        self.alpha = alpha
        self.name = name
        self.warmup_target = warmup_target
        self.warmup_steps = warmup_steps
        if warmup_target is None:
            self._schedule: Callable = optax.cosine_decay_schedule(initial_learning_rate, decay_steps, alpha)
        else:
            warmup = optax.linear_schedule(initial_learning_rate, warmup_target, max(warmup_steps, 1))
            decay = optax.cosine_decay_schedule(warmup_target, decay_steps, alpha)
            self._schedule = optax.join_schedules([warmup, decay], [warmup_steps])

    def call(self, step: jax.Array) -> jax.Array:
        return self._schedule(step)

    def get_config(self) -> dict[str, Any]:
        return {
            "initial_learning_rate": self.initial_learning_rate,
            "decay_steps": self.decay_steps,
            "alpha": self.alpha,
            "name": self.name,
            "warmup_target": self.warmup_target,
            "warmup_steps": self.warmup_steps,
        }
