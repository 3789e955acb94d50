"""Tests for meshfit.metrics: closed forms, Keras parity, padding, accumulation."""

import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import MLP, classification_data

import meshfit as mf
from meshfit import losses, metrics

# Keras, an optional test dependency imported by the `keras` fixture, needs JAX.
os.environ.setdefault("KERAS_BACKEND", "jax")

RTOL = 1e-5
ATOL = 1e-6


def close(a, b, rtol=RTOL, atol=ATOL, err_msg=""):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol, err_msg=err_msg)


def evaluate_all(thunks):
    """Runs many small computations in one `jax.jit` (one compilation, fast)."""
    return jax.tree.map(np.asarray, jax.jit(lambda: {k: f() for k, f in thunks.items()})())


def run(metric, batches):
    """`compute` after `update` on each `(y_true, y_pred, sample_weight)` batch."""
    state = metric.init()
    for batch in batches:
        state = metric.update(state, *batch)
    return metric.compute(state)


def run_values(metric, batches):
    """Same as `run` for `Mean`/`Sum`, whose batches are `(values, sample_weight)`."""
    state = metric.init()
    for values, weight in batches:
        state = metric.update(state, values, weight)
    return metric.compute(state)


# ---------------------------------------------------------------------------
# Closed-form values on tiny inputs (mostly Keras's documented examples).
# ---------------------------------------------------------------------------

CLOSED_FORM = [
    ("accuracy", metrics.Accuracy(), [[1], [2], [3], [4]], [[0], [2], [3], [4]], None, 0.75),
    ("accuracy_weighted", metrics.Accuracy(), [[1], [2], [3], [4]], [[0], [2], [3], [4]], [1, 1, 0, 0], 0.5),
    ("binary_accuracy", metrics.BinaryAccuracy(), [[1], [1], [0], [0]], [[0.98], [1], [0], [0.6]], None, 0.75),
    (
        "categorical_accuracy",
        metrics.CategoricalAccuracy(),
        [[0, 0, 1], [0, 1, 0]],
        [[0.1, 0.9, 0.8], [0.05, 0.95, 0]],
        None,
        0.5,
    ),
    (
        "categorical_accuracy_weighted",
        metrics.CategoricalAccuracy(),
        [[0, 0, 1], [0, 1, 0]],
        [[0.1, 0.9, 0.8], [0.05, 0.95, 0]],
        [0.7, 0.3],
        0.3,
    ),
    (
        "sparse_categorical_accuracy",
        metrics.SparseCategoricalAccuracy(),
        [[2], [1]],
        [[0.1, 0.6, 0.3], [0.05, 0.95, 0]],
        None,
        0.5,
    ),
    (
        "top_k",
        metrics.TopKCategoricalAccuracy(k=1),
        [[0, 0, 1], [0, 1, 0]],
        [[0.1, 0.9, 0.8], [0.05, 0.95, 0]],
        None,
        0.5,
    ),
    (
        "sparse_top_k",
        metrics.SparseTopKCategoricalAccuracy(k=2),
        [2, 1],
        [[0.1, 0.9, 0.8], [0.05, 0.15, 0.8]],
        None,
        1.0,
    ),
    ("mse", metrics.MeanSquaredError(), [[0, 1], [0, 0]], [[1, 1], [0, 0]], None, 0.25),
    ("mae", metrics.MeanAbsoluteError(), [[0, 1], [0, 0]], [[1, 1], [2, 0]], None, 0.75),
    ("rmse", metrics.RootMeanSquaredError(), [[0, 1], [0, 0]], [[1, 1], [0, 0]], None, 0.5),
    ("mape", metrics.MeanAbsolutePercentageError(), [[2.0], [4.0]], [[1.0], [5.0]], None, 37.5),
    ("cosine", metrics.CosineSimilarity(), [[0, 1], [1, 1]], [[1, 0], [1, 1]], None, 0.5),
    ("sce_logits", metrics.SparseCategoricalCrossentropy(from_logits=True), [0], [[0.0, 0.0]], None, np.log(2.0)),
    ("precision", metrics.Precision(), [0, 1, 1, 1], [1, 0, 1, 1], None, 2 / 3),
    ("precision_weighted", metrics.Precision(), [0, 1, 1, 1], [1, 0, 1, 1], [0, 0, 1, 0], 1.0),
    ("recall", metrics.Recall(), [0, 1, 1, 1], [1, 0, 1, 1], None, 2 / 3),
    ("true_positives", metrics.TruePositives(), [0, 1, 1, 1], [1, 0, 1, 1], None, 2.0),
    ("false_negatives", metrics.FalseNegatives(), [0, 1, 1, 1], [1, 0, 1, 1], None, 1.0),
    ("auc", metrics.AUC(), [0, 0, 1, 1], [0, 0.5, 0.3, 0.9], None, 0.75),
]


@pytest.fixture(scope="module")
def closed_form_values():
    return evaluate_all(
        {
            case_id: functools.partial(
                run,
                metric,
                [(jnp.array(t), jnp.array(p, jnp.float32), None if w is None else jnp.array(w, jnp.float32))],
            )
            for case_id, metric, t, p, w, _ in CLOSED_FORM
        }
    )


@pytest.mark.parametrize("case_id,expected", [(c[0], c[-1]) for c in CLOSED_FORM], ids=[c[0] for c in CLOSED_FORM])
def test_closed_form(closed_form_values, case_id, expected):
    close(closed_form_values[case_id], expected)


def test_mean_and_sum_closed_form():
    values = jnp.array([1.0, 3.0, 5.0, 7.0])
    weights = jnp.array([1.0, 1.0, 0.0, 0.0])
    got = evaluate_all(
        {
            "mean": lambda: run_values(metrics.Mean(), [(values, None)]),
            "mean_weighted": lambda: run_values(metrics.Mean(), [(values, weights)]),
            "mean_rows": lambda: run_values(metrics.Mean(), [(values.reshape(2, 2), None)]),
            "sum": lambda: run_values(metrics.Sum(), [(values, None)]),
            "sum_weighted": lambda: run_values(metrics.Sum(), [(values, weights)]),
            "empty": lambda: metrics.Mean().compute(metrics.Mean().init()),
        }
    )
    close(got["mean"], 4.0)
    close(got["mean_weighted"], 2.0)
    close(got["mean_rows"], 4.0)
    close(got["sum"], 16.0)
    close(got["sum_weighted"], 4.0)
    close(got["empty"], 0.0)  # no samples yet: 0, not NaN


def test_eager_keras_style_interface():
    m = metrics.Mean()
    m.update_state([1.0, 3.0])
    m.update_state(jnp.array([5.0, 7.0]), sample_weight=jnp.array([1.0, 0.0]))
    close(m.result(), 3.0)
    m.reset_state()
    close(m.result(), 0.0)
    acc = metrics.SparseCategoricalAccuracy()
    acc.update_state(jnp.array([1, 0]), jnp.array([[0.2, 0.8], [0.3, 0.7]]))
    close(acc.result(), 0.5)
    close(acc(jnp.array([0]), jnp.array([[0.9, 0.1]])), 2 / 3)


# ---------------------------------------------------------------------------
# Agreement with Keras on random inputs (two batches, with and without weights).
# ---------------------------------------------------------------------------

B1, B2, C = 6, 4, 4  # two batches of different sizes: a full and a partial one


def _data(kind, n, rng):
    if kind == "regression":
        return rng.normal(size=(n, C)), rng.normal(size=(n, C))
    if kind == "positive":
        return rng.uniform(0.1, 3, (n, C)), rng.uniform(0.1, 3, (n, C))
    if kind == "exact":
        y = rng.integers(0, 3, (n, 1))
        return y, np.where(rng.uniform(size=(n, 1)) < 0.5, y, rng.integers(0, 3, (n, 1)))
    if kind == "binary_probs":
        return rng.integers(0, 2, (n, C)).astype("float32"), rng.uniform(0, 1, (n, C))
    if kind == "binary_column":
        return rng.integers(0, 2, (n,)).astype("float32"), rng.uniform(0, 1, (n, 1))
    if kind == "binary_logits":
        return rng.integers(0, 2, (n, C)).astype("float32"), 3 * rng.normal(size=(n, C))
    if kind == "onehot_probs":
        probs = rng.uniform(0.01, 1, (n, C))
        return np.eye(C)[rng.integers(0, C, n)], probs / probs.sum(-1, keepdims=True)
    if kind == "onehot_logits":
        return np.eye(C)[rng.integers(0, C, n)], 3 * rng.normal(size=(n, C))
    if kind == "distributions":
        p, q = rng.uniform(0.01, 1, (2, n, C))
        return p / p.sum(-1, keepdims=True), q / q.sum(-1, keepdims=True)
    if kind == "sparse_probs":
        probs = rng.uniform(0.01, 1, (n, C))
        return rng.integers(0, C, (n,)), probs / probs.sum(-1, keepdims=True)
    if kind == "sparse_logits":
        return rng.integers(0, C, (n, 1)), 3 * rng.normal(size=(n, C))
    if kind == "values":
        return rng.normal(size=(n, 3)), None
    raise ValueError(kind)


def _with_edge_values(kind, y_true, y_pred):
    """Puts values where Keras's epsilon clipping matters into the first rows."""
    if kind in ("binary_probs", "onehot_probs", "distributions", "sparse_probs"):
        y_pred[0, 0], y_pred[1, 0] = 0.0, 1.0
    if kind == "regression":
        y_true[0, 0] = 0.0
    if kind == "positive":
        y_pred[0, 0] = 0.0
    return y_true, y_pred


def _f32(x):
    return x.astype("float32") if x is not None and x.dtype == np.float64 else x


def _batches(kind, seed, weighted):
    """Two batches `(y_true, y_pred, sample_weight)` of sizes B1 and B2."""
    rng = np.random.default_rng(seed)
    out = []
    for n in (B1, B2):
        y_true, y_pred = (_f32(x) for x in _with_edge_values(kind, *_data(kind, n, rng)))
        weight = rng.uniform(0, 2, (n,)).astype("float32") if weighted else None
        if weighted:
            weight[0] = 0.0
        out.append((y_true, y_pred, weight))
    return out


# (class name, kwargs, data kind)
KERAS_CASES = [
    ("Accuracy", {}, "exact"),
    ("BinaryAccuracy", {}, "binary_probs"),
    ("BinaryAccuracy", {"threshold": 0.7}, "binary_column"),
    ("CategoricalAccuracy", {}, "onehot_probs"),
    ("SparseCategoricalAccuracy", {}, "sparse_probs"),
    ("SparseCategoricalAccuracy", {}, "sparse_logits"),
    ("TopKCategoricalAccuracy", {"k": 2}, "onehot_probs"),
    ("SparseTopKCategoricalAccuracy", {"k": 2}, "sparse_probs"),
    ("SparseTopKCategoricalAccuracy", {"k": 3}, "sparse_logits"),
    ("MeanSquaredError", {}, "regression"),
    ("MeanAbsoluteError", {}, "regression"),
    ("MeanAbsolutePercentageError", {}, "regression"),
    ("MeanSquaredLogarithmicError", {}, "positive"),
    ("RootMeanSquaredError", {}, "regression"),
    ("CosineSimilarity", {}, "regression"),
    ("LogCoshError", {}, "regression"),
    ("Hinge", {}, "binary_logits"),
    ("SquaredHinge", {}, "binary_logits"),
    ("CategoricalHinge", {}, "onehot_logits"),
    ("KLDivergence", {}, "distributions"),
    ("Poisson", {}, "positive"),
    ("BinaryCrossentropy", {}, "binary_probs"),
    ("BinaryCrossentropy", {"from_logits": True, "label_smoothing": 0.1}, "binary_logits"),
    ("CategoricalCrossentropy", {}, "onehot_probs"),
    ("CategoricalCrossentropy", {"from_logits": True, "label_smoothing": 0.2}, "onehot_logits"),
    ("SparseCategoricalCrossentropy", {}, "sparse_probs"),
    ("SparseCategoricalCrossentropy", {"from_logits": True}, "sparse_logits"),
    ("SparseCategoricalCrossentropy", {"from_logits": True, "ignore_class": 1}, "sparse_logits"),
    ("TruePositives", {}, "binary_probs"),
    ("FalsePositives", {"thresholds": 0.3}, "binary_probs"),
    ("TrueNegatives", {}, "binary_column"),
    ("FalseNegatives", {}, "binary_probs"),
    ("Precision", {}, "binary_column"),
    ("Precision", {"top_k": 2, "thresholds": 0.3}, "binary_probs"),
    ("Recall", {"thresholds": 0.7}, "binary_probs"),
    ("Recall", {"top_k": 1, "class_id": 2}, "binary_probs"),
    ("AUC", {}, "binary_column"),
    ("AUC", {"curve": "PR"}, "binary_probs"),
    ("AUC", {"curve": "PR", "summation_method": "minoring", "from_logits": True}, "binary_logits"),
    (
        "AUC",
        {"summation_method": "majoring", "num_thresholds": 50, "label_weights": [0.1, 0.5, 1.0, 2.0]},
        "binary_probs",
    ),
    ("AUC", {"thresholds": [0.1, 0.5, 0.9]}, "binary_probs"),
    ("AUC", {"thresholds": [0.25, 0.5, 0.75], "curve": "PR"}, "binary_probs"),
    (
        "AUC",
        {"multi_label": True, "num_labels": C, "curve": "PR", "label_weights": [0.1, 0.5, 1.0, 2.0]},
        "binary_probs",
    ),
    ("Mean", {}, "values"),
    ("Sum", {}, "values"),
]
CASE_IDS = [f"{i}-{n}-{k}" for i, (n, _, k) in enumerate(KERAS_CASES)]


def _keras_run(metric, batches, values_only):
    """Keras's stateless API, so that Keras too runs inside one jit."""
    state = [v.value for v in metric.variables]
    for y_true, y_pred, weight in batches:
        args = (y_true,) if values_only else (y_true, y_pred)
        state = metric.stateless_update_state(state, *args, sample_weight=weight)
    return metric.stateless_result(state)


def _ours_run(metric, batches, values_only):
    if values_only:
        return run_values(metric, [(t, w) for t, _, w in batches])
    return run(metric, batches)


@pytest.fixture(scope="module")
def keras():
    return pytest.importorskip("keras")


@pytest.fixture(scope="module")
def keras_parity(keras):
    """(ours, theirs) for every case, weighted and not, in one jit per library.

    One batch each: accumulation over batches is checked by
    `test_padding_accumulation_and_merge`.
    """
    ours, theirs = {}, {}
    for seed, (case_id, (name, kwargs, kind)) in enumerate(zip(CASE_IDS, KERAS_CASES, strict=True)):
        values_only = name in ("Mean", "Sum")
        for weighted in (False, True):
            batch = _batches(kind, seed, weighted)[0]
            key = f"{case_id}|{'weighted' if weighted else 'unweighted'}"
            ours[key] = functools.partial(_ours_run, getattr(metrics, name)(**kwargs), [batch], values_only)
            if "ignore_class" in kwargs and not weighted:
                # Without weights Keras counts ignored entries in the mean's
                # denominator; with weights (meshfit always has them, for
                # padding) it leaves them out, as the loss does.
                batch = batch[:2] + (np.ones(batch[0].shape[0], "float32"),)
            theirs[key] = functools.partial(_keras_run, getattr(keras.metrics, name)(**kwargs), [batch], values_only)
    return evaluate_all(ours), evaluate_all(theirs)


@pytest.mark.slow
@pytest.mark.parametrize("case_id", CASE_IDS)
def test_matches_keras(keras_parity, case_id):
    ours, theirs = keras_parity
    for key in (f"{case_id}|unweighted", f"{case_id}|weighted"):
        assert ours[key].shape == ()
        close(ours[key], theirs[key], rtol=1e-5, atol=1e-5, err_msg=key)


def test_default_names_match_keras(keras):
    for name, kwargs, _ in KERAS_CASES:
        # Keras makes auto names unique ("auc", "auc_1", ...); meshfit does not.
        theirs = re.sub(r"_\d+$", "", getattr(keras.metrics, name)(**kwargs).name)
        assert getattr(metrics, name)(**kwargs).name == theirs, name


# ---------------------------------------------------------------------------
# Padded rows, accumulation over batches, merging states.
# ---------------------------------------------------------------------------

PAD = 3


def _pad_batch(y_true, y_pred, weight):
    """The batch padded with garbage rows (NaN predictions) of weight 0."""
    y_true, y_pred = np.asarray(y_true), np.asarray(y_pred, "float32")
    n = y_true.shape[0]
    pad_true = np.concatenate([y_true, np.zeros((PAD,) + y_true.shape[1:], y_true.dtype)])
    pad_pred = np.concatenate([y_pred, np.full((PAD,) + y_pred.shape[1:], np.nan, "float32")])
    weight = np.ones(n, "float32") if weight is None else weight
    return pad_true, pad_pred, np.concatenate([weight, np.zeros(PAD, "float32")])


def _concat(batches):
    t, p, w = zip(*batches, strict=True)
    return np.concatenate(t), np.concatenate(p), None if w[0] is None else np.concatenate(w)


def _semantics(metric, weighted_batches, unweighted_batches):
    """Results that must each equal one pass over the concatenated batches."""
    a, b = weighted_batches
    merged = metric.merge(metric.update(metric.init(), *a), metric.update(metric.init(), *b))
    return {
        "weighted": {
            "one_pass": run(metric, [_concat(weighted_batches)]),
            "two_updates": run(metric, weighted_batches),
            "merged_states": metric.compute(merged),
            "padded": run(metric, [_pad_batch(*a), _pad_batch(*b)]),
        },
        "unweighted": {
            "one_pass": run(metric, [_concat(unweighted_batches)]),
            "padded": run(metric, [_pad_batch(*x) for x in unweighted_batches]),
        },
    }


# One or two metrics per code path; checking every class would only slow the
# file down.
SEMANTIC_CASES = [
    ("BinaryAccuracy", {}, "binary_column"),
    ("SparseCategoricalAccuracy", {}, "sparse_logits"),
    ("SparseTopKCategoricalAccuracy", {"k": 2}, "sparse_probs"),
    ("MeanSquaredError", {}, "regression"),
    ("RootMeanSquaredError", {}, "regression"),
    ("SparseCategoricalCrossentropy", {"from_logits": True, "ignore_class": 1}, "sparse_logits"),
    ("Precision", {"top_k": 2}, "binary_probs"),
    ("Recall", {"class_id": 1}, "binary_probs"),
    ("AUC", {}, "binary_column"),
    ("AUC", {"multi_label": True, "num_labels": C}, "binary_probs"),
]
SEMANTIC_IDS = [f"{n}-{k}-{sorted(kw.items())}" for n, kw, k in SEMANTIC_CASES]


@pytest.fixture(scope="module")
def semantics():
    thunks = {}
    for seed, (case_id, (name, kwargs, kind)) in enumerate(zip(SEMANTIC_IDS, SEMANTIC_CASES, strict=True)):
        thunks[case_id] = functools.partial(
            _semantics,
            getattr(metrics, name)(**kwargs),
            _batches(kind, seed + 100, weighted=True),
            _batches(kind, seed + 200, weighted=False),
        )
    return evaluate_all(thunks)


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
@pytest.mark.parametrize("case_id", SEMANTIC_IDS)
def test_padding_accumulation_and_merge(semantics, case_id):
    for weighting, results in semantics[case_id].items():
        for key, value in results.items():
            close(value, results["one_pass"], rtol=1e-5, atol=1e-5, err_msg=f"{case_id} {weighting} {key}")


def test_multi_label_auc_with_uneven_thresholds_averages_labels():
    # Keras cannot jit this configuration, so check it against the per-label
    # AUCs, whose single-label path is compared with Keras above.
    y_true, y_pred, weight = _batches("binary_probs", 7, weighted=True)[0]
    thresholds = [0.2, 0.6]
    multi = metrics.AUC(multi_label=True, num_labels=C, thresholds=thresholds)
    single = metrics.AUC(thresholds=thresholds)
    got = evaluate_all(
        {
            "multi": lambda: run(multi, [(y_true, y_pred, weight)]),
            "per_label": lambda: jnp.stack([run(single, [(y_true[:, i], y_pred[:, i], weight)]) for i in range(C)]),
        }
    )
    close(got["multi"], got["per_label"].mean())


def test_mean_padding_and_merge():
    m = metrics.Mean()
    values = jnp.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    padded = jnp.concatenate([values, jnp.full((2, 2), jnp.nan)])
    weights = jnp.array([1.0, 1.0, 1.0, 0.0, 0.0])
    got = evaluate_all(
        {
            "merged": lambda: m.compute(m.merge(m.update(m.init(), values[:2]), m.update(m.init(), values[2:]))),
            "padded": lambda: m.compute(m.update(m.init(), padded, weights)),
        }
    )
    close(got["merged"], 3.5)
    close(got["padded"], 3.5)


def test_state_is_float32_zeros_of_sums():
    for name, kwargs, _ in KERAS_CASES:
        state = getattr(metrics, name)(**kwargs).init()
        for leaf in jax.tree.leaves(state):
            assert leaf.dtype == jnp.float32 and not np.any(np.asarray(leaf)), name


# ---------------------------------------------------------------------------
# jit.
# ---------------------------------------------------------------------------


def test_update_and_compute_under_jit():
    m = metrics.SparseCategoricalAccuracy()
    update, compute = jax.jit(m.update), jax.jit(m.compute)
    state = update(m.init(), jnp.array([0, 1, 1]), jnp.eye(3)[:, :2] + 0.1, jnp.array([1.0, 1.0, 0.0]))
    state = update(state, jnp.array([1, 0, 0]), jnp.eye(3)[:, :2] + 0.1, jnp.array([1.0, 1.0, 1.0]))
    # batch 1: rows 0,1 correct (row 2 has weight 0); batch 2: rows 0,1 wrong, row 2 right.
    close(compute(state), 3 / 5)
    # (The other metrics run under jit in the fixtures above.)


# ---------------------------------------------------------------------------
# get(): names as Keras's compile gives them, "accuracy" resolution, errors.
# ---------------------------------------------------------------------------


def my_metric_fn(y_true, y_pred):
    return jnp.mean(jnp.abs(y_true - y_pred), axis=-1)


NAME_IDENTIFIERS = [
    "mse",
    "MSE",
    "mae",
    "mape",
    "msle",
    "bce",
    "mean_squared_error",
    "MeanSquaredError",
    "root_mean_squared_error",
    "binary_accuracy",
    "categorical_accuracy",
    "sparse_categorical_accuracy",
    "top_k_categorical_accuracy",
    "sparse_top_k_categorical_accuracy",
    "auc",
    "AUC",
    "precision",
    "recall",
    "log_cosh_error",
    "LogCoshError",
    "kl_divergence",
    "poisson",
    "hinge",
    "categorical_crossentropy",
    "sparse_categorical_crossentropy",
    "cosine_similarity",
]

SHAPES = {  # (y_true shape, y_pred shape) -> the accuracy Keras picks
    "sparse": ((8,), (8, 5)),
    "sparse_column": ((8, 1), (8, 5)),
    "categorical": ((8, 5), (8, 5)),
    "binary": ((8, 1), (8, 1)),
    "binary_rank1_labels": ((8,), (8, 1)),
}


def test_names_and_classes_match_keras_compile(keras):
    compile_utils = pytest.importorskip("keras.src.trainers.compile_utils")
    for shapes in SHAPES.values():
        y_true, y_pred = (np.zeros(s, "float32") for s in shapes)
        spec_true, spec_pred = (jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes)
        for identifier in NAME_IDENTIFIERS + ["accuracy", "acc", "Accuracy", my_metric_fn]:
            theirs = compile_utils.get_metric(identifier, y_true, y_pred)
            ours = metrics.get(identifier, y_true=spec_true, y_pred=spec_pred)
            assert ours.name == theirs.name, identifier
            expected_class = type(theirs).__name__
            if expected_class != "MeanMetricWrapper":
                assert type(ours).__name__ == expected_class, identifier


@pytest.mark.parametrize("shape_id", SHAPES)
def test_accuracy_resolution_from_shapes(shape_id):
    expected = {
        "sparse": metrics.SparseCategoricalAccuracy,
        "sparse_column": metrics.SparseCategoricalAccuracy,
        "categorical": metrics.CategoricalAccuracy,
        "binary": metrics.BinaryAccuracy,
        "binary_rank1_labels": metrics.BinaryAccuracy,
    }[shape_id]
    y_true, y_pred = (jax.ShapeDtypeStruct(s, jnp.float32) for s in SHAPES[shape_id])
    for identifier in ("accuracy", "acc"):
        m = metrics.get(identifier, y_true=y_true, y_pred=y_pred)
        assert type(m) is expected and m.name == identifier
    # Arrays work as well as shape structs.
    m = metrics.get("accuracy", y_true=np.zeros(y_true.shape), y_pred=np.zeros(y_pred.shape))
    assert type(m) is expected


def test_accuracy_resolution_from_loss_without_shapes():
    assert type(metrics.get("acc", loss="binary_crossentropy")) is metrics.BinaryAccuracy
    assert (
        type(metrics.get("accuracy", loss=losses.SparseCategoricalCrossentropy(from_logits=True)))
        is metrics.SparseCategoricalAccuracy
    )
    assert type(metrics.get("accuracy", loss="categorical_crossentropy")) is (metrics.CategoricalAccuracy)
    with pytest.raises(ValueError, match="sparse_categorical_accuracy"):
        metrics.get("accuracy", loss="mse")


def test_get_instances_callables_and_losses():
    instance = metrics.AUC(curve="PR", name="pr_auc")
    assert metrics.get(instance) is instance
    wrapped = metrics.get(my_metric_fn)
    assert isinstance(wrapped, metrics.MeanMetricWrapper) and wrapped.name == "my_metric_fn"
    from_loss = metrics.get(losses.SparseCategoricalCrossentropy(ignore_class=0))
    assert from_loss.name == "sparse_categorical_crossentropy"
    got = evaluate_all(
        {
            "wrapped": lambda: run(wrapped, [(jnp.zeros((2, 2)), jnp.ones((2, 2)), None)]),
            "from_loss": lambda: run(from_loss, [(jnp.array([0, 1]), jnp.array([[0.5, 0.5], [0.25, 0.75]]), None)]),
        }
    )
    close(got["wrapped"], 1.0)
    close(got["from_loss"], -np.log(0.75))  # the ignored class is left out of the mean


def test_get_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="sparse_categorical_accuracy") as info:
        metrics.get("acuracy")
    assert "'acuracy'" in str(info.value)
    with pytest.raises(TypeError, match="int"):
        metrics.get(42)


def test_scalar_returning_metric_fn_raises():
    m = metrics.MeanMetricWrapper(lambda t, p: jnp.mean(t - p), name="scalar")
    with pytest.raises(ValueError, match="per-sample"):
        m.update(m.init(), jnp.zeros((2, 2)), jnp.ones((2, 2)))


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_labels"):
        metrics.AUC(multi_label=True)
    with pytest.raises(ValueError, match="curve"):
        metrics.AUC(curve="ROCK")
    with pytest.raises(ValueError, match="one metric per threshold"):
        metrics.Precision(thresholds=[0.3, 0.6])


# -- F-beta and R^2: accumulators per class, Keras's numbers ----------------------------------------------

SCORE_CASES = [
    ("F1Score", dict()),
    ("F1Score", dict(average="micro")),
    ("F1Score", dict(average="macro", threshold=0.4)),
    ("F1Score", dict(average="weighted")),
    ("FBetaScore", dict(beta=2.0, average="macro", threshold=0.5)),
    ("FBetaScore", dict(beta=0.5)),
    ("R2Score", dict()),
    ("R2Score", dict(class_aggregation=None)),
    ("R2Score", dict(class_aggregation="variance_weighted_average", num_regressors=2)),
]


def _score_batches(name, seed, weighted):
    rng = np.random.default_rng(seed)
    batches = []
    for rows in (16, 16, 9):
        if name == "R2Score":
            y_true = rng.normal(size=(rows, 3)).astype("float32")
            y_pred = (y_true + 0.7 * rng.normal(size=(rows, 3))).astype("float32")
        else:
            y_true = (rng.random((rows, 4)) < 0.4).astype("float32")
            y_pred = np.clip(0.6 * y_true + 0.6 * rng.random((rows, 4)), 0, 1).astype("float32")
        weight = rng.uniform(0.5, 2.0, rows).astype("float32") if weighted else None
        batches.append((y_true, y_pred, weight))
    return batches


@pytest.mark.parametrize("name, kwargs", SCORE_CASES, ids=[f"{n}-{k}" for n, k in SCORE_CASES])
@pytest.mark.parametrize("weighted", [False, True])
def test_fbeta_and_r2_match_keras_over_batches_and_merged_replicas(keras, name, kwargs, weighted):
    batches = _score_batches(name, 7, weighted)
    theirs = getattr(keras.metrics, name)(**kwargs)
    ours = getattr(metrics, name)(**kwargs)
    for y_true, y_pred, weight in batches:
        theirs.update_state(y_true, y_pred, sample_weight=weight)
        ours.update_state(y_true, y_pred, sample_weight=weight)
    expected = np.asarray(theirs.result())
    close(ours.result(), expected, rtol=1e-5, atol=1e-6)
    # As two replicas would: each half of every batch (the last padded with weight-0 rows), merged by summing.
    fresh = getattr(metrics, name)(**kwargs)
    fresh.build(batches[0][0], batches[0][1])
    update = jax.jit(fresh.update)
    halves = [fresh.init(), fresh.init()]
    for y_true, y_pred, weight in batches:
        rows = len(y_true)
        weight = np.ones(rows, "float32") if weight is None else weight
        pad = 16 - rows
        y_true, y_pred = (np.concatenate([a, np.zeros((pad, a.shape[1]), "float32")]) for a in (y_true, y_pred))
        weight = np.concatenate([weight, np.zeros(pad, "float32")])
        for i in range(2):
            part = slice(8 * i, 8 * (i + 1))
            halves[i] = update(halves[i], y_true[part], y_pred[part], weight[part])
    close(fresh.compute(metrics.Metric.merge(*halves)), expected, rtol=1e-5, atol=1e-6)


def test_fbeta_and_r2_names_config_and_errors():
    assert isinstance(metrics.get("f1_score", y_true=np.zeros((2, 3)), y_pred=np.zeros((2, 3))), metrics.F1Score)
    assert type(metrics.get("fbeta_score")) is metrics.FBetaScore
    assert type(metrics.get("r2_score")) is metrics.R2Score
    f1 = metrics.F1Score(average="macro", threshold=0.3)
    assert metrics.F1Score(**f1.get_config()).get_config() == f1.get_config()
    r2 = metrics.R2Score(class_aggregation=None, num_regressors=1)
    assert metrics.R2Score(**r2.get_config()).get_config() == r2.get_config()
    with pytest.raises(ValueError, match="learns the number of classes"):
        metrics.F1Score().init()
    with pytest.raises(ValueError, match="2D inputs"):
        metrics.F1Score().build(np.zeros(4), np.zeros(4))
    with pytest.raises(ValueError, match="average"):
        metrics.F1Score(average="mean")


class KerasTruePositives(mf.metrics.Metric):
    """A metric written to Keras's stateful contract: variables made by `add_weight` and assigned to."""

    def __init__(self, name="true_positives", **kwargs):
        super().__init__(name=name, **kwargs)
        self.true_positives = self.add_weight(name="tp", initializer="zeros")


class KerasResultOnly(mf.metrics.Metric):
    """Keras's `update_state`/`result` without `add_weight` (state kept in Python attributes)."""

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.total = getattr(self, "total", 0.0) + float(jnp.sum(y_pred))

    def result(self):
        return self.total


def test_a_keras_stateful_metric_is_shown_meshfits_contract():
    contract = r"Implement `init\(\)` -> a dict of accumulators .*`update\(state, y_true, y_pred, sample_weight=None\)`"
    with pytest.raises(TypeError, match=r"KerasTruePositives.add_weight\(\): meshfit's metrics hold no variables.*"):
        KerasTruePositives()
    with pytest.raises(TypeError, match=contract):
        KerasTruePositives()
    model = mf.Model(MLP())
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=[KerasResultOnly()])
    x, y = classification_data(n=8)
    with pytest.raises(TypeError, match=r"KerasResultOnly implements Keras's stateful `update_state`/`result`.*"):
        model.fit(x, y, batch_size=8, verbose=0)
    assert int(model.session.state.step) == 0
