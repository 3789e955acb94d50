"""ParameterServerStrategy on one host: sync equals MirroredStrategy, async learns as well, staleness bounded."""

import os
import sys

import jax
import numpy as np
import pytest
from helpers import MLP, assert_trees_close, classification_data

import meshfit as mf

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples"))


def train(strategy, x, y, batch_size, epochs=1, **fit_kwargs):
    with strategy.scope():
        model = mf.Model(MLP(din=4, hidden=32, dout=3))
        model.compile(
            optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"]
        )
    history = model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=0, **fit_kwargs)
    return model, history


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
@pytest.mark.parametrize("n, batch_size", [(320, 16), (290, 15)])  # 20 steps; the second with ragged batches
def test_sync_mode_equals_mirrored(n, batch_size):
    x, y = classification_data(n=n)
    devices = jax.devices()[:4]
    mirrored, h_mir = train(mf.strategies.MirroredStrategy(devices), x, y, batch_size)
    ps, h_ps = train(mf.strategies.ParameterServerStrategy(mode="sync", workers=devices), x, y, batch_size)
    assert int(ps.session.state.step) == int(mirrored.session.state.step) == 20
    assert_trees_close(mirrored.params, ps.params, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(h_mir.history["loss"], h_ps.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(h_mir.history["accuracy"], h_ps.history["accuracy"], rtol=1e-6)


def test_parameters_live_on_the_server_and_evaluation_uses_them():
    x, y = classification_data(n=64)
    strategy = mf.strategies.ParameterServerStrategy(workers=jax.devices()[:3])
    model, history = train(strategy, x, y, 8, epochs=2)
    for leaf in jax.tree.leaves(model.session.state):
        assert leaf.devices() == {strategy.server_device}
    assert int(model.session.state.step) == 16  # every batch applied once, whichever worker took it
    logits = np.asarray(model.module(x))
    expected = float((logits.argmax(-1) == y).mean())
    assert model.evaluate(x, y, verbose=0, return_dict=True)["accuracy"] == pytest.approx(expected)
    assert {"staleness", "max_staleness"} <= set(history.history)


@pytest.mark.slow
def test_max_staleness_bounds_applied_gradients():
    x, y = classification_data(n=96)
    strategy = mf.strategies.ParameterServerStrategy(
        workers=jax.devices()[:4], max_staleness=1, worker_delays={0: 0.01}
    )
    _, history = train(strategy, x, y, 8, epochs=2)
    assert max(history.history["max_staleness"]) <= 1
    unbounded = mf.strategies.ParameterServerStrategy(workers=jax.devices()[:4], worker_delays={0: 0.01})
    _, history = train(unbounded, x, y, 8, epochs=2)
    assert max(history.history["max_staleness"]) >= 2  # without the bound, stale gradients do arrive


@pytest.mark.slow
def test_async_reaches_sync_accuracy_on_digits():
    from digits import MLP as DigitsMLP
    from digits import load_data
    from flax import nnx

    x_train, x_test, y_train, y_test = load_data()

    def accuracy(mode):
        # A staleness bound keeps async convergence close to sync whatever the thread timing.
        bound = 2 if mode == "async" else None
        with mf.strategies.ParameterServerStrategy(mode=mode, workers=jax.devices()[:4], max_staleness=bound).scope():
            model = mf.Model(DigitsMLP(64, 128, 10, rngs=nnx.Rngs(0)))
            model.compile(
                optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"]
            )
        model.fit(x_train, y_train, batch_size=64, epochs=30, verbose=0)
        return model.evaluate(x_test, y_test, verbose=0, return_dict=True)["accuracy"]

    sync = accuracy("sync")
    # Async runs differ with thread timing; compare their mean (two runs) with the deterministic sync run.
    # On 360 test images an accuracy near 0.96 has a binomial standard error of about 0.01 (one image is
    # 0.003), and the difference of sync and a two-run mean about 0.0125. The limit was 0.01 and failed on
    # noise once (0.0125 short, on a VM with 20 % steal time); 0.02 is about 1.6 of those standard errors.
    runs = [accuracy("async") for _ in range(2)]
    assert sync > 0.95
    assert np.mean(runs) >= sync - 0.02, (sync, runs)


def test_bad_arguments():
    with pytest.raises(ValueError, match="`mode` must be one of"):
        mf.strategies.ParameterServerStrategy(mode="hogwild")
    with pytest.raises(ValueError, match="`max_staleness` must be a non-negative int"):
        mf.strategies.ParameterServerStrategy(max_staleness=-1)
    with pytest.raises(ValueError, match="`worker_timeout` must be a positive number of seconds. Received: 0"):
        mf.strategies.ParameterServerStrategy(worker_timeout=0)
    with pytest.raises(ValueError, match="`server_device` must be a device or a non-empty list"):
        mf.strategies.ParameterServerStrategy(server_device=[])
    with pytest.raises(ValueError, match="`server_device` lists a device twice"):
        mf.strategies.ParameterServerStrategy(server_device=[jax.devices()[0], jax.devices()[0]])
    x, y = classification_data(n=16)
    with mf.strategies.ParameterServerStrategy().scope():
        model = mf.Model(MLP())
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", steps_per_execution=4)
    with pytest.raises(ValueError, match="steps_per_execution=1"):
        model.fit(x, y, verbose=0)


def test_a_process_started_as_a_worker_refuses_to_run_the_training_script(monkeypatch):
    """Worker ranks run the worker module; a script reaching the constructor there was started the wrong way."""
    monkeypatch.setenv("MESHFIT_PS_ROLE", "worker")
    with pytest.raises(RuntimeError, match=r"meshfit launch --ps S --workers N script\.py"):
        mf.strategies.ParameterServerStrategy()


@pytest.mark.slow
def test_linen_module_with_dropout_trains_in_both_modes():
    from flax import linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            x = nn.Dropout(0.1, deterministic=not train)(nn.relu(nn.Dense(32)(x)))
            return nn.Dense(3)(x)

    x, y = classification_data(n=128)
    for mode in ("sync", "async"):
        with mf.strategies.ParameterServerStrategy(mode=mode, workers=jax.devices()[:2]).scope():
            model = mf.Model(Net(), sample_input=x[:1])
            model.compile(
                optimizer=mf.optimizers.get("adam", learning_rate=0.01),
                loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
        history = model.fit(x, y, batch_size=16, epochs=6, verbose=0)
        assert history.history["loss"][-1] < 0.7 * history.history["loss"][0], (mode, history.history["loss"])


def test_async_backups_hold_every_batch_handed_out(tmp_path):
    """A backup mid-epoch counts applied gradients, not batches handed out: it waits for those in flight."""
    import orbax.checkpoint as ocp

    from meshfit.checkpointing.checkpoint import STATE

    x, y = classification_data(n=96)
    strategy = mf.strategies.ParameterServerStrategy(workers=jax.devices()[:4], worker_delays={0: 0.02})
    backup = mf.callbacks.BackupAndRestore(tmp_path, save_freq=3, delete_checkpoint=False, max_to_keep=None)
    train(strategy, x, y, 8, epochs=1, callbacks=[backup])
    steps = sorted(int(p) for p in os.listdir(tmp_path) if p.isdigit())
    assert steps == [3, 6, 9, 12]
    for step in steps:
        saved = ocp.StandardCheckpointer().restore(tmp_path / str(step) / STATE)
        assert int(saved["train"]["step"]) == step  # optimizer updates applied == batches the data position counts


def per_device_bytes(tree) -> dict:
    usage: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            usage[shard.device] = usage.get(shard.device, 0) + shard.data.nbytes
    return usage


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_state_partitioned_over_server_devices(mode):
    """Variables split over 2 server devices (tf.distribute's variable partitioner); sync still equals Mirrored."""
    x, y = classification_data(n=320)
    servers = jax.devices()[6:8]
    strategy = mf.strategies.ParameterServerStrategy(
        mode=mode, workers=jax.devices()[:4], server_device=servers, min_shard_size=64
    )
    ps, _ = train(strategy, x, y, 16)
    assert int(ps.session.state.step) == 20
    kernel = ps.session.state.params["hidden"]["kernel"]  # (4, 32): split over its 32 columns
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "ps")
    assert {s.data.shape for s in kernel.addressable_shards} == {(4, 16)}
    bias = ps.session.state.params["out"]["bias"]  # 3 elements: whole on both
    assert bias.sharding.is_fully_replicated
    big = [leaf for leaf in jax.tree.leaves((ps.session.state.params, ps.session.state.opt_state)) if leaf.size >= 64]
    usage = per_device_bytes(big)
    assert set(usage) == set(servers) and len(set(usage.values())) == 1  # an even split
    assert sum(usage.values()) == sum(leaf.nbytes for leaf in big)  # each part on one server only
    if mode == "sync":
        mirrored, _ = train(mf.strategies.MirroredStrategy(jax.devices()[:4]), x, y, 16)
        assert_trees_close(mirrored.params, ps.params, rtol=1e-5, atol=1e-6)
    accuracy = ps.evaluate(x, y, verbose=0, return_dict=True)["accuracy"]
    assert accuracy > 0.5


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_gradient_accumulation_happens_on_the_server():
    """Sync mode, K=4 batches of 16: the server's optimizer applies the mean of 4 rounds, as one batch of 64."""
    x, y = classification_data(n=256)

    def fit(strategy, batch_size, **compile_args):
        with strategy.scope():
            model = mf.Model(MLP(din=4, hidden=32, dout=3))
            model.compile(
                optimizer=mf.optimizers.get("sgd", learning_rate=0.05, momentum=0.9), loss="mse", **compile_args
            )
        model.fit(x, np.eye(3, dtype=np.float32)[y], batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
        return model

    big = fit(mf.strategies.OneDeviceStrategy(), 64)
    ps = fit(
        mf.strategies.ParameterServerStrategy(mode="sync", workers=jax.devices()[:4]), 16, gradient_accumulation_steps=4
    )
    assert_trees_close(big.params, ps.params, rtol=1e-4, atol=1e-5)


def test_mixed_float16_is_refused_with_the_policy_that_works():
    with mf.strategies.ParameterServerStrategy(workers=jax.devices()[:2]).scope():
        model = mf.Model(MLP())
        with pytest.raises(ValueError, match="Use dtype_policy='mixed_bfloat16'"):
            model.compile(optimizer="adam", loss="mse", dtype_policy="mixed_float16")
        model.compile(optimizer="adam", loss="mse", dtype_policy="mixed_bfloat16")


def test_bad_ray_arguments_are_refused_before_ray_starts():
    with pytest.raises(ValueError, match=r'`cluster` must be None or "ray". Received: cluster=\'spark\''):
        mf.strategies.ParameterServerStrategy(cluster="spark")
    with pytest.raises(ValueError, match='pass cluster="ray" with them'):
        mf.strategies.ParameterServerStrategy(num_workers=2)
    with pytest.raises(ValueError, match="`num_workers` must be a positive int"):
        mf.strategies.ParameterServerStrategy(cluster="ray", num_workers=0)
    with pytest.raises(ValueError, match="`num_servers` must be a positive int"):
        mf.strategies.ParameterServerStrategy(cluster="ray", num_workers=2, num_servers=0)
    with pytest.raises(ValueError, match="leave `workers` and `server_device` unset"):
        mf.strategies.ParameterServerStrategy(cluster="ray", num_workers=2, workers=jax.devices()[:2])
    with pytest.raises(TypeError, match="`worker_options` must be a dict of Ray actor options"):
        mf.strategies.ParameterServerStrategy(cluster="ray", num_workers=2, worker_options=[("num_gpus", 1)])
    with pytest.raises(ValueError, match="`server_timeout` must be a positive number of seconds"):
        mf.strategies.ParameterServerStrategy(cluster="ray", num_workers=2, server_timeout=0)


def test_cluster_ray_without_ray_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` finds where Ray is not installed
    with pytest.raises(ImportError, match=r'pip install "meshfit\[ray\]"'):
        mf.strategies.ParameterServerStrategy(cluster="ray", num_workers=2)
