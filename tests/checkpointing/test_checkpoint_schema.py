"""checkpoint_schema: the trees it writes are the layouts meshfit has always written, and checkpoints
written in those layouts (by the code before the schema existed) load unchanged."""

import jax
import numpy as np
import pytest
from helpers import MLP, classification_data

import meshfit as mf
from meshfit.checkpointing import checkpoint_schema
from meshfit.checkpointing.checkpoint import CheckpointDir
from meshfit.checkpointing.checkpoint_schema import BACKUP, TRAINING, WEIGHTS, Backup


def trained(policy=None, compiled=True):
    x, y = classification_data(n=64)
    model = mf.Model(MLP(din=4, hidden=16, dout=3))
    if compiled:
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", dtype_policy=policy)
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    return model


# The trees as the code before the schema built them (saving.weights_tree / training_tree, BackupAndRestore._save).


def old_weights_tree(state):
    return {"weights": {"params": state.params, "model_state": state.model_state}}


def old_training_tree(state):
    tree = {"weights": {"params": state.params, "model_state": state.model_state}, "step": state.step}
    if state.opt_state is not None:
        tree["opt_state"] = state.opt_state
    if state.loss_scale is not None:
        tree["loss_scale"] = state.loss_scale
    return tree


def old_backup_meta(callbacks, history, epoch, arrays):
    """The JSON part of a backup of format 1: callbacks' state by "<index>:<class name>"."""
    return {
        "epoch": epoch,
        "step_in_epoch": 0,
        "data_origin": 0,
        "history": history,
        "history_epochs": list(range(epoch)),
        "callbacks": {
            f"{i}:{type(cb).__name__}": checkpoint_schema.split_arrays(cb.state_dict(), arrays)
            for i, cb in enumerate(callbacks)
        },
        "data": {},
        "format": 1,
        "array_specs": {k: [list(v.shape), str(v.dtype)] for k, v in arrays.items()},
    }


def same_leaves(new, old):
    assert jax.tree.structure(new) == jax.tree.structure(old)
    assert all(a is b for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(old), strict=True))


@pytest.mark.parametrize("policy", [None, "mixed_float16", "uncompiled"])
def test_the_trees_written_are_the_layouts_written_before(policy):
    model = trained(None if policy == "uncompiled" else policy, compiled=policy != "uncompiled")
    state = model.session.state
    same_leaves(WEIGHTS.tree(state), old_weights_tree(state))
    same_leaves(TRAINING.tree(state), old_training_tree(state))
    assert ("loss_scale" in TRAINING.tree(state)) == (policy == "mixed_float16")
    backup = Backup(state, 1, 0, 4, 0, {}, {"loss": [1.0]}, [0], {"EarlyStopping": {"best": np.arange(3)}})
    tree, meta = BACKUP.tree_and_meta(backup)
    same_leaves(tree["train"], state)
    np.testing.assert_array_equal(tree["arrays"]["a0"], np.arange(3))
    assert meta["callbacks"] == {"EarlyStopping": {"best": {"__array__": "a0"}}}
    assert meta["format"] == checkpoint_schema.BACKUP_FORMAT == 2


def test_a_restored_tree_goes_back_into_the_state():
    model = trained("mixed_float16")
    state = model.session.state
    blank = state._replace(
        params=jax.tree.map(jax.numpy.zeros_like, state.params), step=state.step * 0, loss_scale=state.loss_scale
    )
    back = TRAINING.restored(blank, {**old_training_tree(state), "loss_scale": dict(state.loss_scale._asdict())})
    same_leaves(back.params, state.params)
    assert back.step is state.step and back.loss_scale == state.loss_scale
    assert WEIGHTS.restored(blank, old_weights_tree(state)).step is blank.step  # weights only


def write(directory, kind, tree, meta, step=0):
    ckpt = CheckpointDir(str(directory), kind, max_to_keep=None)
    try:
        ckpt.save(step, tree, meta, wait=True)
    finally:
        ckpt.close()


def weights_equal(a, b):
    return all(np.array_equal(u, v) for u, v in zip(a.get_weights(), b.get_weights(), strict=True))


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_saved_weights_models_and_checkpoints_in_the_old_layouts_load(tmp_path):
    model = trained()
    state = model.session.state
    write(tmp_path / "w", "weights", old_weights_tree(state), {"format": 2})
    record = {"format": 2, "compile": model.get_compile_config(), "has_optimizer": True}
    write(tmp_path / "m", "model", old_training_tree(state), record)
    write(tmp_path / "c", "checkpoint", old_weights_tree(state), {"epoch": 0, "step": 4, "weights_only": True}, 1)
    write(tmp_path / "c", "checkpoint", old_training_tree(state), {"epoch": 1, "step": 8, "weights_only": False}, 2)
    for path in ("w", "m", "c"):
        other = mf.Model(MLP(din=4, hidden=16, dout=3, seed=5))
        assert not weights_equal(model, other)
        other.load_weights(tmp_path / path)
        assert weights_equal(model, other), path
    loaded = mf.load_model(tmp_path / "m", MLP(din=4, hidden=16, dout=3, seed=5))
    assert weights_equal(model, loaded) and int(loaded.session.state.step) == int(state.step) == 4
    for a, b in zip(jax.tree.leaves(loaded.session.state.opt_state), jax.tree.leaves(state.opt_state), strict=True):
        np.testing.assert_array_equal(a, b)


class Tagged(mf.callbacks.Callback):
    """A callback whose state is a tag and an array (a numpy array goes with a backup's arrays)."""

    def __init__(self, tag=None):
        super().__init__()
        self.tag, self.loaded = tag, None

    def state_dict(self):
        return {"tag": self.tag, "values": np.full(3, ord(self.tag), np.float32)} if self.tag else {}

    def load_state_dict(self, state):
        self.loaded = state


class Other(Tagged):
    pass


def test_an_old_backup_restores_callbacks_reordered_and_its_weights_load(tmp_path):
    """A backup of format 1 (callbacks by position and class) restores each callback's state by class and order,
    even with callbacks of different classes reordered, which the positional keys alone would have dropped."""
    model = trained()
    state = model.session.state
    saved_with = [Tagged("a"), Other("o"), Tagged("b")]
    arrays = {}
    meta = old_backup_meta(saved_with, {"loss": [1.0]}, epoch=1, arrays=arrays)
    write(tmp_path / "b", "backup", {"train": state, "arrays": {k: np.asarray(v) for k, v in arrays.items()}}, meta, 4)

    other = mf.Model(MLP(din=4, hidden=16, dout=3, seed=5))
    other.load_weights(tmp_path / "b")  # the weights alone, out of the training state
    assert weights_equal(model, other)

    resumed = mf.Model(MLP(din=4, hidden=16, dout=3, seed=5))
    resumed.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    now = [Other(), Tagged(), Tagged()]  # Other moved first
    x, y = classification_data(n=64)
    history = resumed.fit(
        x, y, batch_size=16, epochs=1, verbose=0, callbacks=[*now, mf.callbacks.BackupAndRestore(tmp_path / "b")]
    )
    assert [cb.loaded["tag"] for cb in now] == ["o", "a", "b"]
    np.testing.assert_array_equal(now[1].loaded["values"], np.full(3, ord("a"), np.float32))
    assert weights_equal(model, resumed) and history.history == {"loss": [1.0]}
