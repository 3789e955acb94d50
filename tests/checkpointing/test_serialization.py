"""meshfit.checkpointing.serialization: every built-in loss and metric, optimizers and nested settings survive JSON."""

import inspect
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import meshfit as mf
from meshfit import losses, metrics
from meshfit.checkpointing import serialization

L, M = losses, metrics

# Every public class with arguments other than its defaults, so that a config which dropped one
# would rebuild an object giving other numbers (or another name).
LOSS_CASES = {
    L.MeanSquaredError: dict(reduction="sum", name="l2"),
    L.MeanAbsoluteError: dict(reduction="mean", name="l1"),
    L.MeanAbsolutePercentageError: dict(reduction="sum", dtype="float16"),
    L.MeanSquaredLogarithmicError: dict(name="msle_x", reduction="none"),
    L.CosineSimilarity: dict(axis=1, reduction="sum"),
    L.Huber: dict(delta=0.3, name="h"),
    L.LogCosh: dict(reduction="sum", dtype="bfloat16"),
    L.Hinge: dict(reduction="sum"),
    L.SquaredHinge: dict(reduction="sum", name="sq"),
    L.CategoricalHinge: dict(reduction="sum"),
    L.KLDivergence: dict(reduction="sum"),
    L.Poisson: dict(reduction="sum", name="p"),
    L.BinaryCrossentropy: dict(from_logits=True, label_smoothing=0.1, axis=1),
    L.BinaryFocalCrossentropy: dict(
        apply_class_balancing=True, alpha=0.4, gamma=1.5, from_logits=True, label_smoothing=0.05, axis=1
    ),
    L.CategoricalCrossentropy: dict(from_logits=True, label_smoothing=0.2, reduction="sum"),
    L.CategoricalFocalCrossentropy: dict(alpha=0.3, gamma=1.0, from_logits=True, label_smoothing=0.1),
    L.SparseCategoricalCrossentropy: dict(from_logits=True, ignore_class=0, reduction="sum", name="sce"),
    L.LossFunctionWrapper: dict(fn=L.huber, name="wrapped", reduction="sum", delta=0.5),
}
METRIC_CASES = {
    M.Accuracy: dict(name="acc_x"),
    M.BinaryAccuracy: dict(threshold=0.3, name="ba"),
    M.CategoricalAccuracy: dict(name="ca"),
    M.SparseCategoricalAccuracy: dict(name="sca"),
    M.TopKCategoricalAccuracy: dict(k=2),
    M.SparseTopKCategoricalAccuracy: dict(k=3, name="top3"),
    M.MeanSquaredError: dict(name="m2"),
    M.MeanAbsoluteError: dict(name="m1"),
    M.MeanAbsolutePercentageError: dict(dtype="float16"),
    M.MeanSquaredLogarithmicError: dict(name="msle"),
    M.RootMeanSquaredError: dict(name="rmse"),
    M.CosineSimilarity: dict(axis=1),
    M.LogCoshError: dict(name="lc"),
    M.Hinge: dict(name="h"),
    M.SquaredHinge: dict(name="sh"),
    M.CategoricalHinge: dict(name="ch"),
    M.KLDivergence: dict(name="kl"),
    M.Poisson: dict(name="p"),
    M.BinaryCrossentropy: dict(from_logits=True, label_smoothing=0.1),
    M.CategoricalCrossentropy: dict(from_logits=True, label_smoothing=0.2, axis=-1, name="cce"),
    M.SparseCategoricalCrossentropy: dict(from_logits=True, ignore_class=1),
    M.TruePositives: dict(thresholds=0.3),
    M.FalsePositives: dict(thresholds=0.6, name="fp"),
    M.TrueNegatives: dict(thresholds=0.2),
    M.FalseNegatives: dict(thresholds=0.7),
    M.Precision: dict(top_k=2),  # no threshold: every top-k prediction is positive
    M.Recall: dict(thresholds=0.4, class_id=1),
    M.AUC: dict(
        num_thresholds=50,
        curve="PR",
        summation_method="majoring",
        multi_label=True,
        num_labels=4,
        label_weights=[1.0, 2.0, 0.5, 3.0],
        from_logits=True,
    ),
    M.Mean: dict(name="avg"),
    M.Sum: dict(name="total"),
    M.MeanMetricWrapper: dict(fn=M.binary_accuracy, name="wrapped", threshold=0.7),
    M.FBetaScore: dict(average="macro", beta=2.0, threshold=0.4, name="f2"),
    M.F1Score: dict(average="weighted"),
    M.R2Score: dict(class_aggregation=None, num_regressors=2),
}
CASES = [(cls, kwargs) for cls, kwargs in {**LOSS_CASES, **METRIC_CASES}.items()] + [
    (M.AUC, dict(thresholds=np.array([0.7, 0.2, 0.4], np.float32), name="auc_given")),
    (M.Precision, dict(thresholds=0.3, class_id=2)),
]
CASE_IDS = [f"{cls.__module__.split('.')[-1]}.{cls.__name__}" for cls, _ in CASES]


def inputs(cls):
    """Random (y_true, y_pred) the class takes: integer labels for sparse ones, values for Mean and Sum."""
    rng = np.random.default_rng(0)
    y_pred = rng.uniform(0.05, 0.95, (8, 4)).astype(np.float32)
    if "Sparse" in cls.__name__:
        return rng.integers(0, 4, (8,)).astype(np.int32), y_pred
    return np.eye(4, dtype=np.float32)[rng.integers(0, 4, 8)], y_pred


def outputs(obj, y_true, y_pred, weights):
    if isinstance(obj, L.Loss):
        return obj(y_true, y_pred, sample_weight=weights)
    if isinstance(obj, (M.Sum, M.Mean)) and not isinstance(obj, (M.MeanMetricWrapper, M.RootMeanSquaredError)):
        return obj.compute(obj.update(obj.init(), y_pred, weights))
    obj.build(y_true, y_pred)  # what compile does with the first batch (F-beta, R^2 learn their classes)
    return obj.compute(obj.update(obj.init(), y_true, y_pred, weights))


def test_every_public_loss_metric_and_schedule_class_is_registered_and_covered():
    public = {
        value
        for module in (losses, metrics)
        for name, value in vars(module).items()
        if isinstance(value, type)
        and issubclass(value, (L.Loss, M.Metric))
        and value.__module__ == module.__name__
        and not name.startswith("_")
    } - {L.Loss, M.Metric}
    schedules = {getattr(mf.optimizers.schedules, name) for name in mf.optimizers.schedules.__all__}
    schedules -= {mf.optimizers.schedules.LearningRateSchedule}
    assert set(serialization.CLASSES.values()) == public | schedules  # tests/test_schedules.py covers schedules
    assert {cls for cls, _ in CASES} == public  # a new class needs a case here


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
@pytest.mark.parametrize("cls,kwargs", CASES, ids=CASE_IDS)
def test_get_config_rebuilds_an_equal_object_through_json(cls, kwargs):
    obj = cls(**kwargs)
    config = obj.get_config()
    # get_config holds exactly what __init__ takes (beyond **kwargs, which a wrapper passes to its fn).
    params = inspect.signature(cls.__init__).parameters
    named = {p for p, v in params.items() if p != "self" and v.kind is not v.VAR_KEYWORD}
    assert named <= set(config)
    if not any(v.kind is v.VAR_KEYWORD for v in params.values()):
        assert set(config) == named
    record = json.loads(json.dumps(serialization.serialize(obj)))
    assert record[serialization.CLASS] == f"{cls.__module__}.{cls.__name__}"
    rebuilt = serialization.deserialize(record)
    assert type(rebuilt) is cls and rebuilt is not obj
    assert rebuilt.name == obj.name and rebuilt.dtype == obj.dtype
    assert serialization.serialize(rebuilt) == record
    assert record != serialization.serialize(cls(**({"fn": kwargs["fn"]} if "fn" in kwargs else {})))
    y_true, y_pred = inputs(cls)
    weights = np.linspace(0.0, 1.0, 8, dtype=np.float32)
    before, after = outputs(obj, y_true, y_pred, weights), outputs(rebuilt, y_true, y_pred, weights)
    assert np.asarray(before).dtype == np.asarray(after).dtype
    np.testing.assert_array_equal(np.asarray(before), np.asarray(after))


def test_names_numbers_and_nested_structures_round_trip_keeping_dicts_and_lists():
    settings = {
        "loss": {"cls": L.SparseCategoricalCrossentropy(from_logits=True), "reg": "mse"},
        "loss_weights": {"cls": 1.0, "reg": 0.5},
        "metrics": {"cls": ["accuracy"], "reg": (M.MeanAbsoluteError(), None, [np.float32(2.5)])},
        "classes_and_functions": [M.AUC, L.huber, M.sparse_top_k_categorical_accuracy],
    }
    record = json.loads(json.dumps(serialization.serialize(settings)))
    assert serialization.unsaved(record) == []
    back = serialization.deserialize(record)
    assert back["loss"]["reg"] == "mse" and back["loss_weights"] == {"cls": 1.0, "reg": 0.5}
    assert isinstance(back["loss"]["cls"], L.SparseCategoricalCrossentropy) and back["loss"]["cls"].from_logits
    assert back["metrics"]["cls"] == ["accuracy"]
    reg = back["metrics"]["reg"]
    assert isinstance(reg, list) and reg[1:] == [None, [2.5]]  # the tuple comes back a list, as JSON has no tuples
    assert isinstance(reg[0], M.MeanAbsoluteError)
    assert back["classes_and_functions"] == [M.AUC, L.huber, M.sparse_top_k_categorical_accuracy]


def my_loss(y_true, y_pred):
    return jnp.mean(jnp.square(y_true - y_pred), axis=-1)


class MyMetric(M.Mean):
    pass


@pytest.mark.parametrize(
    "obj,described",
    [
        (my_loss, "my_loss"),
        (L.LossFunctionWrapper(my_loss), "LossFunctionWrapper(name='my_loss')"),  # a built-in class, custom inside
        (MyMetric(name="mine"), "MyMetric(name='mine')"),  # a subclass of a built-in is the user's code
        (lambda y_true, y_pred: y_pred, "<lambda>"),
        ({1: "mse"}, "a dict with keys ['1']"),  # JSON would turn the key into a string
    ],
)
def test_what_cannot_be_saved_is_recorded_by_description_and_refused_on_load(obj, described):
    record = json.loads(json.dumps(serialization.serialize(["mae", obj])))
    assert record[0] == "mae" and serialization.unsaved(record) == [described]
    with pytest.raises(ValueError, match="could not be saved"):
        serialization.deserialize(record)


def test_an_unknown_class_name_is_refused_clearly():
    with pytest.raises(ValueError, match=r"Received: 'meshfit.losses.Gone', which this version of meshfit"):
        serialization.deserialize({serialization.CLASS: "meshfit.losses.Gone", "config": {}})


def test_an_optimizer_from_get_round_trips_its_name_and_arguments():
    tx = mf.optimizers.get("Adam", learning_rate=np.float32(3e-3), b1=0.8, clipnorm=1.0)
    record = json.loads(json.dumps(serialization.serialize_optimizer(tx)))
    assert record["name"] == "adam"
    assert record["config"] == {
        "learning_rate": float(np.float32(3e-3)),
        "b1": 0.8,
        "b2": 0.999,
        "eps": 1e-7,
        "clipnorm": 1.0,
    }
    rebuilt = serialization.deserialize_optimizer(record)
    params = {"w": jnp.arange(4.0)}
    grads = {"w": jnp.array([3.0, -1.0, 0.5, 2.0])}

    def two_steps(t):
        state = t.init(params)
        for _ in range(2):
            updates, state = t.update(grads, state, params)
        return updates, state

    for a, b in zip(jax.tree.leaves(two_steps(tx)), jax.tree.leaves(two_steps(rebuilt)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert serialization.serialize_optimizer("sgd") == "sgd" == serialization.deserialize_optimizer("sgd")


def test_optimizers_that_are_code_are_custom():
    schedule = optax.cosine_decay_schedule(1e-3, 100)
    with_schedule = mf.optimizers.get("sgd", learning_rate=schedule)
    assert mf.optimizers.schedule_of(with_schedule) is schedule  # the recipe still answers schedule_of
    assert serialization.unsaved(serialization.serialize_optimizer(with_schedule)) == [
        "'sgd' with learning_rate=cosine_decay_schedule.<locals>.schedule"
    ]
    assert serialization.unsaved(serialization.serialize_optimizer(optax.adam(1e-3))) == ["an optax transformation"]
    wrapped = optax.chain(optax.clip(1.0), mf.optimizers.get("adam"))  # not what get built
    assert serialization.unsaved(serialization.serialize_optimizer(wrapped)) == ["an optax transformation"]
