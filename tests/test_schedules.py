"""meshfit.optimizers.schedules: Keras's numbers at every step, and a model compiled with one reloads as it was."""

import json
import math

import jax
import numpy as np
import optax
import pytest
from helpers import MLP, classification_data

import meshfit as mf

S = mf.optimizers.schedules
STEPS = [0, 1, 3, 5, 9, 10, 11, 17, 20, 25, 40]


# Keras 3's formulas (keras/src/optimizers/schedules/learning_rate_schedule.py), written out in plain Python.
def keras_exponential(step, initial, decay_steps, rate, staircase=False):
    p = step / decay_steps
    return initial * rate ** (math.floor(p) if staircase else p)


def keras_piecewise(step, boundaries, values):
    if step <= boundaries[0]:
        return values[0]
    if step > boundaries[-1]:
        return values[-1]
    ranges = zip(boundaries[:-1], boundaries[1:], values[1:-1], strict=True)
    return next(v for low, high, v in ranges if low < step <= high)


def keras_polynomial(step, initial, decay_steps, end=0.0001, power=1.0, cycle=False):
    if cycle:
        decay_steps = decay_steps * (1 if step == 0 else math.ceil(step / decay_steps))
    else:
        step = min(step, decay_steps)
    return (initial - end) * (1 - step / decay_steps) ** power + end


def keras_inverse_time(step, initial, decay_steps, rate, staircase=False):
    p = step / decay_steps
    return initial / (1 + rate * (math.floor(p) if staircase else p))


def keras_cosine(step, initial, decay_steps, alpha=0.0, warmup_target=None, warmup_steps=0):
    def decay(s, start):
        return start * ((1 - alpha) * 0.5 * (1 + math.cos(math.pi * s / decay_steps)) + alpha)

    if warmup_target is None:
        return decay(min(step, decay_steps), initial)
    step = min(step, decay_steps + warmup_steps)
    if step < warmup_steps:
        return (warmup_target - initial) * step / warmup_steps + initial
    return decay(step - warmup_steps, warmup_target)


CASES = {
    "exponential": (S.ExponentialDecay(0.1, 4, 0.5), lambda s: keras_exponential(s, 0.1, 4, 0.5)),
    "exponential_staircase": (
        S.ExponentialDecay(0.1, decay_steps=4, decay_rate=0.5, staircase=True),
        lambda s: keras_exponential(s, 0.1, 4, 0.5, staircase=True),
    ),
    "piecewise": (
        S.PiecewiseConstantDecay([5, 10, 20], [1.0, 0.5, 0.1, 0.01]),
        lambda s: keras_piecewise(s, [5, 10, 20], [1.0, 0.5, 0.1, 0.01]),
    ),
    "polynomial": (S.PolynomialDecay(0.1, 10), lambda s: keras_polynomial(s, 0.1, 10)),
    "polynomial_power_cycle": (
        S.PolynomialDecay(0.1, 10, end_learning_rate=0.01, power=0.5, cycle=True),
        lambda s: keras_polynomial(s, 0.1, 10, end=0.01, power=0.5, cycle=True),
    ),
    "inverse_time": (S.InverseTimeDecay(0.1, 5, 0.5), lambda s: keras_inverse_time(s, 0.1, 5, 0.5)),
    "inverse_time_staircase": (
        S.InverseTimeDecay(0.1, 5, 0.5, staircase=True),
        lambda s: keras_inverse_time(s, 0.1, 5, 0.5, staircase=True),
    ),
    "cosine": (S.CosineDecay(0.1, 20, alpha=0.1), lambda s: keras_cosine(s, 0.1, 20, alpha=0.1)),
    "cosine_warmup": (
        S.CosineDecay(0.0, 20, alpha=0.05, warmup_target=0.2, warmup_steps=10),
        lambda s: keras_cosine(s, 0.0, 20, alpha=0.05, warmup_target=0.2, warmup_steps=10),
    ),
    "cosine_warmup_from_nonzero": (
        S.CosineDecay(0.01, 15, warmup_target=0.1, warmup_steps=4),
        lambda s: keras_cosine(s, 0.01, 15, warmup_target=0.1, warmup_steps=4),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_values_are_keras_formulas_at_every_step_eager_and_jitted(case):
    schedule, keras = CASES[case]
    expected = np.array([keras(s) for s in STEPS], np.float32)
    eager = np.array([float(schedule(s)) for s in STEPS], np.float32)
    jitted = np.asarray(jax.jit(jax.vmap(schedule))(np.array(STEPS, np.int32)))
    np.testing.assert_allclose(eager, expected, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(jitted, expected, rtol=1e-6, atol=1e-8)
    assert jitted.dtype == np.float32


@pytest.mark.parametrize("case", sorted(CASES))
def test_config_is_keras_and_rebuilds_an_equal_schedule_through_json(case):
    schedule, _ = CASES[case]
    config = json.loads(json.dumps(schedule.get_config()))
    assert config["name"] == type(schedule).__name__.replace("ConstantDecay", "Constant")  # Keras's default names
    rebuilt = type(schedule).from_config(config)
    assert rebuilt == schedule and rebuilt is not schedule
    np.testing.assert_array_equal([rebuilt(s) for s in STEPS], [schedule(s) for s in STEPS])


def test_piecewise_boundaries_beyond_float32_precision_stay_exact():
    schedule = S.PiecewiseConstantDecay([2**24], [1.0, 0.5])  # 2**24 + 1 is 2**24 in float32
    assert float(schedule(np.int32(2**24))) == 1.0 and float(schedule(np.int32(2**24 + 1))) == 0.5


def test_keras_defaults_and_argument_checks():
    assert S.PolynomialDecay(0.1, 10).get_config() == {
        "initial_learning_rate": 0.1,
        "decay_steps": 10,
        "end_learning_rate": 0.0001,
        "power": 1.0,
        "cycle": False,
        "name": "PolynomialDecay",
    }
    assert S.CosineDecay(0.1, 10).get_config() == {
        "initial_learning_rate": 0.1,
        "decay_steps": 10,
        "alpha": 0.0,
        "name": "CosineDecay",
        "warmup_target": None,
        "warmup_steps": 0,
    }
    for cls in (S.CosineDecay, S.PolynomialDecay):
        with pytest.raises(ValueError, match=r"`decay_steps` must be > 0. Received: decay_steps=0"):
            cls(0.1, 0)
    with pytest.raises(ValueError, match="boundaries should be 1 less than the length of values"):
        S.PiecewiseConstantDecay([1, 2], [1.0, 0.5])


def test_a_schedule_drives_an_optax_optimizer_like_the_optax_schedule():
    params = {"w": np.ones(3, np.float32)}
    grads = {"w": np.array([1.0, -2.0, 0.5], np.float32)}
    ours = optax.sgd(S.ExponentialDecay(0.1, 2, 0.5))
    theirs = optax.sgd(optax.exponential_decay(0.1, 2, 0.5))
    a, b = ours.init(params), theirs.init(params)
    for _ in range(4):
        ua, a = ours.update(grads, a, params)
        ub, b = theirs.update(grads, b, params)
        np.testing.assert_allclose(ua["w"], ub["w"], rtol=1e-6)


RELOADED = ["exponential", "piecewise", "polynomial_power_cycle", "inverse_time", "cosine_warmup"]


@pytest.mark.slow
@pytest.mark.parametrize("case", RELOADED)
def test_a_model_compiled_with_a_schedule_reloads_and_evaluates_the_same_with_nothing_passed(tmp_path, case):
    schedule, _ = CASES[case]
    x, y = classification_data(n=64)
    model = mf.Model(MLP())
    model.compile(
        optimizer=mf.optimizers.get("sgd", learning_rate=schedule),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    logs = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    model.save(tmp_path / "m")
    record = json.loads((tmp_path / "m" / "0" / "meta" / "metadata").read_text())["compile"]["optimizer"]
    assert record["config"]["learning_rate"]["__class__"] == f"meshfit.schedules.{type(schedule).__name__}"
    loaded = mf.load_model(tmp_path / "m", MLP(seed=4))
    assert loaded.evaluate(x, y, batch_size=16, verbose=0, return_dict=True) == logs
    assert mf.optimizers.schedule_of(loaded.compile_settings.tx) == schedule
    assert loaded.optimizer.learning_rate == pytest.approx(float(schedule(8)))  # the step came back too
    history = model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0).history
    assert loaded.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0).history == history
