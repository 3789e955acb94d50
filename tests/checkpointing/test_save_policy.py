"""meshfit.checkpointing.save_policy: `save_freq` decided once, for ModelCheckpoint and BackupAndRestore alike."""

import os

import numpy as np
import pytest
from helpers import MLP, classification_data

import meshfit as mf
from meshfit.checkpointing.save_policy import (
    AFTER_BATCH,
    AT_EPOCH_END,
    AT_PREEMPTION,
    AnySavePolicy,
    EpochEndPolicy,
    PreemptionPolicy,
    SaveDecisionPolicy,
    StepIntervalPolicy,
    from_save_freq,
)


def saves(policy, steps, start=0, context=AFTER_BATCH):
    """The steps at which `policy` saves along a fit that reaches `steps`, as the callbacks ask it."""
    last, saved = start, []
    for step in steps:
        if policy.should_save(step, (last,), context=context):
            saved.append(step)
            last = step
    return saved


def test_a_step_interval_saves_when_the_count_passes_a_multiple():
    policy = from_save_freq(3)
    assert policy == StepIntervalPolicy(3) and isinstance(policy, SaveDecisionPolicy)
    assert saves(policy, range(1, 13)) == [3, 6, 9, 12]
    assert saves(policy, range(2, 13, 2)) == [4, 6, 10, 12]  # steps_per_execution=2 jumps over 3 and 9
    assert saves(policy, range(8, 13), start=7) == [9, 12]  # a resumed fit counts from where it starts
    rng = np.random.default_rng(0)
    steps = np.cumsum(rng.integers(1, 5, 200)).tolist()
    last, expected = 0, []
    for step in steps:  # the rule both callbacks had before: `step // freq > last // freq`
        if step // 7 > last // 7:
            expected.append(step)
            last = step
    assert saves(from_save_freq(7), steps) == expected
    assert saves(policy, range(1, 13), context=AT_EPOCH_END) == []  # an epoch's end is no batch


def test_epoch_and_preemption_policies():
    assert from_save_freq("epoch") == EpochEndPolicy()
    assert saves(EpochEndPolicy(), [5], context=AT_EPOCH_END) == [5]
    assert saves(EpochEndPolicy(), [5]) == []
    backup = AnySavePolicy((StepIntervalPolicy(100), PreemptionPolicy()))
    assert saves(backup, [5], context=AT_PREEMPTION) == [5] and saves(backup, [5]) == []


@pytest.mark.parametrize("save_freq", [0, -1, "batch", 1.5, None])
def test_a_bad_save_freq_is_refused_by_both_callbacks(tmp_path, save_freq):
    message = f"`save_freq` must be 'epoch' or a positive int. Received: save_freq={save_freq!r}."
    with pytest.raises(ValueError, match=f"^{message.replace('(', '.').replace(')', '.')}$"):
        from_save_freq(save_freq)
    for callback in (mf.callbacks.ModelCheckpoint, mf.callbacks.BackupAndRestore):
        with pytest.raises(ValueError, match="`save_freq` must be 'epoch' or a positive int"):
            callback(tmp_path, save_freq=save_freq)


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_one_policy_serves_both_callbacks_at_the_same_steps(tmp_path):
    """With steps_per_execution=2 the count jumps by 2: both callbacks save after the same batches."""
    x, y = classification_data(n=96)
    model = mf.Model(MLP(), seed=3)
    model.compile(
        optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True), steps_per_execution=2
    )
    checkpoint = mf.callbacks.ModelCheckpoint(tmp_path / "ck", save_freq=3, save_weights_only=True)
    backup = mf.callbacks.BackupAndRestore(tmp_path / "b", save_freq=3, delete_checkpoint=False, max_to_keep=None)
    assert checkpoint.save_policy in backup.save_policy.policies
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[checkpoint, backup])

    def steps(directory):
        return sorted(int(p) for p in os.listdir(directory) if p.isdigit())

    assert steps(tmp_path / "ck") == steps(tmp_path / "b") == [4, 6, 10, 12]
