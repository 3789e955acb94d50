"""MeshStrategy: FSDP and tensor parallelism equal one device; layouts, memory, errors."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_trees_close, classification_data
from jax.sharding import PartitionSpec as P

import meshfit as mf
from meshfit.cost.memory import live_bytes


class Block(nnx.Module):
    """An MLP block wide enough for the default rule to shard (64 x 128 kernels)."""

    def __init__(self, din=64, hidden=128, dout=8, seed=0):
        rngs = nnx.Rngs(seed)
        self.up = nnx.Linear(din, hidden, rngs=rngs)
        self.down = nnx.Linear(hidden, hidden, rngs=rngs)
        self.head = nnx.Linear(hidden, dout, rngs=rngs)

    def __call__(self, x):
        h = nnx.relu(self.up(x))
        h = mf.strategies.constrain(h, ("data", "fsdp"), "tensor")
        return self.head(nnx.relu(self.down(h)))


MEGATRON = [
    (r"up/kernel", (None, "tensor")),
    (r"up/bias", ("tensor", None)),  # a trailing None is normalised
    (r"down/kernel", ("tensor", "fsdp")),
]


def train(strategy, steps=20, batch_size=16, spe=1):
    x, y = classification_data(n=steps * batch_size, din=64, classes=8)
    with strategy.scope():
        model = mf.Model(Block())
        model.compile(
            optimizer="adam",
            loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            steps_per_execution=spe,
        )
    history = model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0, shuffle=True)
    return model, history


@pytest.fixture(scope="module")
def reference():
    return train(mf.strategies.OneDeviceStrategy())


@pytest.mark.parametrize(
    "axes, rules",
    [
        ({"data": 1, "fsdp": 8, "tensor": 1}, ()),
        ({"data": 1, "fsdp": 4, "tensor": 2}, MEGATRON),
        ({"data": 2, "fsdp": 2, "tensor": 2}, MEGATRON),
    ],
)
@pytest.mark.slow
def test_mesh_equals_one_device_after_20_steps(reference, axes, rules):
    one, h_one = reference
    strategy = mf.strategies.MeshStrategy(axes=axes, rules=rules)
    model, history = train(strategy)
    assert int(model.session.state.step) == 20
    assert_trees_close(one.params, model.params, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(h_one.history["loss"], history.history["loss"], rtol=1e-5)
    assert model.session.executables.compilations()["staged"] == 1  # batches staged in blocks, one compile
    # The layout held through training: parameters and Adam moments keep their specs.
    specs = strategy.param_specs(model.params)
    for leaf, spec in zip(
        jax.tree.leaves(model.params), jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P)), strict=True
    ):
        assert leaf.sharding.spec == spec
    mu = optax.tree_utils.tree_get(model.session.state.opt_state, "mu")
    assert mu["up"]["kernel"].sharding.spec == specs["up"]["kernel"]


def test_rules_then_metadata_then_default():
    strategy = mf.strategies.MeshStrategy(
        axes={"data": 1, "fsdp": 4, "tensor": 2},
        rules=dict(MEGATRON[:1]),  # rules as a mapping (regex -> spec), as a LayoutMap's items are
        logical_axis_rules={"hidden": "tensor", "embed": "fsdp"},
    )

    class Tagged(nnx.Module):
        def __init__(self):
            rngs = nnx.Rngs(0)
            init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("hidden", "embed"))
            self.up = nnx.Linear(64, 128, rngs=rngs)  # rule
            self.tagged = nnx.Linear(128, 64, kernel_init=init, rngs=rngs)  # metadata
            self.plain = nnx.Linear(64, 256, rngs=rngs)  # default: largest divisible dim over fsdp
            self.small = nnx.Linear(4, 4, rngs=rngs)  # default: replicated

        def __call__(self, x):
            return x

    with strategy.scope():
        model = mf.Model(Tagged())
    specs = jax.tree.map(lambda a: a.sharding.spec, model.params)
    assert specs["up"]["kernel"] == P(None, "tensor")
    assert specs["tagged"]["kernel"] == P("tensor", "fsdp")
    assert specs["plain"]["kernel"] == P(None, "fsdp")
    assert specs["small"]["kernel"] == P()
    text = model.summary(print_fn=None)
    line = next(ln for ln in text.splitlines() if ln.startswith("plain/kernel"))
    assert "P(None, 'fsdp')" in line and "16.00 KB" in line  # 64*256*4 bytes over 4 fsdp shards
    assert "Total bytes per device" in text


def test_fsdp8_memory_per_device():
    strategy = mf.strategies.MeshStrategy(axes={"data": 1, "fsdp": 8, "tensor": 1})
    with strategy.scope():
        model = mf.Model(Block(din=256, hidden=512, dout=64))
        model.compile(optimizer="adam", loss="mse")
    state = (model.session.state.params, model.session.state.opt_state)
    total = sum(a.nbytes for a in jax.tree.leaves(state))
    per_device = {}
    for leaf in jax.tree.leaves(state):
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    assert len(per_device) == 8
    assert max(per_device.values()) <= 1.1 * total / 8, (max(per_device.values()), total / 8)


@pytest.mark.parametrize(
    "rules, pattern",
    [
        (
            [(r"up/kernel", ("fsdp", None))],
            r"'up/kernel' with shape \(64, 128\).*dimension 0 \(size 64\) over fsdp = 3",
        ),
        ([(r"up/kernel", ("model", None))], r"'up/kernel'.*mesh axis 'model'.*axes \('data', 'fsdp', 'tensor'\)"),
        ([(r"nonexistent", ("fsdp",))], r"rule 'nonexistent' matches no parameter"),
    ],
)
def test_bad_rules_are_clear_errors(rules, pattern):
    devices = jax.devices()[:6]
    strategy = mf.strategies.MeshStrategy(axes={"data": 1, "fsdp": 3, "tensor": 2}, rules=rules, devices=devices)
    with strategy.scope(), pytest.raises(ValueError, match=pattern):
        mf.Model(Block())


def test_bad_axes():
    with pytest.raises(ValueError, match="need 16 devices; there are 8"):
        mf.strategies.MeshStrategy(axes={"data": 2, "fsdp": 8})
    with pytest.raises(ValueError, match="At most one mesh axis may be -1"):
        mf.strategies.MeshStrategy(axes={"data": -1, "fsdp": -1})


def test_constrain_is_a_no_op_elsewhere():
    x = np.ones((4, 4), np.float32)
    assert mf.strategies.constrain(x, "data") is x


@pytest.mark.slow
@pytest.mark.processes
def test_mesh_under_launch_equals_single_process(two_process_job):
    """data=2 x fsdp=2 over 2 processes x 2 devices equals the same mesh in one process."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "workers"))
    from test_multi_worker_mirrored import in_process
    from train_data_parallel import mesh_strategy

    out = two_process_job.folder("mesh")  # the shared job (tests/strategies/conftest.py): --strategy mesh
    strategy = mesh_strategy(devices=jax.devices()[:4])
    model, history, evaluation, predictions = in_process(strategy)
    sharded = [leaf for leaf in jax.tree.leaves(model.params) if not leaf.sharding.is_fully_replicated]
    assert sharded, "the test model must have parameters sharded over fsdp"
    saved = np.load(out / "params.npz")
    for i, weight in enumerate(model.get_weights()):
        np.testing.assert_allclose(saved[f"arr_{i}"], weight, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(saved["predictions"], predictions, rtol=1e-5, atol=1e-6)


class Wide(nnx.Module):
    """Two 1024 x 2048 kernels: 16 MiB of parameters, 48 MiB with Adam's moments."""

    def __init__(self, seed=0):
        rngs = nnx.Rngs(seed)
        self.a = nnx.Linear(1024, 2048, rngs=rngs)
        self.b = nnx.Linear(2048, 1024, rngs=rngs)

    def __call__(self, x):
        return self.b(nnx.relu(self.a(x)))


def check_device0(model, what, before):
    """Device 0 holds about its eighth of the state, and no whole sharded parameter.

    `before`: `live_bytes()` before the model existed (arrays other tests left alive).
    """
    state_bytes = sum(a.nbytes for a in jax.tree.leaves(model.session.latest))
    ideal = state_bytes / 8
    live = live_bytes()
    held = live.total - before.total
    assert held <= 1.2 * ideal + 2 * 2**20, f"{what}: device 0 holds {held / 2**20:.2f} MiB, ideal {ideal / 2**20:.2f}"
    new_whole = list(live.whole)
    for shape in before.whole:
        if shape in new_whole:
            new_whole.remove(shape)
    sharded = {tuple(a.shape) for a in jax.tree.leaves(model.session.latest) if not a.sharding.is_fully_replicated}
    assert not sharded & {tuple(shape) for shape in new_whole}, f"{what}: whole copies of sharded parameters"
    return held, ideal


@pytest.mark.slow
@pytest.mark.parametrize("creation", ["factory", "eager"])
def test_fsdp8_device0_holds_its_eighth_after_creation_fit_and_restore(tmp_path, creation):
    """MLP 1024-2048-1024 with Adam under fsdp=8: no lingering whole or replicated copies on device 0."""
    x = np.random.default_rng(0).standard_normal((256, 1024)).astype(np.float32)
    strategy = mf.strategies.MeshStrategy(axes={"fsdp": 8})
    before = live_bytes()
    with strategy.scope():
        model = mf.Model(Wide if creation == "factory" else Wide())
        check_device0(model, "after Model()", before)
        model.compile(optimizer="adam", loss="mse")
        model.fit(x, x, batch_size=64, epochs=1, verbose=0)
    held, ideal = check_device0(model, "after fit", before)
    assert held <= 1.1 * ideal + 2**20  # the bar after fit: metrics, step and a batch block on top
    model.save(tmp_path / "saved")
    del model
    with strategy.scope():
        restored = mf.load_model(tmp_path / "saved", Wide if creation == "factory" else Wide())
    check_device0(restored, "after load_model", before)
    assert int(restored.session.state.step) == 4  # the optimizer state came back too
