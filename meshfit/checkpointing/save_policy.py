"""When a saving callback saves: `save_freq` decided once, in the shape of Orbax's save-decision policies.

Orbax (`orbax.checkpoint.checkpoint_managers.save_decision_policy`) asks a
policy `should_save(step, previous_steps, *, context)` and combines policies
with `AnySavePolicy`. meshfit's policies have that shape, but their own
classes: Orbax's `FixedIntervalPolicy` saves when `step % interval == 0`,
while meshfit's step count can jump over a multiple (`steps_per_execution=K`
counts K batches at once; a resumed fit starts anywhere), so a save is due
when the count has passed a multiple since the last save, as Keras's
`ModelCheckpoint` counts batches. Both `ModelCheckpoint` and
`BackupAndRestore` decide through `from_save_freq`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@dataclasses.dataclass(frozen=True)
class DecisionContext:
    """Where in a fit a save is considered.

    Attributes:
        epoch_end: at the end of an epoch (after validation), not after a batch.
        reached_preemption: training stops now for a preemption (SIGTERM).
    """

    epoch_end: bool = False
    reached_preemption: bool = False


#: After a training batch: the context of `on_train_batch_end`.
AFTER_BATCH = DecisionContext()
#: At the end of an epoch: the context of `on_epoch_end`.
AT_EPOCH_END = DecisionContext(epoch_end=True)
#: At a preemption's stop: the context of `on_preemption`.
AT_PREEMPTION = DecisionContext(reached_preemption=True)


@runtime_checkable
class SaveDecisionPolicy(Protocol):
    """Decides whether to save now (Orbax's `SaveDecisionPolicy` interface, with step numbers as ints)."""

    def should_save(self, step: int, previous_steps: Sequence[int], *, context: DecisionContext) -> bool:
        """Whether to save at `step`.

        Args:
            step: batches trained so far, over all fits (`session.step`).
            previous_steps: the steps of the earlier saves, oldest first; the
                step a fit starts from counts as one (its state is saved or
                restored already).
            context: where in the fit the question is asked.
        """
        ...


@dataclasses.dataclass(frozen=True)
class StepIntervalPolicy:
    """Saves after the batch at which the step count passes a multiple of `interval` since the last save."""

    interval: int

    def should_save(self, step: int, previous_steps: Sequence[int], *, context: DecisionContext) -> bool:
        if context.epoch_end or context.reached_preemption:
            return False
        last = previous_steps[-1] if previous_steps else 0
        return step // self.interval > last // self.interval


@dataclasses.dataclass(frozen=True)
class EpochEndPolicy:
    """Saves at the end of every epoch."""

    def should_save(self, step: int, previous_steps: Sequence[int], *, context: DecisionContext) -> bool:
        del step, previous_steps
        return context.epoch_end


@dataclasses.dataclass(frozen=True)
class PreemptionPolicy:
    """Saves when training stops for a preemption (Orbax's `PreemptionCheckpointingPolicy`)."""

    def should_save(self, step: int, previous_steps: Sequence[int], *, context: DecisionContext) -> bool:
        del step, previous_steps
        return context.reached_preemption


@dataclasses.dataclass(frozen=True)
class AnySavePolicy:
    """Saves when any of `policies` would (Orbax's `AnySavePolicy`)."""

    policies: tuple[SaveDecisionPolicy, ...]

    def should_save(self, step: int, previous_steps: Sequence[int], *, context: DecisionContext) -> bool:
        return any(policy.should_save(step, previous_steps, context=context) for policy in self.policies)


def from_save_freq(save_freq: str | int) -> StepIntervalPolicy | EpochEndPolicy:
    """The policy of a callback's `save_freq`: "epoch", or a number of batches between saves.

    Raises:
        ValueError: `save_freq` is neither "epoch" nor a positive int.
    """
    if save_freq == "epoch":
        return EpochEndPolicy()
    if not isinstance(save_freq, int) or save_freq < 1:
        raise ValueError(f"`save_freq` must be 'epoch' or a positive int. Received: save_freq={save_freq!r}.")
    return StepIntervalPolicy(save_freq)
