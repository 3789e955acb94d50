"""Module adapters: models built from a factory, created straight into their layout, equal to eager ones."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx

import meshfit as mf
from meshfit.cost.memory import live_bytes


class Embedder(nnx.Module):
    """Initializers XLA would fold differently inside one program (`normal(key) * 0.02`)."""

    def __init__(self, seed=0):
        rngs = nnx.Rngs(seed)
        self.embed = nnx.Embed(64, 256, embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
        self.norm = nnx.LayerNorm(256, rngs=rngs)
        self.up = nnx.Linear(256, 512, rngs=rngs)
        self.out = nnx.Linear(512, 64, rngs=rngs)

    def __call__(self, tokens):
        return self.out(nnx.gelu(self.up(self.norm(self.embed(tokens)))))


STRATEGIES = {
    "one_device": lambda: mf.strategies.OneDeviceStrategy(),
    "mirrored": lambda: mf.strategies.MirroredStrategy(),
    "fsdp8": lambda: mf.strategies.MeshStrategy(axes={"fsdp": 8}, min_shard_size=1024),
}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_factory_starts_bitwise_equal_to_the_eager_module(strategy):
    with STRATEGIES[strategy]().scope():
        from_factory = mf.Model(Embedder)
        eager = mf.Model(Embedder())
    for name, a, b in zip(from_factory.weight_names(), from_factory.get_weights(), eager.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=name)
    assert isinstance(from_factory.module, Embedder)
    tokens = np.arange(8, dtype=np.int32).reshape(2, 4)
    np.testing.assert_array_equal(np.asarray(from_factory.module(tokens)), np.asarray(eager.module(tokens)))


def test_a_factory_under_fsdp_is_never_whole_on_a_device():
    """The variables are created in one compiled function whose outputs have the layout's shardings."""
    with mf.strategies.MeshStrategy(axes={"fsdp": 8}, min_shard_size=1024).scope():
        model = mf.Model(Embedder)
    params = model.session.latest.params
    assert params["up"]["kernel"].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
    whole = live_bytes().whole
    sharded = {a.shape for a in jax.tree.leaves(params) if not a.sharding.is_fully_replicated}
    assert sharded and not sharded & set(whole)


@pytest.mark.slow
def test_a_factory_model_saved_under_fsdp_restores_with_a_factory(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 64, (64, 8)).astype(np.int32)
    with mf.strategies.MeshStrategy(axes={"fsdp": 8}, min_shard_size=1024).scope():
        model = mf.Model(Embedder)
        model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(tokens, tokens, batch_size=16, epochs=1, verbose=0)
        model.save(tmp_path / "model")
        restored = mf.load_model(tmp_path / "model", lambda: Embedder(seed=1))  # other initial values
    np.testing.assert_array_equal(model.predict(tokens, verbose=0), restored.predict(tokens, verbose=0))
    with mf.strategies.OneDeviceStrategy().scope():  # and onto another layout
        elsewhere = mf.load_model(tmp_path / "model", Embedder)
    np.testing.assert_allclose(
        model.predict(tokens, verbose=0), elsewhere.predict(tokens, verbose=0), rtol=1e-5, atol=1e-5
    )


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_the_users_module_holds_the_trained_weights_after_fit():
    x = np.random.default_rng(0).integers(0, 64, (32, 8)).astype(np.int32)
    module = Embedder()
    model = mf.Model(module)
    model.compile(optimizer="sgd", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, x, batch_size=16, epochs=1, verbose=0)
    np.testing.assert_array_equal(np.asarray(module.up.kernel[...]), model.params["up"]["kernel"])
    np.testing.assert_array_equal(np.asarray(module(x)), np.asarray(model.module(x)))


class NormedDropout(nnx.Module):
    """Every kind of state a module holds: parameters, batch statistics and an RNG stream."""

    def __init__(self, rngs):
        self.dense = nnx.Linear(8, 8, rngs=rngs)
        self.norm = nnx.BatchNorm(8, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(self.norm(self.dense(x))))


def test_the_users_module_holds_trained_statistics_and_rng_counts_after_fit():
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((32, 8)).astype(np.float32), rng.integers(0, 3, 32)
    module = NormedDropout(nnx.Rngs(0, dropout=1))
    count_before = int(module.drop.rngs.count[...])
    model = mf.Model(module)
    model.compile(optimizer="sgd", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    state = model.session.latest
    np.testing.assert_array_equal(np.asarray(module.dense.kernel[...]), state.params["dense"]["kernel"])
    stats = state.model_state["weights"]["norm"]
    np.testing.assert_array_equal(np.asarray(module.norm.mean[...]), stats["mean"])
    assert np.abs(np.asarray(module.norm.mean[...])).sum() > 0  # moved from its zeros by training
    assert int(module.drop.rngs.count[...]) == count_before + 8  # one draw a step: 2 epochs of 4 batches
    assert isinstance(module.drop.rngs.count, nnx.Variable)  # still the module's own variables, updated


def test_bad_factories_are_clear_errors():
    with pytest.raises(TypeError, match=r"called with no arguments.*requires \['rngs'\]"):
        mf.Model(lambda rngs: Embedder())
    with pytest.raises(TypeError, match="must return a flax.nnx.Module.*Received: int"):
        mf.Model(lambda: 3)

    def failing():
        raise RuntimeError("the factory's own error")

    with pytest.raises(RuntimeError, match="the factory's own error"):
        mf.Model(failing)


class LinenMLP(linen.Module):
    @linen.compact
    def __call__(self, x):
        x = linen.Dense(2048)(x)
        return linen.Dense(16)(linen.relu(x))


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (simulated on a CPU)")
def test_linen_variables_are_created_in_their_layout():
    x = jnp.ones((8, 512))
    with mf.strategies.MeshStrategy(axes={"fsdp": 8}).scope():
        model = mf.Model(LinenMLP(), sample_input=x)
    kernel = model.session.latest.params["Dense_0"]["kernel"]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
    whole = live_bytes().whole
    assert (512, 2048) not in whole
    reference = mf.Model(LinenMLP(), sample_input=x)
    np.testing.assert_array_equal(model.get_weights()[1], reference.get_weights()[1])


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_frozen_parameters_stay_bitwise_unchanged_without_optimizer_state(tmp_path):
    """`trainable=` an NNX filter: the rest gets no gradient, no optimizer state, no update."""
    from helpers import MLP, classification_data

    x, y = classification_data(n=64)
    head_only = nnx.All(nnx.Param, nnx.PathContains("out"))
    model = mf.Model(MLP(), trainable=head_only)
    model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = dict(zip(model.weight_names(), model.get_weights(), strict=True))
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    after = dict(zip(model.weight_names(), model.get_weights(), strict=True))
    assert model.weight_names() == ["out/bias", "out/kernel", "hidden/bias", "hidden/kernel"]  # trainable first
    for name in before:
        if "hidden" in name:
            np.testing.assert_array_equal(after[name], before[name], err_msg=name)
        else:
            assert not np.array_equal(after[name], before[name]), name
    moments = [a.shape for a in jax.tree.leaves(model.session.state.opt_state) if a.ndim > 0]
    assert sorted(moments) == sorted([(3,), (16, 3)] * 2)  # Adam's mu and nu for the head alone
    assert model.count_params() == 16 * 3 + 3
    rows = {line.split()[0]: line for line in model.summary(print_fn=None).splitlines() if "/" in line.split()[0]}
    assert " no " in next(v for k, v in rows.items() if k.endswith("hidden/kernel"))
    assert " yes " in next(v for k, v in rows.items() if k.endswith("out/kernel"))

    model.save(tmp_path / "model")
    restored = mf.load_model(tmp_path / "model", MLP(seed=1), trainable=head_only)
    for a, b in zip(model.get_weights(), restored.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(TypeError, match="multi_transform"):
        mf.Model(LinenMLP(), sample_input=jnp.ones((1, 4)), trainable=head_only)
