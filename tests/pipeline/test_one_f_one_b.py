"""The fused 1F1B train step: equal to one device, GPipe's bubble without recomputed forwards, errors first."""

import importlib.util
import os

import jax
import numpy as np
import pytest
from custom_models import OwnGradients
from flax import nnx
from helpers import PIPELINE_TOLERANCE, ResidualBlock, assert_trees_close, classification_data

import meshfit as mf
from meshfit.pipeline import Stages

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_pipeline.py")


class Head(nnx.Module):
    """Stages first, then a norm and a Dense head: the tail the last stage runs per microbatch."""

    def __init__(self, layers=8, tail=None):
        rngs = nnx.Rngs(0)
        self.body = Stages(ResidualBlock, layers, rngs=rngs)
        self.norm = (tail or nnx.LayerNorm)(16, rngs=rngs)
        self.head = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.head(self.norm(self.body(x)))


class TwoStacks(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0)
        self.first = Stages(ResidualBlock, 4, rngs=rngs)
        self.second = Stages(ResidualBlock, 4, rngs=rngs)

    def __call__(self, x):
        return self.second(self.first(x))


class Guarded(nnx.Module):
    """A forward pass that catches every exception around its stack (and then skips it): the 1f1b step's split
    of the module must reach no user code as an exception."""

    def __init__(self):
        rngs = nnx.Rngs(0)
        self.body = Stages(ResidualBlock, 8, rngs=rngs)
        self.head = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        try:
            h = self.body(x)
        except Exception:  # noqa: BLE001 - the point of the test
            h = x
        return self.head(h)


class Twice(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0)
        self.body = Stages(ResidualBlock, 4, rngs=rngs)

    def __call__(self, x):
        return self.body(self.body(x))


def one_f_one_b(microbatches=4):
    pipeline = mf.strategies.Pipeline(microbatches=microbatches, schedule="1f1b")
    return mf.strategies.MeshStrategy(axes={"stage": 4, "data": 2}, pipeline=pipeline)


def compiled(strategy, module=Head, loss=None):
    with strategy.scope():
        model = mf.Model(module)
        model.compile(optimizer="adam", loss=loss or mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.slow
def test_sample_weights_and_a_partial_last_batch_train_as_on_one_device():
    x, y = classification_data(n=56, din=16, classes=4)  # batches of 16: the last holds 8 real rows
    weights = np.random.default_rng(1).uniform(0.1, 2.0, size=len(x)).astype(np.float32)
    runs = []
    for strategy in (mf.strategies.OneDeviceStrategy(), one_f_one_b()):
        model = compiled(strategy)
        history = model.fit(x, y, sample_weight=weights, batch_size=16, epochs=2, verbose=0, shuffle=False)
        runs.append((model, history))
    (one, h_one), (piped, h_piped) = runs
    assert int(piped.session.state.step) == 8
    assert_trees_close(one.params, piped.params, **PIPELINE_TOLERANCE)
    np.testing.assert_allclose(h_one.history["loss"], h_piped.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(one.predict(x, verbose=0), piped.predict(x, verbose=0), rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_the_step_runs_gpipes_work_and_no_recomputed_forward():
    """Matmul work per device of the compiled train step (read as benchmarks/bench_pipeline.py reads it):
    1f1b's equals GPipe's, whose idle share is the bubble (P - 1) / (M + P - 1)."""
    spec = importlib.util.spec_from_file_location("bench_pipeline", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    x, y = classification_data(n=64, din=16, classes=4)
    work = {}
    for schedule in ("gpipe", "1f1b"):
        pipeline = mf.strategies.Pipeline(microbatches=16, schedule=schedule)
        model = compiled(mf.strategies.MeshStrategy(axes={"stage": 4, "data": 2}, pipeline=pipeline))
        model.step_report(x, y)  # builds the model for this batch shape
        with model.strategy.scope():
            work[schedule] = bench.matmul_flops(model.session.train_step_jaxpr(), 8)
    assert work["1f1b"] == pytest.approx(work["gpipe"], rel=0.05), work


def test_a_loss_returning_a_scalar_is_refused_before_any_step():
    def mean_error(y_true, y_pred):
        return jax.numpy.mean((y_pred[:, 0] - y_true) ** 2)

    model = compiled(one_f_one_b(), loss=mean_error)
    x, y = classification_data(n=16, din=16, classes=4)
    with pytest.raises(ValueError, match=r"1f1b schedule computes the loss per microbatch.*returning a scalar"):
        model.fit(x, y.astype(np.float32), batch_size=16, epochs=1, verbose=0)
    assert int(model.session.state.step) == 0


def test_a_tail_that_updates_module_state_is_refused_before_any_step():
    model = compiled(one_f_one_b(), module=lambda: Head(tail=nnx.BatchNorm))
    x, y = classification_data(n=16, din=16, classes=4)
    with pytest.raises(ValueError, match=r"must not update module state"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert int(model.session.state.step) == 0


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_a_module_with_two_stacks_is_refused():
    model = compiled(one_f_one_b(), module=TwoStacks, loss="mse")
    x = classification_data(n=16, din=16, classes=4)[0]
    with pytest.raises(ValueError, match=r"pipelines one Stages stack\. Received a module holding 2"):
        model.fit(x, x, batch_size=16, epochs=1, verbose=0)


@pytest.mark.slow
def test_a_stack_called_inside_try_except_trains_as_on_one_device():
    x, y = classification_data(n=32, din=16, classes=4)
    models = [compiled(strategy, module=Guarded) for strategy in (mf.strategies.OneDeviceStrategy(), one_f_one_b())]
    histories = [model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False) for model in models]
    one, piped = models
    assert int(piped.session.state.step) == 2
    assert_trees_close(one.params, piped.params, **PIPELINE_TOLERANCE)
    np.testing.assert_allclose(histories[0].history["loss"], histories[1].history["loss"], rtol=1e-5)


def test_a_stack_called_twice_in_one_forward_pass_is_refused():
    model = compiled(one_f_one_b(), module=Twice, loss="mse")
    x = classification_data(n=16, din=16, classes=4)[0]
    with pytest.raises(ValueError, match=r"pipelines one Stages call per forward pass"):
        model.fit(x, x, batch_size=16, epochs=1, verbose=0)


@pytest.mark.slow
def test_a_custom_train_step_differentiates_the_gpipe_loop_as_on_one_device():
    """A `Model` subclass's own `train_step` is handed back by the strategy as it is (no built-in objective to
    replace): its `jax.value_and_grad` runs through `Stages`' GPipe loop, to one device's numbers."""
    x, y = classification_data(n=32, din=16, classes=4)
    models = []
    for strategy in (mf.strategies.OneDeviceStrategy(), one_f_one_b()):
        with strategy.scope():
            model = OwnGradients(Head)
            model.compile(optimizer="adam")
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
        models.append(model)
    assert models[1].strategy.step_functions(models[1].session.steps) is models[1].session.steps
    assert_trees_close(models[0].params, models[1].params, **PIPELINE_TOLERANCE)
