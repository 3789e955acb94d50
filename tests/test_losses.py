"""Tests for meshfit.losses: closed forms, Keras parity, masking, jit, errors."""

import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshfit import losses

# Keras, an optional test dependency imported by the `keras` fixture, needs JAX.
os.environ.setdefault("KERAS_BACKEND", "jax")

RTOL = 1e-5
ATOL = 1e-6


def close(a, b, rtol=RTOL, atol=ATOL):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------
# Closed-form values on tiny inputs.
# ---------------------------------------------------------------------------


def _lse(xs):
    return math.log(sum(math.exp(x) for x in xs))


CLOSED_FORM = [
    ("mse", losses.MeanSquaredError(), [[0.0, 1.0]], [[1.0, 1.0]], 0.5),
    ("mae", losses.MeanAbsoluteError(), [[0.0, 1.0]], [[1.0, 3.0]], 1.5),
    ("mape", losses.MeanAbsolutePercentageError(), [[2.0, 4.0]], [[1.0, 5.0]], 37.5),
    (
        "msle",
        losses.MeanSquaredLogarithmicError(),
        [[0.0]],
        [[math.e - 1.0]],
        1.0,
    ),
    ("huber_quadratic", losses.Huber(), [[0.0]], [[0.5]], 0.125),
    ("huber_linear", losses.Huber(delta=1.0), [[0.0]], [[3.0]], 2.5),
    ("log_cosh", losses.LogCosh(), [[0.0]], [[1.0]], math.log(math.cosh(1.0))),
    ("hinge_01_labels", losses.Hinge(), [[0.0, 1.0]], [[0.5, 0.5]], 1.0),
    ("squared_hinge", losses.SquaredHinge(), [[-1.0, 1.0]], [[0.5, 0.5]], 1.25),
    ("categorical_hinge", losses.CategoricalHinge(), [[0.0, 1.0]], [[0.3, 0.6]], 0.7),
    ("kld", losses.KLDivergence(), [[0.5, 0.5]], [[0.25, 0.75]], 0.5 * math.log(2) + 0.5 * math.log(2 / 3)),
    ("poisson", losses.Poisson(), [[2.0]], [[1.0]], 1.0 - 2.0 * math.log(1.0 + 1e-7)),
    ("cosine", losses.CosineSimilarity(), [[1.0, 0.0]], [[1.0, 1.0]], -1 / math.sqrt(2)),
    ("bce_probs", losses.BinaryCrossentropy(), [[1.0, 0.0]], [[0.8, 0.4]], -(math.log(0.8) + math.log(0.6)) / 2),
    ("bce_logits", losses.BinaryCrossentropy(from_logits=True), [[1.0]], [[0.0]], math.log(2.0)),
    ("cce", losses.CategoricalCrossentropy(), [[0.0, 1.0, 0.0]], [[0.2, 0.5, 0.3]], -math.log(0.5)),
    (
        "cce_logits",
        losses.CategoricalCrossentropy(from_logits=True),
        [[0.0, 0.0, 1.0]],
        [[1.0, 2.0, 3.0]],
        _lse([1, 2, 3]) - 3.0,
    ),
    (
        "sce_logits",
        losses.SparseCategoricalCrossentropy(from_logits=True),
        [2, 0],
        [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]],
        ((_lse([1, 2, 3]) - 3.0) + (_lse([1, 2, 3]) - 1.0)) / 2,
    ),
    ("sce_probs_col_labels", losses.SparseCategoricalCrossentropy(), [[1.0]], [[0.25, 0.75]], -math.log(0.75)),
]


def _call(loss, y_true, y_pred, sample_weight=None):
    return loss(y_true, y_pred, sample_weight=sample_weight)


def evaluate_all(thunks):
    """Runs many small computations in one `jax.jit`.

    One compilation instead of hundreds of eager per-op compilations keeps the
    file fast; the numbers are the same as eager ones.
    """
    return jax.tree.map(np.asarray, jax.jit(lambda: {k: f() for k, f in thunks.items()})())


@pytest.fixture(scope="module")
def closed_form_values():
    return evaluate_all(
        {
            case_id: functools.partial(_call, loss, jnp.array(y_true), jnp.array(y_pred))
            for case_id, loss, y_true, y_pred, _ in CLOSED_FORM
        }
    )


@pytest.mark.parametrize("case_id,expected", [(c[0], c[4]) for c in CLOSED_FORM], ids=[c[0] for c in CLOSED_FORM])
def test_closed_form(closed_form_values, case_id, expected):
    close(closed_form_values[case_id], expected)


def test_reductions_closed_form():
    y_true = jnp.array([[0.0], [0.0], [0.0]])
    y_pred = jnp.array([[1.0], [2.0], [3.0]])  # per-sample MSE: 1, 4, 9
    sw = jnp.array([1.0, 0.5, 0.0])
    mse = losses.MeanSquaredError
    got = evaluate_all(
        {
            "default": lambda: mse()(y_true, y_pred),
            "mean": lambda: mse(reduction="mean")(y_true, y_pred),
            "sum": lambda: mse(reduction="sum")(y_true, y_pred),
            "none": lambda: mse(reduction="none")(y_true, y_pred),
            "None_weighted": lambda: mse(reduction=None)(y_true, y_pred, sw),
            "default_weighted": lambda: mse()(y_true, y_pred, sample_weight=sw),
            "mwsw_weighted": lambda: mse(reduction="mean_with_sample_weight")(y_true, y_pred, sw),
            "mwsw": lambda: mse(reduction="mean_with_sample_weight")(y_true, y_pred),
        }
    )
    expected = {
        "default": 14 / 3,
        "mean": 14 / 3,
        "sum": 14.0,
        "none": [1.0, 4.0, 9.0],
        "None_weighted": [1.0, 2.0, 0.0],
        "default_weighted": 3.0 / 3,  # weighted sum over the batch size
        "mwsw_weighted": 3.0 / 1.5,  # weighted sum over the sum of weights
        "mwsw": 14 / 3,
    }
    for key, value in expected.items():
        close(got[key], value)


def test_functional_forms_are_per_sample():
    y_true = jnp.array([[0.0, 1.0], [1.0, 1.0]])
    y_pred = jnp.array([[1.0, 1.0], [1.0, 1.0]])
    logits = jnp.array([[1.0, 2.0, 3.0]])
    got = evaluate_all(
        {
            "mean_squared_error": lambda: losses.mean_squared_error(y_true, y_pred),
            "mse": lambda: losses.mse(y_true, y_pred),
            "mae": lambda: losses.mae(y_true, y_pred),
            "sce": lambda: losses.sparse_categorical_crossentropy(jnp.array([0]), logits, from_logits=True),
        }
    )
    close(got["mean_squared_error"], [0.5, 0.0])
    close(got["mse"], [0.5, 0.0])
    close(got["mae"], [0.5, 0.0])
    close(got["sce"], [_lse([1, 2, 3]) - 1.0])


def test_sparse_labels_int_float_and_column():
    logits = np.random.default_rng(0).normal(size=(5, 4)).astype("float32")
    ids = np.array([0, 3, 1, 2, 3])
    loss = losses.SparseCategoricalCrossentropy(from_logits=True)
    got = evaluate_all(
        {
            "int": lambda: loss(ids, logits),
            "float": lambda: loss(ids.astype("float32"), logits),
            "int_column": lambda: loss(ids[:, None], logits),
            "float_column": lambda: loss(ids[:, None].astype("float32"), logits),
        }
    )
    lse = np.log(np.exp(logits).sum(-1))
    expected = np.mean(lse - logits[np.arange(5), ids])
    for key in got:
        close(got[key], expected)


def test_sparse_ignore_class_excluded_from_mean():
    logits = jnp.array([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0], [0.0, 0.0, 9.0]])
    labels = jnp.array([2, -1, 0])
    loss = losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=-1)
    expected = ((_lse([1, 2, 3]) - 3.0) + (_lse([0, 0, 9]) - 0.0)) / 2
    close(jax.jit(loss)(labels, logits), expected)


# ---------------------------------------------------------------------------
# Agreement with Keras on random inputs.
# ---------------------------------------------------------------------------

B, C = 6, 4


def _data(kind, seed):
    y_true, y_pred = _with_edge_values(kind, *_data64(kind, seed))
    return tuple(x.astype("float32") if x.dtype == np.float64 else x for x in (y_true, y_pred))


def _with_edge_values(kind, y_true, y_pred):
    """Puts values where Keras's epsilon clipping matters into the first rows."""
    if kind in ("binary_probs", "onehot_probs", "distributions", "sparse_probs"):
        y_pred[0, 0], y_pred[1, 0] = 0.0, 1.0  # log(0) and log(1 - 1) need the clip
        if kind == "binary_probs":
            y_true[0, 0], y_true[1, 0] = 1.0, 0.0
        if kind == "distributions":
            y_true[2, 1] = 0.0
    if kind == "regression":
        y_true[0, 0] = 0.0  # MAPE divides by max(|y_true|, eps)
    if kind == "positive":
        y_pred[0, 0], y_true[1, 1] = 0.0, 0.0  # Poisson log(0 + eps); MSLE max(., eps)
    return y_true, y_pred


def _data64(kind, seed):
    rng = np.random.default_rng(seed)
    if kind == "regression":
        return rng.normal(size=(B, C)), rng.normal(size=(B, C))
    if kind == "positive":
        return rng.uniform(0.1, 3, (B, C)), rng.uniform(0.1, 3, (B, C))
    if kind == "binary_probs":
        return rng.integers(0, 2, (B, C)).astype("float32"), rng.uniform(0, 1, (B, C))
    if kind == "binary_logits":
        return rng.integers(0, 2, (B, C)).astype("float32"), 3 * rng.normal(size=(B, C))
    if kind == "binary_column":
        return rng.integers(0, 2, (B,)).astype("float32"), rng.uniform(0, 1, (B, 1))
    if kind == "hinge_pm1":
        return rng.choice([-1.0, 1.0], (B, C)), rng.normal(size=(B, C))
    if kind == "onehot_probs":
        probs = rng.uniform(0.01, 1, (B, C))
        return np.eye(C)[rng.integers(0, C, B)], probs / probs.sum(-1, keepdims=True)
    if kind == "onehot_logits":
        return np.eye(C)[rng.integers(0, C, B)], 3 * rng.normal(size=(B, C))
    if kind == "distributions":
        p = rng.uniform(0.01, 1, (B, C))
        q = rng.uniform(0.01, 1, (B, C))
        return p / p.sum(-1, keepdims=True), q / q.sum(-1, keepdims=True)
    if kind == "sparse_probs":
        probs = rng.uniform(0.01, 1, (B, C))
        return rng.integers(0, C, (B,)), probs / probs.sum(-1, keepdims=True)
    if kind == "sparse_logits":
        return rng.integers(0, C, (B, 1)), 3 * rng.normal(size=(B, C))
    if kind == "sequence":
        return rng.normal(size=(B, 3, C)), rng.normal(size=(B, 3, C))
    raise ValueError(kind)


# (class name, kwargs, data kind)
KERAS_CASES = [
    ("MeanSquaredError", {}, "regression"),
    ("MeanSquaredError", {}, "sequence"),
    ("MeanAbsoluteError", {}, "regression"),
    ("MeanAbsolutePercentageError", {}, "regression"),
    ("MeanSquaredLogarithmicError", {}, "positive"),
    ("Huber", {}, "regression"),
    ("Huber", {"delta": 0.3}, "regression"),
    ("LogCosh", {}, "regression"),
    ("CosineSimilarity", {}, "regression"),
    ("Hinge", {}, "binary_logits"),
    ("Hinge", {}, "hinge_pm1"),
    ("SquaredHinge", {}, "binary_logits"),
    ("CategoricalHinge", {}, "onehot_logits"),
    ("KLDivergence", {}, "distributions"),
    ("Poisson", {}, "positive"),
    ("BinaryCrossentropy", {}, "binary_probs"),
    ("BinaryCrossentropy", {}, "binary_column"),
    ("BinaryCrossentropy", {"from_logits": True}, "binary_logits"),
    ("BinaryCrossentropy", {"label_smoothing": 0.2}, "binary_probs"),
    ("BinaryCrossentropy", {"from_logits": True, "label_smoothing": 0.1}, "binary_logits"),
    ("BinaryFocalCrossentropy", {}, "binary_probs"),
    (
        "BinaryFocalCrossentropy",
        {"from_logits": True, "apply_class_balancing": True, "gamma": 1.5},
        "binary_logits",
    ),
    ("CategoricalCrossentropy", {}, "onehot_probs"),
    ("CategoricalCrossentropy", {"from_logits": True}, "onehot_logits"),
    ("CategoricalCrossentropy", {"label_smoothing": 0.1}, "onehot_probs"),
    (
        "CategoricalCrossentropy",
        {"from_logits": True, "label_smoothing": 0.3},
        "onehot_logits",
    ),
    ("CategoricalFocalCrossentropy", {"from_logits": True}, "onehot_logits"),
    ("SparseCategoricalCrossentropy", {}, "sparse_probs"),
    ("SparseCategoricalCrossentropy", {"from_logits": True}, "sparse_logits"),
    ("SparseCategoricalCrossentropy", {"from_logits": True, "ignore_class": 1}, "sparse_logits"),
]

REDUCTIONS = ["sum_over_batch_size", "sum", "mean_with_sample_weight", None]
# The reduction code is shared by all losses: every reduction x weighting is
# checked for a few of them; for the rest, the default reduction with weights
# and the unreduced values without.
FULL_MATRIX = {"MeanSquaredError", "SparseCategoricalCrossentropy"}
SHORT_MATRIX = [("sum_over_batch_size", "weighted"), (None, "unweighted")]


def _combos(name):
    if name in FULL_MATRIX:
        return [(r, w) for r in REDUCTIONS for w in ("unweighted", "weighted")]
    return SHORT_MATRIX


CASE_IDS = [f"{n}-{k}-{sorted(kw.items())}" for n, kw, k in KERAS_CASES]


@pytest.fixture(scope="module")
def keras():
    return pytest.importorskip("keras")


@pytest.fixture(scope="module")
def keras_parity(keras):
    """(ours, theirs) for every case and its (reduction, weighting) combos.

    Each library runs everything in one jit.
    """
    ours, theirs = {}, {}
    sw = np.random.default_rng(1).uniform(0, 2, (B,)).astype("float32")
    for case_id, (name, kwargs, kind) in zip(CASE_IDS, KERAS_CASES, strict=True):
        y_true, y_pred = _data(kind, seed=len(name) + len(kind))
        # Keras broadcasts (batch,) weights against the last axis, so give
        # per-timestep values (batch, 1) weights.
        weights = {"unweighted": None, "weighted": sw[:, None] if kind == "sequence" else sw}
        for reduction, weight_id in _combos(name):
            key = f"{case_id}|{reduction}|{weight_id}"
            for out, module in ((ours, losses), (theirs, keras.losses)):
                loss = getattr(module, name)(reduction=reduction, **kwargs)
                out[key] = functools.partial(_call, loss, y_true, y_pred, weights[weight_id])
    return evaluate_all(ours), evaluate_all(theirs)


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
@pytest.mark.parametrize("case_id", CASE_IDS)
def test_matches_keras(keras_parity, case_id):
    ours, theirs = keras_parity
    keys = [k for k in ours if k.startswith(case_id + "|")]
    assert len(keys) == len(_combos(case_id.split("-")[0]))
    for key in keys:
        np.testing.assert_allclose(ours[key], theirs[key], rtol=1e-5, atol=1e-5, err_msg=key)


@pytest.mark.parametrize("name,kwargs,kind", KERAS_CASES[:1] + KERAS_CASES[-3:])
def test_names_match_keras(keras, name, kwargs, kind):
    assert getattr(losses, name)(**kwargs).name == getattr(keras.losses, name)(**kwargs).name


def test_functional_forms_match_keras(keras):
    names = ["mean_squared_error", "mean_absolute_error", "log_cosh", "huber", "cosine_similarity"]
    y_true, y_pred = _data("regression", 0)
    s_true, s_pred = _data("sparse_logits", 0)
    ours, theirs = (
        evaluate_all(
            {
                **{n: functools.partial(getattr(module, n), y_true, y_pred) for n in names},
                "sce": functools.partial(
                    module.sparse_categorical_crossentropy,
                    s_true,
                    s_pred,
                    from_logits=True,
                ),
            }
        )
        for module in (losses, keras.losses)
    )
    for key in ours:
        np.testing.assert_allclose(ours[key], theirs[key], rtol=RTOL, atol=ATOL, err_msg=key)


def test_keras_reduction_names_accepted():
    for reduction in ["sum_over_batch_size", "sum", "mean", "mean_with_sample_weight", "none", None]:
        assert losses.MeanSquaredError(reduction=reduction).reduction == reduction


# ---------------------------------------------------------------------------
# Masking of padded rows.
# ---------------------------------------------------------------------------


def _pad(x, n, fill):
    x = jnp.asarray(x)
    pad = jnp.full((n,) + x.shape[1:], fill, x.dtype)
    return jnp.concatenate([x, pad])


MASK_CASES = [  # the first three get every reduction x weighting
    (losses.MeanSquaredError(), "regression"),
    (losses.MeanSquaredError(), "sequence"),
    (losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=2), "sparse_logits"),
    (losses.Huber(), "regression"),
    (losses.BinaryCrossentropy(from_logits=True), "binary_logits"),
    (losses.CategoricalCrossentropy(), "onehot_probs"),
    (losses.SparseCategoricalCrossentropy(from_logits=True), "sparse_logits"),
    (losses.KLDivergence(), "distributions"),
]
MASK_FULL = 3


def _mask_combos(index):
    if index < MASK_FULL:
        return [(r, w) for r in REDUCTIONS for w in ("unweighted", "weighted")]
    return SHORT_MATRIX


def _kwargs_of(loss):
    keys = ("from_logits", "ignore_class", "delta", "label_smoothing")
    return {k: getattr(loss, k) for k in keys if hasattr(loss, k)}


MASK_IDS = [f"{loss.name}-{kind}-{_i}" for _i, (loss, kind) in enumerate(MASK_CASES)]
N_PAD = 3


def _padded_and_plain(loss, y_true, y_pred, weight):
    """The loss of the batch padded with garbage rows and masked, and without."""
    mask = jnp.concatenate([jnp.ones(B), jnp.zeros(N_PAD)])
    padded_true = _pad(y_true, N_PAD, 1)
    padded_pred = _pad(y_pred, N_PAD, jnp.nan)  # garbage, even NaN, must not leak
    padded_weight = None if weight is None else _pad(weight, N_PAD, 7.0)
    return (
        loss(padded_true, padded_pred, sample_weight=padded_weight, mask=mask),
        loss(y_true, y_pred, sample_weight=weight),
    )


@pytest.fixture(scope="module")
def padded_vs_unpadded():
    """For every case, reduction and weighting: (padded loss, unpadded loss)."""
    thunks = {}
    weights = {"unweighted": None, "weighted": jnp.linspace(0.5, 2.0, B)}
    for index, (case_id, (proto, kind)) in enumerate(zip(MASK_IDS, MASK_CASES, strict=True)):
        y_true, y_pred = _data(kind, 3)
        y_true, y_pred = jnp.asarray(y_true), jnp.asarray(y_pred, jnp.float32)
        for reduction, weight_id in _mask_combos(index):
            loss = type(proto)(**{**_kwargs_of(proto), "reduction": reduction})
            thunks[f"{case_id}|{reduction}|{weight_id}"] = functools.partial(
                _padded_and_plain, loss, y_true, y_pred, weights[weight_id]
            )
    return evaluate_all(thunks)


@pytest.mark.parametrize("case_id", MASK_IDS)
def test_padded_batch_equals_unpadded(padded_vs_unpadded, case_id):
    keys = [k for k in padded_vs_unpadded if k.startswith(case_id + "|")]
    assert len(keys) == len(_mask_combos(MASK_IDS.index(case_id)))
    for key in keys:
        got, expected = padded_vs_unpadded[key]
        if key.split("|")[1] == "None":  # unreduced: padded rows come back as 0
            np.testing.assert_array_equal(got[B:], 0)
            got = got[:B]
        np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL, err_msg=key)


def test_row_weights_scale_whole_rows_of_per_timestep_losses():
    # Keras cannot apply (batch,) weights to (batch, time) losses; meshfit
    # treats them as (batch, 1).
    y_true, y_pred = _data("sequence", 0)
    sw = np.linspace(0.0, 2.0, B).astype("float32")
    mask = np.array([1, 1, 1, 1, 0, 0])
    loss = losses.MeanSquaredError(reduction="mean_with_sample_weight")
    got = jax.jit(lambda w, m: loss(y_true, y_pred, sample_weight=w, mask=m))
    close(got(sw, mask), got(sw[:, None], mask))
    per_step = ((y_true - y_pred) ** 2).mean(-1)[:4]
    close(got(sw, mask), (per_step * sw[:4, None]).sum() / sw[:4].sum())


def test_mask_gives_zero_gradient_to_padding_rows():
    loss = losses.CategoricalCrossentropy(from_logits=True)
    y_true, y_pred = _data("onehot_logits", 5)
    mask = jnp.array([1, 1, 1, 1, 0, 0])
    grad = jax.jit(jax.grad(lambda p: loss(y_true, p, mask=mask)))(jnp.asarray(y_pred))
    assert np.all(np.asarray(grad[4:]) == 0)
    assert np.any(np.asarray(grad[:4]) != 0)


def test_reduce_values_directly():
    values = jnp.array([1.0, 2.0, 3.0, 100.0])
    mask = jnp.array([1, 1, 1, 0])
    sw = jnp.array([1.0, 1.0, 2.0, 5.0])
    got = evaluate_all(
        {
            "mean": lambda: losses.reduce_values(values, mask=mask),
            "sum": lambda: losses.reduce_values(values, mask=mask, reduction="sum"),
            "mwsw": lambda: losses.reduce_values(values, sw, mask, reduction="mean_with_sample_weight"),
            "all_masked": lambda: losses.reduce_values(jnp.zeros(3), mask=jnp.zeros(3)),
        }
    )
    close(got["mean"], 2.0)
    close(got["sum"], 6.0)
    close(got["mwsw"], 9.0 / 4.0)
    close(got["all_masked"], 0.0)  # 0, not NaN, when every row is padding


# ---------------------------------------------------------------------------
# jit and lookup.
# ---------------------------------------------------------------------------


def test_loss_under_jit():
    loss = losses.SparseCategoricalCrossentropy(from_logits=True)
    y_true, y_pred = _data("sparse_logits", 0)
    mask = np.array([1, 1, 1, 1, 1, 0])
    got = jax.jit(lambda t, p, m: loss(t, p, mask=m))(y_true, y_pred, mask)
    lse = np.log(np.exp(y_pred).sum(-1))
    per_sample = lse - y_pred[np.arange(B), y_true[:, 0]]
    close(got, per_sample[:5].mean())


def test_get_names_and_aliases():
    for name, cls in [
        ("mse", losses.MeanSquaredError),
        ("mae", losses.MeanAbsoluteError),
        ("mape", losses.MeanAbsolutePercentageError),
        ("msle", losses.MeanSquaredLogarithmicError),
        ("kld", losses.KLDivergence),
        ("kl_divergence", losses.KLDivergence),
        ("logcosh", losses.LogCosh),
        ("log_cosh", losses.LogCosh),
        ("huber", losses.Huber),
        ("binary_crossentropy", losses.BinaryCrossentropy),
        ("sparse_categorical_crossentropy", losses.SparseCategoricalCrossentropy),
    ]:
        got = losses.get(name)
        assert type(got) is cls and got.name == name
    got = losses.get("CategoricalCrossentropy")
    assert type(got) is losses.CategoricalCrossentropy
    assert got.name == "categorical_crossentropy"
    instance = losses.Huber(delta=2.0)
    assert losses.get(instance) is instance


def test_get_wraps_callable():
    def my_loss(y_true, y_pred):
        return jnp.mean(jnp.abs(y_true - y_pred), axis=-1)

    loss = losses.get(my_loss)
    assert isinstance(loss, losses.LossFunctionWrapper) and loss.name == "my_loss"
    close(jax.jit(loss)(jnp.zeros((2, 2)), jnp.ones((2, 2))), 1.0)


def test_get_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="mean_squared_error") as info:
        losses.get("mean_sqared_error")
    assert "'mean_sqared_error'" in str(info.value)


def test_get_bad_type():
    with pytest.raises(TypeError, match="int"):
        losses.get(3)


def _scalar_mse(y_true, y_pred):
    return jnp.mean(jnp.square(y_true - y_pred))


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "sum", "mean_with_sample_weight", None])
def test_scalar_loss_reduces_as_keras(keras, reduction, rows):
    """A loss returning a scalar: as it is without weights; with them, Keras's reduce_weighted_values
    (the scalar times the mean weight, times their sum for "sum"; a batch of one row as Keras has it)."""
    rng = np.random.default_rng(0)
    y_true, y_pred = rng.standard_normal((2, rows, 3)).astype(np.float32)
    ours = losses.LossFunctionWrapper(_scalar_mse, reduction=reduction)

    class ScalarMSE(keras.losses.Loss):
        def call(self, y_true, y_pred):
            return keras.ops.mean(keras.ops.square(y_true - y_pred))

    theirs = ScalarMSE(reduction=reduction)
    for sample_weight in (None, np.linspace(0.5, 2.0, rows, dtype=np.float32)):
        close(ours(y_true, y_pred, sample_weight), theirs(y_true, y_pred, sample_weight))
    close(losses.reduce_values(jnp.float32(2.0), jnp.array([1.0, 3.0]), reduction="sum"), 8.0)


def test_scalar_loss_values_cannot_be_masked():
    loss = losses.LossFunctionWrapper(_scalar_mse)
    mask = jnp.array([1.0, 0.0])
    with pytest.raises(ValueError, match=r"Received: a scalar.*real rows only.*jnp.mean\(\.\.\., axis=-1\)"):
        loss(jnp.zeros((2, 2)), jnp.ones((2, 2)), mask=mask)
    with pytest.raises(ValueError, match=r"Received: a scalar.*real rows only"):
        losses.reduce_parts(jnp.float32(1.0), mask=mask)


def test_bad_reduction_lists_allowed():
    with pytest.raises(ValueError, match="sum_over_batch_size") as info:
        losses.MeanSquaredError(reduction="average")
    assert "'average'" in str(info.value)
    with pytest.raises(ValueError, match="mean_with_sample_weight"):
        losses.reduce_values(jnp.ones(2), reduction="auto")
