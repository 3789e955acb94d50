"""The explicit data-parallel step (`reduction="explicit"`): meshfit's own psum, compression, module state."""

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import MLP, assert_trees_close, classification_data

import meshfit as mf

S = mf.strategies


def train(strategy, x, y, batch_size=16, epochs=1, spe=1, loss=None, optimizer="adam", module=None, **compile_kw):
    with strategy.scope():
        model = mf.Model(module or MLP(din=x.shape[1], hidden=32, dout=3))
        model.compile(
            optimizer=optimizer,
            loss=loss or mf.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            steps_per_execution=spe,
            **compile_kw,
        )
        history = model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=0, shuffle=False)
    return model, history.history


def param_bytes(model):
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(model.params))


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
@pytest.mark.parametrize(
    "n, batch_size, spe, compile_kw",
    [
        (320, 16, 1, {}),  # every batch divides by 8
        (290, 15, 1, {}),  # 15 rows padded to 16; a last batch of 5 rows on 8 replicas
        (320, 16, 4, {}),  # 4 steps per execution: the shard_map inside the scan
        (320, 16, 1, {"gradient_accumulation_steps": 2}),
    ],
)
def test_explicit_equals_one_device(n, batch_size, spe, compile_kw):
    x, y = classification_data(n=n)
    one, h_one = train(S.OneDeviceStrategy(), x, y, batch_size, spe=spe, **compile_kw)
    explicit, h_exp = train(S.MirroredStrategy(reduction="explicit"), x, y, batch_size, spe=spe, **compile_kw)
    assert explicit.strategy.reduction == "explicit"
    assert_trees_close(one.params, explicit.params, rtol=1e-5, atol=1e-6)
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(h_one[key], h_exp[key], rtol=1e-5)


@pytest.mark.parametrize("reduction", ["sum", "mean_with_sample_weight"])
def test_explicit_equals_one_device_for_every_loss_reduction(reduction):
    """A sum has no divisor to add over replicas; a weighted mean divides by the weights of all of them."""
    x, y = classification_data(n=96)
    weights = np.linspace(0.1, 2.0, 96).astype(np.float32)
    loss = mf.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)
    runs = []
    for strategy in (S.OneDeviceStrategy(), S.MirroredStrategy(reduction="explicit")):
        with strategy.scope():
            model = mf.Model(MLP(din=4, hidden=32, dout=3))
            model.compile(optimizer="sgd", loss=loss)
            history = model.fit(x, y, sample_weight=weights, batch_size=12, epochs=1, verbose=0, shuffle=False)
        runs.append((model, history.history))
    assert_trees_close(runs[0][0].params, runs[1][0].params, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(runs[0][1]["loss"], runs[1][1]["loss"], rtol=1e-5)


@pytest.mark.slow
def test_explicit_all_reduce_moves_the_parameter_bytes():
    x, y = classification_data(n=64)
    model, _ = train(S.MirroredStrategy(reduction="explicit"), x, y)
    report = model.step_report()
    params = param_bytes(model)
    # The gradients, plus a few scalars: the loss total and divisor, metric sums and counts.
    assert params <= report.collectives["all-reduce"] <= 1.05 * params
    assert report.lowered_collectives["all-reduce"] == report.collectives["all-reduce"]  # written by meshfit
    assert set(report.collectives) == {"all-reduce"}
    auto, _ = train(S.MirroredStrategy(), x, y)
    assert auto.step_report().lowered_collectives == {}  # GSPMD adds its all-reduce while compiling
    assert params <= auto.step_report().collectives["all-reduce"] <= 1.05 * params


@pytest.mark.slow
def test_bf16_compression_halves_the_all_reduce_and_stays_within_bf16_tolerance():
    x, y = classification_data(n=320)
    one, _ = train(S.OneDeviceStrategy(), x, y)
    plain, _ = train(S.MirroredStrategy(reduction="explicit"), x, y)
    compressed, _ = train(S.MirroredStrategy(gradient_compression="bf16"), x, y)
    assert compressed.strategy.reduction == "explicit"
    difference = max(
        float(np.max(np.abs(a - b))) for a, b in zip(plain.get_weights(), compressed.get_weights(), strict=True)
    )
    assert difference > 1e-6  # the gradients really crossed in bf16
    assert_trees_close(one.params, compressed.params, rtol=2e-2, atol=2e-2)

    report = compressed.step_report()
    params = param_bytes(compressed)
    lowered = report.lowered_collectives["all-reduce"]
    assert 0.5 * params <= lowered <= 0.5 * params + 64  # bf16 gradients, float32 scalars
    if jax.default_backend() == "cpu":  # XLA:CPU reduces bf16 in float32: the compiled program moves f32
        assert report.collectives["all-reduce"] > lowered and report.widened_collectives == ["all-reduce"]
    else:
        assert report.collectives["all-reduce"] == lowered
    assert "widened" in compressed.summary(print_fn=None) or jax.default_backend() != "cpu"


@pytest.mark.slow
def test_fp16_compression_cannot_overflow():
    """Gradients far beyond float16's range (65504) are scaled down before the all-reduce and back after."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 4)).astype(np.float32)
    y = (1e5 * rng.standard_normal((64, 3))).astype(np.float32)  # mean squared error gradients around 1e5
    sgd = mf.optimizers.get("sgd", learning_rate=1e-6)
    initial = mf.Model(MLP(din=4, hidden=32, dout=3)).get_weights()
    one, h_one = train(S.OneDeviceStrategy(), x, y, batch_size=64, loss="mse", optimizer=sgd)
    fp16, h_fp16 = train(
        S.MirroredStrategy(gradient_compression="fp16"), x, y, batch_size=64, loss="mse", optimizer=sgd
    )
    np.testing.assert_allclose(h_one["loss"], h_fp16["loss"], rtol=1e-5)
    for before, want, got in zip(initial, one.get_weights(), fp16.get_weights(), strict=True):
        assert np.isfinite(got).all()
        assert np.max(np.abs(want - before)) > 1e-3  # one step of lr 1e-6 on gradients around 1e5
        np.testing.assert_allclose(got - before, want - before, rtol=2e-3, atol=1e-3 * np.max(np.abs(want - before)))
    assert fp16.step_report().lowered_collectives["all-reduce"] <= 0.5 * param_bytes(fp16) + 64


@pytest.mark.slow
def test_explicit_mixed_float16_skips_non_finite_steps_and_learns():
    """The loss scale's overflow check sees the reduced gradients: overflowing steps are skipped, not applied.

    (Where float16 overflows depends on how rows are split: a replica's backward pass sums
    fewer rows than one device's, so the scales of the two runs need not agree step by step.)
    """
    x, y = classification_data(n=128)
    one, h_one = train(S.OneDeviceStrategy(), x, y, epochs=3, dtype_policy="mixed_float16")
    explicit, h_exp = train(
        S.MirroredStrategy(gradient_compression="fp16"), x, y, epochs=3, dtype_policy="mixed_float16"
    )
    scale = explicit.session.state.loss_scale
    assert float(scale.scale) < 2.0**15  # it overflowed at the initial scale and halved instead of updating
    assert all(np.isfinite(w).all() and w.dtype == np.float32 for w in explicit.get_weights())
    assert h_exp["loss"][-1] < h_exp["loss"][0]
    np.testing.assert_allclose(h_exp["loss"], h_one["loss"], rtol=2e-2)


class Normalized(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0)
        self.dense = nnx.Linear(4, 8, rngs=rngs)
        self.norm = nnx.BatchNorm(8, momentum=0.5, rngs=rngs)
        self.out = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(self.norm(self.dense(x)))


@pytest.mark.slow
def test_batch_statistics_are_averaged_over_replicas():
    """Each replica normalises with its rows' statistics; after the step every replica keeps their mean.

    The mean of the replicas' means is the batch mean, as on one device; the mean of
    their variances leaves out the spread between replicas, so it differs.
    """
    x, y = classification_data(n=64)
    one, _ = train(S.OneDeviceStrategy(), x, y, batch_size=64, module=Normalized(), optimizer="sgd")
    explicit, _ = train(
        S.MirroredStrategy(reduction="explicit"), x, y, batch_size=64, module=Normalized(), optimizer="sgd"
    )
    stats = {
        name: w for name, w in zip(explicit.weight_names(), explicit.get_weights(), strict=True) if "norm/" in name
    }
    one_stats = {name: w for name, w in zip(one.weight_names(), one.get_weights(), strict=True) if "norm/" in name}
    for leaf in jax.tree.leaves(explicit.session.state.model_state):
        assert leaf.sharding.is_fully_replicated
    dense = Normalized().dense  # the same initial weights (the same seed)
    kernel, bias = np.asarray(dense.kernel[...]), np.asarray(dense.bias[...])
    hidden = (x @ kernel + bias).reshape(8, 8, 8)  # replica, row, feature
    expected_mean = 0.5 * hidden.mean(axis=(0, 1))  # momentum 0.5 from zeros
    expected_var = 0.5 + 0.5 * hidden.var(axis=1).mean(axis=0)  # from ones; per-replica variances averaged
    np.testing.assert_allclose(stats["norm/mean"], expected_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats["norm/var"], expected_var, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(one_stats["norm/mean"], expected_mean, rtol=1e-5, atol=1e-6)
    assert not np.allclose(one_stats["norm/var"], expected_var, rtol=1e-3)


def test_options_are_checked():
    with pytest.raises(ValueError, match=r"Unknown gradient_compression 'int8'.*\['bf16', 'fp16'\]"):
        S.MirroredStrategy(gradient_compression="int8")
    with pytest.raises(ValueError, match="Unknown reduction 'ring'"):
        S.MirroredStrategy(reduction="ring")
    with pytest.raises(ValueError, match="reduction='explicit'"):
        S.MirroredStrategy(reduction="auto", gradient_compression="bf16")
    for strategy in (S.OneDeviceStrategy, S.MeshStrategy):
        with pytest.raises(TypeError, match="gradient_compression"):
            strategy(gradient_compression="bf16")
    assert "gradient_compression='fp16'" in repr(S.MirroredStrategy(gradient_compression="fp16"))


@pytest.mark.slow
def test_bf16_compression_reaches_the_same_digits_accuracy():
    """scikit-learn's digits, an MLP, 8 replicas: compressed gradients learn as well as float32 ones (±1 %)."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = (x / 16.0).astype(np.float32), y.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(x))
    train_rows, test_rows = order[:1400], order[1400:]
    accuracy = {}
    for compression in (None, "bf16"):
        with S.MirroredStrategy(reduction="explicit", gradient_compression=compression).scope():
            model = mf.Model(MLP(din=64, hidden=128, dout=10))
            model.compile(
                optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"]
            )
        model.fit(x[train_rows], y[train_rows], batch_size=64, epochs=8, verbose=0)
        accuracy[compression] = model.evaluate(x[test_rows], y[test_rows], verbose=0, return_dict=True)["accuracy"]
    assert accuracy[None] > 0.93
    assert abs(accuracy["bf16"] - accuracy[None]) <= 0.01, accuracy
