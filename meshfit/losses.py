"""Losses with the names, arguments and numbers of `keras.losses`.

A `Loss` computes per-sample values with `call(y_true, y_pred)` and reduces them
with `reduce_values`, like Keras 3. meshfit adds one argument, `mask`: a
`(batch,)` array that is 1 for real rows and 0 for the padding rows that make a
partial batch full size. Padding rows contribute to neither the numerator nor
the denominator, so the loss of a padded batch equals the Keras loss of the
unpadded batch.

A loss may also return a scalar (one value for the whole batch), as Keras
accepts; it is reduced as Keras reduces it (with `sample_weight`: the scalar
times the mean weight, or the sum for `"sum"`). A scalar cannot be masked, so
the training steps compute it on the real rows of a partial batch only
(`meshfit.steps.builtin.StepFunctions.with_rows`).

Everything here is pure `jax.numpy` and traceable under `jax.jit`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike, DTypeLike

__all__ = [
    "Loss",
    "LossFunctionWrapper",
    "MeanSquaredError",
    "MeanAbsoluteError",
    "MeanAbsolutePercentageError",
    "MeanSquaredLogarithmicError",
    "CosineSimilarity",
    "Huber",
    "LogCosh",
    "Hinge",
    "SquaredHinge",
    "CategoricalHinge",
    "KLDivergence",
    "Poisson",
    "BinaryCrossentropy",
    "BinaryFocalCrossentropy",
    "CategoricalCrossentropy",
    "CategoricalFocalCrossentropy",
    "SparseCategoricalCrossentropy",
    "mean_squared_error",
    "mean_absolute_error",
    "mean_absolute_percentage_error",
    "mean_squared_logarithmic_error",
    "cosine_similarity",
    "huber",
    "log_cosh",
    "hinge",
    "squared_hinge",
    "categorical_hinge",
    "kl_divergence",
    "poisson",
    "categorical_crossentropy",
    "categorical_focal_crossentropy",
    "sparse_categorical_crossentropy",
    "binary_crossentropy",
    "binary_focal_crossentropy",
    "mse",
    "MSE",
    "mae",
    "MAE",
    "mape",
    "MAPE",
    "msle",
    "MSLE",
    "kld",
    "KLD",
    "logcosh",
    "bce",
    "BCE",
    "get",
]

EPSILON = 1e-7  # keras.backend.epsilon()

REDUCTIONS = (
    "sum_over_batch_size",
    "sum",
    "mean",
    "mean_with_sample_weight",
    "none",
    None,
)


def standardize_reduction(reduction: Any) -> str | None:
    """Returns `reduction` if it is one Keras accepts, else raises ValueError."""
    if reduction not in REDUCTIONS:
        raise ValueError(
            f"Expected `reduction` to be one of {list(REDUCTIONS)}. "
            f"Received: reduction={reduction!r}; pass one of those values "
            '("sum_over_batch_size" is the Keras default).'
        )
    return reduction


def squeeze_or_expand_to_same_rank(
    x1: jax.Array, x2: jax.Array, expand_rank_1: bool = True
) -> tuple[jax.Array, jax.Array]:
    """Squeezes or expands the last axis when the ranks differ by exactly 1.

    Same rule as Keras: a trailing axis of size 1 is squeezed, except that a
    rank-1 partner is expanded instead when `expand_rank_1` is True.
    """
    r1, r2 = x1.ndim, x2.ndim
    if r1 == r2 + 1 and x1.shape[-1] == 1:
        if r2 == 1 and expand_rank_1:
            x2 = jnp.expand_dims(x2, -1)
        else:
            x1 = jnp.squeeze(x1, -1)
    elif r2 == r1 + 1 and x2.shape[-1] == 1:
        if r1 == 1 and expand_rank_1:
            x1 = jnp.expand_dims(x1, -1)
        else:
            x2 = jnp.squeeze(x2, -1)
    return x1, x2


def divide_no_nan(x: ArrayLike, y: ArrayLike) -> jax.Array:
    """`x / y`, with 0 where `y == 0` (Keras's `ops.divide_no_nan`)."""
    safe = jnp.where(y == 0, jnp.ones_like(y), y)
    return jnp.where(y == 0, jnp.zeros_like(x), x / safe)


def align_to(w: jax.Array, values: jax.Array) -> jax.Array:
    """Gives a per-row weight or mask the rank of `values`, aligned on axis 0 (losses and metrics weigh rows alike).

    A `(batch, 1)` weight for `(batch,)` values is squeezed; a `(batch,)` weight
    for `(batch, d, ...)` values gets trailing axes of size 1, so it scales
    whole rows (Keras would broadcast it against the last axis instead).
    """
    if w.ndim == values.ndim + 1 and w.shape[-1] == 1:
        w = jnp.squeeze(w, -1)
    if w.ndim < values.ndim:
        w = jnp.reshape(w, w.shape + (1,) * (values.ndim - w.ndim))
    return w


def combine_masks(value_mask: jax.Array, row_mask: ArrayLike) -> jax.Array:
    """The entries that count: those a loss marks (`value_mask`, values-shaped) in the rows `row_mask` keeps."""
    return value_mask & align_to(jnp.asarray(row_mask).astype(bool), value_mask)


def reduce_values(
    values: ArrayLike,
    sample_weight: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    reduction: str | None = "sum_over_batch_size",
) -> jax.Array:
    """Weights, masks and reduces per-sample loss values like Keras 3.

    Args:
        values: per-sample losses, shape `(batch,)` or `(batch, ...)`.
        sample_weight: optional weights of shape `(batch,)`, `(batch, 1)` or
            the shape of `values`.
        mask: optional `(batch,)` (or `values`-shaped) array, nonzero for rows
            that count. Masked-out entries are zeroed (even if NaN) and left
            out of the denominator; their gradient is 0 as long as they are
            finite (pad with zeros or copies of real rows, not NaN). Not
            with scalar `values` (one value cannot leave rows out).
        reduction: `"sum_over_batch_size"`/`"mean"` (sum divided by the number
            of unmasked entries), `"sum"`, `"mean_with_sample_weight"` (sum
            divided by the sum of unmasked sample weights) or `"none"`/`None`
            (the weighted, masked values).

    Scalar `values` are reduced as Keras 3's `reduce_weighted_values`
    reduces them: returned as they are without `sample_weight`; with it,
    multiplied by the weights and then reduced, so `"sum_over_batch_size"`
    gives the scalar times the mean weight, `"sum"` times their sum and
    `"mean_with_sample_weight"` the scalar itself.

    Returns:
        A scalar, or the weighted values for `"none"`.
    """
    reduction = standardize_reduction(reduction)
    values, sw, m = _weight_and_mask(values, sample_weight, mask)
    if reduction in (None, "none"):
        return values
    total, divisor = _total_and_divisor(values, sw, m, reduction)
    return divide_no_nan(total, divisor)


def _weight_and_mask(
    values: ArrayLike, sample_weight: ArrayLike | None, mask: ArrayLike | None
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """Per-sample values weighted and with masked entries zeroed; also the aligned weights and mask."""
    values = jnp.asarray(values)
    if not jnp.issubdtype(values.dtype, jnp.floating):
        values = values.astype(jnp.float32)
    if values.ndim == 0 and mask is not None:
        raise ValueError(
            "Expected per-sample loss values of shape (batch,) or (batch, ...) to leave out the rows a "
            "`mask` marks. Received: a scalar (shape ()); compute a scalar loss on the real rows only "
            "(without `mask`), or return one value per sample (e.g. `jnp.mean(..., axis=-1)`)."
        )
    sw = m = None
    if sample_weight is not None:
        sw = align_to(jnp.asarray(sample_weight, values.dtype), values)
        values = values * sw
    if mask is not None:
        m = align_to(jnp.asarray(mask).astype(bool), values)
        values = jnp.where(m, values, jnp.zeros((), values.dtype))
    return values, sw, m


def reduce_parts(
    values: ArrayLike,
    sample_weight: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    reduction: str | None = "sum_over_batch_size",
) -> tuple[jax.Array, jax.Array]:
    """`(total, divisor)` such that `reduce_values(...) == divide_no_nan(total, divisor)`.

    For a training step: differentiating `total` and dividing the gradients
    once afterwards lets the divisor (rows counted over all replicas) be
    reduced together with the gradients, instead of in a collective of its
    own before the backward pass. `reduction` must be a scalar one.
    """
    reduction = standardize_reduction(reduction)
    if reduction in (None, "none"):
        raise ValueError("reduce_parts needs a scalar reduction; received reduction='none'.")
    values, sw, m = _weight_and_mask(values, sample_weight, mask)
    return _total_and_divisor(values, sw, m, reduction)


def _total_and_divisor(
    values: jax.Array, sw: jax.Array | None, m: jax.Array | None, reduction: str | None
) -> tuple[jax.Array, jax.Array]:
    if values.ndim == 0:  # a scalar loss (weighted by a one-row weight): Keras returns it as it is
        return values, jnp.ones((), values.dtype)
    total = jnp.sum(values)
    if reduction == "sum":
        return total, jnp.ones((), values.dtype)
    if reduction == "mean_with_sample_weight" and sw is not None:
        divisor = sw if m is None else jnp.where(m, sw, 0)
        divisor = jnp.sum(divisor)
    elif m is None:
        divisor = jnp.asarray(values.size, values.dtype)
    else:
        divisor = jnp.sum(jnp.broadcast_to(m, values.shape), dtype=values.dtype)
    return total, divisor.astype(values.dtype)


def to_snake_case(name: str) -> str:
    """Keras's `to_snake_case` ("MeanSquaredError" -> "mean_squared_error"): a loss's or metric's default name."""
    name = re.sub(r"\W+", "", name)
    name = re.sub("(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub("([a-z])([A-Z])", r"\1_\2", name).lower()


def _float(x: ArrayLike) -> jax.Array:
    x = jnp.asarray(x)
    return x if jnp.issubdtype(x.dtype, jnp.floating) else x.astype(jnp.float32)


# ---------------------------------------------------------------------------
# Functional forms: per-sample values, same formulas as keras.losses.
# ---------------------------------------------------------------------------


def mean_squared_error(y_true: ArrayLike, y_pred: ArrayLike) -> jax.Array:
    """Mean of `(y_true - y_pred) ** 2` over the last axis."""
    y_pred = _float(y_pred)
    y_true, y_pred = squeeze_or_expand_to_same_rank(jnp.asarray(y_true, y_pred.dtype), y_pred)
    return jnp.mean(jnp.square(y_true - y_pred), axis=-1)


def mean_absolute_error(y_true: ArrayLike, y_pred: ArrayLike) -> jax.Array:
    """Mean of `|y_true - y_pred|` over the last axis."""
    y_pred = _float(y_pred)
    y_true, y_pred = squeeze_or_expand_to_same_rank(jnp.asarray(y_true, y_pred.dtype), y_pred)
    return jnp.mean(jnp.abs(y_true - y_pred), axis=-1)


def mean_absolute_percentage_error(y_true: ArrayLike, y_pred: ArrayLike) -> jax.Array:
    """`100 * mean(|y_true - y_pred| / max(|y_true|, eps))` over the last axis."""
    y_pred = _float(y_pred)
    y_true, y_pred = squeeze_or_expand_to_same_rank(jnp.asarray(y_true, y_pred.dtype), y_pred)
    diff = jnp.abs((y_true - y_pred) / jnp.maximum(jnp.abs(y_true), EPSILON))
    return 100.0 * jnp.mean(diff, axis=-1)


def mean_squared_logarithmic_error(y_true: ArrayLike, y_pred: ArrayLike) -> jax.Array:
    """Mean of `(log(max(y_pred, eps) + 1) - log(max(y_true, eps) + 1)) ** 2`."""
    y_pred = _float(y_pred)
    y_true, y_pred = squeeze_or_expand_to_same_rank(jnp.asarray(y_true, y_pred.dtype), y_pred)
    first_log = jnp.log(jnp.maximum(y_pred, EPSILON) + 1.0)
    second_log = jnp.log(jnp.maximum(y_true, EPSILON) + 1.0)
    return jnp.mean(jnp.square(first_log - second_log), axis=-1)


def _l2_normalize(x: ArrayLike, axis: int) -> jax.Array:
    """Keras's `ops.normalize`: `x * min(rsqrt(sum(x ** 2)), 1 / eps)`."""
    square_sum = jnp.sum(jnp.square(x), axis=axis, keepdims=True)
    return x * jnp.minimum(jax.lax.rsqrt(square_sum), 1.0 / EPSILON)


def cosine_similarity(y_true: ArrayLike, y_pred: ArrayLike, axis: int = -1) -> jax.Array:
    """Negative cosine similarity along `axis` (-1 is most similar)."""
    y_pred = _float(y_pred)
    y_true, y_pred = squeeze_or_expand_to_same_rank(jnp.asarray(y_true, y_pred.dtype), y_pred)
    return -jnp.sum(_l2_normalize(y_true, axis) * _l2_normalize(y_pred, axis), axis=axis)


def huber(y_true: ArrayLike, y_pred: ArrayLike, delta: float = 1.0) -> jax.Array:
    """Huber loss: quadratic for `|error| <= delta`, linear beyond."""
    y_pred = _float(y_pred)
    y_true, y_pred = squeeze_or_expand_to_same_rank(jnp.asarray(y_true, y_pred.dtype), y_pred)
    delta = jnp.asarray(delta, y_pred.dtype)
    error = y_pred - y_true
    abs_error = jnp.abs(error)
    return jnp.mean(
        jnp.where(
            abs_error <= delta,
            0.5 * jnp.square(error),
            delta * abs_error - 0.5 * jnp.square(delta),
        ),
        axis=-1,
    )


def log_cosh(y_true: ArrayLike, y_pred: ArrayLike) -> jax.Array:
    """Mean of `log(cosh(y_pred - y_true))`, computed without overflow."""
    y_pred = _float(y_pred)
    y_true, y_pred = squeeze_or_expand_to_same_rank(jnp.asarray(y_true, y_pred.dtype), y_pred)
    x = y_pred - y_true
    return jnp.mean(x + jax.nn.softplus(-2.0 * x) - jnp.log(2.0).astype(x.dtype), axis=-1)


def _to_hinge_labels(y_true: ArrayLike) -> jax.Array:
    """Maps {0, 1} labels to {-1, 1}; other labels are left as they are.

    As in Keras, the test looks at the whole batch, so padding rows should
    hold valid labels (zeros or copies of real rows do).
    """
    is_binary = jnp.all((y_true == 0) | (y_true == 1))
    return jnp.where(is_binary, 2.0 * y_true - 1.0, y_true)


def hinge(y_true: ArrayLike, y_pred: ArrayLike) -> jax.Array:
    """Mean of `max(1 - y_true * y_pred, 0)`; labels in {-1, 1} or {0, 1}."""
    y_pred = _float(y_pred)
    y_true = _to_hinge_labels(jnp.asarray(y_true, y_pred.dtype))
    return jnp.mean(jnp.maximum(1.0 - y_true * y_pred, 0.0), axis=-1)


def squared_hinge(y_true: ArrayLike, y_pred: ArrayLike) -> jax.Array:
    """Mean of `max(1 - y_true * y_pred, 0) ** 2`; labels in {-1, 1} or {0, 1}."""
    y_pred = _float(y_pred)
    y_true = _to_hinge_labels(jnp.asarray(y_true, y_pred.dtype))
    return jnp.mean(jnp.square(jnp.maximum(1.0 - y_true * y_pred, 0.0)), axis=-1)


def categorical_hinge(y_true: ArrayLike, y_pred: ArrayLike) -> jax.Array:
    """`max(max((1 - y_true) * y_pred) - sum(y_true * y_pred) + 1, 0)`."""
    y_pred = _float(y_pred)
    y_true = jnp.asarray(y_true, y_pred.dtype)
    pos = jnp.sum(y_true * y_pred, axis=-1)
    neg = jnp.max((1.0 - y_true) * y_pred, axis=-1)
    return jnp.maximum(neg - pos + 1.0, 0.0)


def kl_divergence(y_true: ArrayLike, y_pred: ArrayLike) -> jax.Array:
    """`sum(y_true * log(y_true / y_pred))`, both clipped to `[eps, 1]`."""
    y_pred = _float(y_pred)
    y_true = jnp.clip(jnp.asarray(y_true, y_pred.dtype), EPSILON, 1)
    y_pred = jnp.clip(y_pred, EPSILON, 1)
    return jnp.sum(y_true * jnp.log(y_true / y_pred), axis=-1)


def poisson(y_true: ArrayLike, y_pred: ArrayLike) -> jax.Array:
    """Mean of `y_pred - y_true * log(y_pred + eps)`."""
    y_pred = _float(y_pred)
    y_true = jnp.asarray(y_true, y_pred.dtype)
    return jnp.mean(y_pred - y_true * jnp.log(y_pred + EPSILON), axis=-1)


def _log_probs(y_pred: ArrayLike, from_logits: bool, axis: int) -> jax.Array:
    """Log-probabilities: `log_softmax` of logits, or Keras's clipped log."""
    if from_logits:
        return jax.nn.log_softmax(y_pred, axis=axis)
    y_pred = y_pred / jnp.sum(y_pred, axis=axis, keepdims=True)
    return jnp.log(jnp.clip(y_pred, EPSILON, 1.0 - EPSILON))


def _smooth_categorical(y_true: ArrayLike, label_smoothing: float) -> jax.Array:
    if not label_smoothing:
        return y_true
    num_classes = y_true.shape[-1]
    return y_true * (1.0 - label_smoothing) + label_smoothing / num_classes


def _check_axis(axis: Any) -> None:
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise ValueError(f"Expected `axis` to be an int. Received: axis={axis!r}; pass the class axis, e.g. -1.")


def categorical_crossentropy(
    y_true: ArrayLike, y_pred: ArrayLike, from_logits: bool = False, label_smoothing: float = 0.0, axis: int = -1
) -> jax.Array:
    """Cross-entropy between one-hot (or soft) labels and predictions.

    Args:
        y_true: labels, same shape as `y_pred`.
        y_pred: probabilities, or logits when `from_logits=True`.
        from_logits: whether `y_pred` holds logits.
        label_smoothing: in `[0, 1]`; labels become
            `y_true * (1 - s) + s / num_classes`.
        axis: the class axis.
    """
    _check_axis(axis)
    y_pred = _float(y_pred)
    y_true = _smooth_categorical(jnp.asarray(y_true, y_pred.dtype), label_smoothing)
    if y_true.shape != y_pred.shape:
        raise ValueError(
            "Expected `y_true` and `y_pred` of the same shape. Received: "
            f"y_true.shape={y_true.shape}, y_pred.shape={y_pred.shape}; use "
            "sparse_categorical_crossentropy for integer labels."
        )
    return -jnp.sum(y_true * _log_probs(y_pred, from_logits, axis), axis=axis)


def categorical_focal_crossentropy(
    y_true: ArrayLike,
    y_pred: ArrayLike,
    alpha: float = 0.25,
    gamma: float = 2.0,
    from_logits: bool = False,
    label_smoothing: float = 0.0,
    axis: int = -1,
) -> jax.Array:
    """Focal cross-entropy: `alpha * (1 - p) ** gamma * CE`, summed over classes."""
    _check_axis(axis)
    y_pred = _float(y_pred)
    y_true = _smooth_categorical(jnp.asarray(y_true, y_pred.dtype), label_smoothing)
    if from_logits:
        y_pred = jax.nn.softmax(y_pred, axis=axis)
    output = y_pred / jnp.sum(y_pred, axis=axis, keepdims=True)
    output = jnp.clip(output, EPSILON, 1.0 - EPSILON)
    cce = -y_true * jnp.log(output)
    weighting = jnp.power(1.0 - output, gamma) * alpha
    return jnp.sum(weighting * cce, axis=axis)


def sparse_crossentropy_and_mask(
    y_true: ArrayLike, y_pred: ArrayLike, from_logits: bool, ignore_class: int | None, axis: int
) -> tuple[jax.Array, jax.Array | None]:
    """Sparse cross-entropy values and, with `ignore_class`, the mask of the entries that count (else `None`).

    The loss and the `SparseCategoricalCrossentropy` metric both leave the ignored entries out of their mean.
    """
    y_pred = _float(y_pred)
    y_true = jnp.asarray(y_true)
    if y_true.ndim == y_pred.ndim and y_true.shape[axis] == 1:
        y_true = jnp.squeeze(y_true, axis=axis)
    valid = None
    if ignore_class is not None:
        valid = y_true != ignore_class
        y_true = jnp.where(valid, y_true, 0)
        y_pred = jnp.where(jnp.expand_dims(valid, axis), y_pred, 0.0)
    labels = y_true.astype(jnp.int32)
    class_axis = axis % y_pred.ndim
    expected = tuple(d for i, d in enumerate(y_pred.shape) if i != class_axis)
    if labels.shape != expected:
        raise ValueError(
            f"Expected `y_true` of shape {expected} (y_pred's shape without the "
            f"class axis, optionally with a trailing 1). Received: "
            f"y_true.shape={labels.shape}, y_pred.shape={y_pred.shape}; pass "
            "integer class ids, or use categorical_crossentropy for one-hot labels."
        )
    log_prob = _log_probs(y_pred, from_logits, axis)
    one_hot = jax.nn.one_hot(labels, y_pred.shape[axis], dtype=y_pred.dtype, axis=axis)
    res = -jnp.sum(one_hot * log_prob, axis=axis)
    if valid is not None:
        res = jnp.where(valid, res, 0.0)
    return res, valid


def sparse_categorical_crossentropy(
    y_true: ArrayLike, y_pred: ArrayLike, from_logits: bool = False, ignore_class: int | None = None, axis: int = -1
) -> jax.Array:
    """Cross-entropy between integer labels and predictions.

    Args:
        y_true: class ids of shape `(batch, ...)` or `(batch, ..., 1)`, int or
            float.
        y_pred: probabilities, or logits when `from_logits=True`, with the
            classes on `axis`.
        from_logits: whether `y_pred` holds logits.
        ignore_class: optional label whose entries get a loss of 0 (the
            `SparseCategoricalCrossentropy` class also leaves them out of the
            mean).
        axis: the class axis.
    """
    return sparse_crossentropy_and_mask(y_true, y_pred, from_logits, ignore_class, axis)[0]


def _binary_ce_elementwise(y_true: ArrayLike, y_pred: ArrayLike, from_logits: bool) -> jax.Array:
    if from_logits:
        return -y_true * jax.nn.log_sigmoid(y_pred) - (1.0 - y_true) * (jax.nn.log_sigmoid(-y_pred))
    y_pred = jnp.clip(y_pred, EPSILON, 1.0 - EPSILON)
    bce = y_true * jnp.log(y_pred)
    bce += (1.0 - y_true) * jnp.log(1.0 - y_pred)
    return -bce


def binary_crossentropy(
    y_true: ArrayLike, y_pred: ArrayLike, from_logits: bool = False, label_smoothing: float = 0.0, axis: int = -1
) -> jax.Array:
    """Binary cross-entropy, averaged over `axis`.

    Args:
        y_true: 0/1 labels, same shape as `y_pred`.
        y_pred: probabilities, or logits when `from_logits=True`.
        from_logits: whether `y_pred` holds logits (numerically stabler).
        label_smoothing: in `[0, 1]`; labels are squeezed towards 0.5.
        axis: the axis to average over.
    """
    y_pred = _float(y_pred)
    y_true = jnp.asarray(y_true, y_pred.dtype)
    if label_smoothing:
        y_true = y_true * (1.0 - label_smoothing) + 0.5 * label_smoothing
    return jnp.mean(_binary_ce_elementwise(y_true, y_pred, from_logits), axis=axis)


def binary_focal_crossentropy(
    y_true: ArrayLike,
    y_pred: ArrayLike,
    apply_class_balancing: bool = False,
    alpha: float = 0.25,
    gamma: float = 2.0,
    from_logits: bool = False,
    label_smoothing: float = 0.0,
    axis: int = -1,
) -> jax.Array:
    """Binary cross-entropy scaled by the focal factor `(1 - p_t) ** gamma`."""
    y_pred = _float(y_pred)
    y_true = jnp.asarray(y_true, y_pred.dtype)
    if label_smoothing:
        y_true = y_true * (1.0 - label_smoothing) + 0.5 * label_smoothing
    if from_logits:
        y_pred = jax.nn.sigmoid(y_pred)
    bce = _binary_ce_elementwise(y_true, y_pred, from_logits=False)
    p_t = y_true * y_pred + (1 - y_true) * (1 - y_pred)
    focal_bce = jnp.power(1.0 - p_t, gamma) * bce
    if apply_class_balancing:
        focal_bce = (y_true * alpha + (1 - y_true) * (1 - alpha)) * focal_bce
    return jnp.mean(focal_bce, axis=axis)


# Short names, as in Keras.
mse = MSE = mean_squared_error
mae = MAE = mean_absolute_error
mape = MAPE = mean_absolute_percentage_error
msle = MSLE = mean_squared_logarithmic_error
kld = KLD = kl_divergence
logcosh = log_cosh
bce = BCE = binary_crossentropy


# ---------------------------------------------------------------------------
# Loss classes.
# ---------------------------------------------------------------------------


class Loss:
    """Base class: per-sample `call` plus the Keras reduction in `__call__`.

    Subclasses implement `call(y_true, y_pred)`, returning per-sample losses of
    shape `(batch,)` or `(batch, ...)`, or a scalar for the whole batch (the
    steps then compute it on a partial batch's real rows; see `reduce_values`).

    Args:
        name: name of the loss; defaults to the snake-cased class name.
        reduction: one of `"sum_over_batch_size"` (default), `"sum"`,
            `"mean"`, `"mean_with_sample_weight"`, `"none"` or `None`.
        dtype: dtype the inputs are cast to; defaults to `"float32"`.
    """

    def __init__(
        self, name: str | None = None, reduction: str | None = "sum_over_batch_size", dtype: DTypeLike | None = None
    ) -> None:
        self.name = name or to_snake_case(type(self).__name__)
        self.reduction = standardize_reduction(reduction)
        self.dtype = jnp.dtype(dtype or "float32")

    def call(self, y_true: ArrayLike, y_pred: ArrayLike) -> jax.Array:
        raise NotImplementedError(f"{type(self).__name__} must implement `call(y_true, y_pred)`.")

    def values_and_mask(self, y_true: ArrayLike, y_pred: ArrayLike) -> tuple[jax.Array, jax.Array | None]:
        """Per-sample values and an optional mask of the entries that count (None: all of them).

        `SparseCategoricalCrossentropy(ignore_class=...)` leaves the ignored
        entries out of the mean this way; the training step combines this
        mask with the padding mask.
        """
        return self.call(y_true, y_pred), None

    def __call__(
        self,
        y_true: ArrayLike,
        y_pred: ArrayLike,
        sample_weight: ArrayLike | None = None,
        mask: ArrayLike | None = None,
    ) -> jax.Array:
        """Returns the reduced loss.

        Args:
            y_true: labels.
            y_pred: predictions.
            sample_weight: optional `(batch,)` or values-shaped weights.
            mask: optional `(batch,)` array, 0 for padding rows to leave out.
        """
        y_true = jax.tree.map(lambda x: jnp.asarray(x, self.dtype), y_true)
        y_pred = jax.tree.map(lambda x: jnp.asarray(x, self.dtype), y_pred)
        values, value_mask = self.values_and_mask(y_true, y_pred)
        values = jnp.asarray(values)
        if values.ndim == 0 and mask is not None:
            raise ValueError(
                f"Expected loss `{self.name}` to return per-sample values of shape (batch,) or (batch, ...) "
                "to leave out the rows `mask` marks. Received: a scalar (shape ()); call it on the real rows "
                "only, without `mask`, or return one value per sample (e.g. `jnp.mean(..., axis=-1)`)."
            )
        if value_mask is not None:
            mask = value_mask if mask is None else combine_masks(value_mask, mask)
        return reduce_values(values, sample_weight, mask, self.reduction)

    def get_config(self) -> dict[str, Any]:
        """The constructor's arguments: `type(self)(**self.get_config())` is an equal loss.

        A subclass with arguments of its own adds them (`model.save` writes
        the config of meshfit's built-in losses, and `load_model` rebuilds them).
        """
        return {"name": self.name, "reduction": self.reduction, "dtype": self.dtype.name}

    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self.name}>"


class LossFunctionWrapper(Loss):
    """Wraps `fn(y_true, y_pred, **kwargs) -> per-sample values` as a `Loss`.

    Args:
        fn: the loss function; it returns per-sample values, shape
            `(batch,)` or `(batch, ...)`, or a scalar for the whole batch.
        name: name of the loss; defaults to the function's snake-cased name.
        reduction: see `Loss`.
        dtype: see `Loss`.
        **kwargs: extra keyword arguments passed to `fn`.
    """

    def __init__(
        self,
        fn: Callable,
        name: str | None = None,
        reduction: str | None = "sum_over_batch_size",
        dtype: DTypeLike | None = None,
        **kwargs: Any,
    ) -> None:
        if not callable(fn):
            raise TypeError(
                f"Expected a callable loss function. Received: fn={fn!r} of "
                f"type {type(fn).__name__}; pass a function (y_true, y_pred)."
            )
        name = name or to_snake_case(getattr(fn, "__name__", "loss"))
        super().__init__(name=name, reduction=reduction, dtype=dtype)
        self.fn = fn
        self._fn_kwargs = kwargs
        for key, value in kwargs.items():  # Keras exposes these as attributes
            setattr(self, key, value)

    def call(self, y_true: ArrayLike, y_pred: ArrayLike) -> jax.Array:
        if hasattr(y_true, "ndim") and hasattr(y_pred, "ndim"):
            y_true, y_pred = squeeze_or_expand_to_same_rank(jnp.asarray(y_true), jnp.asarray(y_pred))
        return self.fn(y_true, y_pred, **self._fn_kwargs)

    def get_config(self) -> dict[str, Any]:
        """`Loss.get_config` plus the keyword arguments of `fn`, and `fn` itself where `__init__` takes it.

        The built-in subclasses take `fn`'s arguments (`delta`, `from_logits`,
        ...) as their own and fix `fn`; the wrapper itself takes `fn`.
        """
        config = {**super().get_config(), **self._fn_kwargs}
        if type(self).__init__ is LossFunctionWrapper.__init__:
            config["fn"] = self.fn
        return config

    def __repr__(self) -> str:
        return f"<LossFunctionWrapper({self.fn}, kwargs={self._fn_kwargs})>"


class MeanSquaredError(LossFunctionWrapper):
    """Mean of squares of errors between labels and predictions."""

    def __init__(
        self,
        reduction: str | None = "sum_over_batch_size",
        name: str | None = "mean_squared_error",
        dtype: DTypeLike | None = None,
    ) -> None:
        super().__init__(mean_squared_error, name=name, reduction=reduction, dtype=dtype)


class MeanAbsoluteError(LossFunctionWrapper):
    """Mean of absolute differences between labels and predictions."""

    def __init__(
        self,
        reduction: str | None = "sum_over_batch_size",
        name: str | None = "mean_absolute_error",
        dtype: DTypeLike | None = None,
    ) -> None:
        super().__init__(mean_absolute_error, name=name, reduction=reduction, dtype=dtype)


class MeanAbsolutePercentageError(LossFunctionWrapper):
    """`100 * mean(|y_true - y_pred| / |y_true|)`."""

    def __init__(
        self,
        reduction: str | None = "sum_over_batch_size",
        name: str | None = "mean_absolute_percentage_error",
        dtype: DTypeLike | None = None,
    ) -> None:
        super().__init__(mean_absolute_percentage_error, name=name, reduction=reduction, dtype=dtype)


class MeanSquaredLogarithmicError(LossFunctionWrapper):
    """Mean of `(log(y_pred + 1) - log(y_true + 1)) ** 2`."""

    def __init__(
        self,
        reduction: str | None = "sum_over_batch_size",
        name: str | None = "mean_squared_logarithmic_error",
        dtype: DTypeLike | None = None,
    ) -> None:
        super().__init__(mean_squared_logarithmic_error, name=name, reduction=reduction, dtype=dtype)


class CosineSimilarity(LossFunctionWrapper):
    """Negative cosine similarity; -1 means the vectors point the same way.

    Args:
        axis: the feature axis along which similarity is computed.
    """

    def __init__(
        self,
        axis: int = -1,
        reduction: str | None = "sum_over_batch_size",
        name: str | None = "cosine_similarity",
        dtype: DTypeLike | None = None,
    ) -> None:
        super().__init__(cosine_similarity, name=name, reduction=reduction, dtype=dtype, axis=axis)


class Huber(LossFunctionWrapper):
    """Huber loss: quadratic below `delta`, linear above.

    Args:
        delta: the error size where the loss turns linear.
    """

    def __init__(
        self,
        delta: float = 1.0,
        reduction: str | None = "sum_over_batch_size",
        name: str | None = "huber_loss",
        dtype: DTypeLike | None = None,
    ) -> None:
        super().__init__(huber, name=name, reduction=reduction, dtype=dtype, delta=delta)


class LogCosh(LossFunctionWrapper):
    """Logarithm of the hyperbolic cosine of the prediction error."""

    def __init__(
        self,
        reduction: str | None = "sum_over_batch_size",
        name: str | None = "log_cosh",
        dtype: DTypeLike | None = None,
    ) -> None:
        super().__init__(log_cosh, name=name, reduction=reduction, dtype=dtype)


class Hinge(LossFunctionWrapper):
    """Hinge loss; {0, 1} labels are mapped to {-1, 1}."""

    def __init__(
        self, reduction: str | None = "sum_over_batch_size", name: str | None = "hinge", dtype: DTypeLike | None = None
    ) -> None:
        super().__init__(hinge, name=name, reduction=reduction, dtype=dtype)


class SquaredHinge(LossFunctionWrapper):
    """Squared hinge loss; {0, 1} labels are mapped to {-1, 1}."""

    def __init__(
        self,
        reduction: str | None = "sum_over_batch_size",
        name: str | None = "squared_hinge",
        dtype: DTypeLike | None = None,
    ) -> None:
        super().__init__(squared_hinge, name=name, reduction=reduction, dtype=dtype)


class CategoricalHinge(LossFunctionWrapper):
    """Categorical hinge loss for one-hot labels."""

    def __init__(
        self,
        reduction: str | None = "sum_over_batch_size",
        name: str | None = "categorical_hinge",
        dtype: DTypeLike | None = None,
    ) -> None:
        super().__init__(categorical_hinge, name=name, reduction=reduction, dtype=dtype)


class KLDivergence(LossFunctionWrapper):
    """Kullback-Leibler divergence `sum(y_true * log(y_true / y_pred))`."""

    def __init__(
        self,
        reduction: str | None = "sum_over_batch_size",
        name: str | None = "kl_divergence",
        dtype: DTypeLike | None = None,
    ) -> None:
        super().__init__(kl_divergence, name=name, reduction=reduction, dtype=dtype)


class Poisson(LossFunctionWrapper):
    """Poisson loss `mean(y_pred - y_true * log(y_pred))`."""

    def __init__(
        self,
        reduction: str | None = "sum_over_batch_size",
        name: str | None = "poisson",
        dtype: DTypeLike | None = None,
    ) -> None:
        super().__init__(poisson, name=name, reduction=reduction, dtype=dtype)


class BinaryCrossentropy(LossFunctionWrapper):
    """Cross-entropy for binary (0 or 1) labels.

    Args:
        from_logits: whether `y_pred` holds logits rather than probabilities.
        label_smoothing: in `[0, 1]`; squeezes labels towards 0.5.
        axis: the axis averaged over.
    """

    def __init__(
        self,
        from_logits: bool = False,
        label_smoothing: float = 0.0,
        axis: int = -1,
        reduction: str | None = "sum_over_batch_size",
        name: str | None = "binary_crossentropy",
        dtype: DTypeLike | None = None,
    ) -> None:
        super().__init__(
            binary_crossentropy,
            name=name,
            reduction=reduction,
            dtype=dtype,
            from_logits=from_logits,
            label_smoothing=label_smoothing,
            axis=axis,
        )


class BinaryFocalCrossentropy(LossFunctionWrapper):
    """Binary cross-entropy down-weighting easy examples (Lin et al., 2018).

    Args:
        apply_class_balancing: whether to weight class 1 by `alpha` and class
            0 by `1 - alpha`.
        alpha: the class-1 weight used with `apply_class_balancing`.
        gamma: the focusing parameter; 0 gives plain binary cross-entropy.
        from_logits: whether `y_pred` holds logits.
        label_smoothing: in `[0, 1]`; squeezes labels towards 0.5.
        axis: the axis averaged over.
    """

    def __init__(
        self,
        apply_class_balancing: bool = False,
        alpha: float = 0.25,
        gamma: float = 2.0,
        from_logits: bool = False,
        label_smoothing: float = 0.0,
        axis: int = -1,
        reduction: str | None = "sum_over_batch_size",
        name: str | None = "binary_focal_crossentropy",
        dtype: DTypeLike | None = None,
    ) -> None:
        super().__init__(
            binary_focal_crossentropy,
            name=name,
            reduction=reduction,
            dtype=dtype,
            apply_class_balancing=apply_class_balancing,
            alpha=alpha,
            gamma=gamma,
            from_logits=from_logits,
            label_smoothing=label_smoothing,
            axis=axis,
        )


class CategoricalCrossentropy(LossFunctionWrapper):
    """Cross-entropy for one-hot labels.

    Args:
        from_logits: whether `y_pred` holds logits rather than probabilities.
        label_smoothing: in `[0, 1]`; labels become
            `y_true * (1 - s) + s / num_classes`.
        axis: the class axis.
    """

    def __init__(
        self,
        from_logits: bool = False,
        label_smoothing: float = 0.0,
        axis: int = -1,
        reduction: str | None = "sum_over_batch_size",
        name: str | None = "categorical_crossentropy",
        dtype: DTypeLike | None = None,
    ) -> None:
        _check_axis(axis)
        super().__init__(
            categorical_crossentropy,
            name=name,
            reduction=reduction,
            dtype=dtype,
            from_logits=from_logits,
            label_smoothing=label_smoothing,
            axis=axis,
        )


class CategoricalFocalCrossentropy(LossFunctionWrapper):
    """Alpha-balanced focal cross-entropy for one-hot labels.

    Args:
        alpha: weight of every class (scalar or one value per class).
        gamma: the focusing parameter.
        from_logits: whether `y_pred` holds logits.
        label_smoothing: in `[0, 1]`, as in `CategoricalCrossentropy`.
        axis: the class axis.
    """

    def __init__(
        self,
        alpha: float = 0.25,
        gamma: float = 2.0,
        from_logits: bool = False,
        label_smoothing: float = 0.0,
        axis: int = -1,
        reduction: str | None = "sum_over_batch_size",
        name: str | None = "categorical_focal_crossentropy",
        dtype: DTypeLike | None = None,
    ) -> None:
        _check_axis(axis)
        super().__init__(
            categorical_focal_crossentropy,
            name=name,
            reduction=reduction,
            dtype=dtype,
            alpha=alpha,
            gamma=gamma,
            from_logits=from_logits,
            label_smoothing=label_smoothing,
            axis=axis,
        )


class SparseCategoricalCrossentropy(LossFunctionWrapper):
    """Cross-entropy for integer labels.

    Args:
        from_logits: whether `y_pred` holds logits rather than probabilities.
        ignore_class: optional label to ignore (e.g. a padding class in
            segmentation); its entries count in neither the sum nor the mean.
        axis: the class axis.
    """

    def __init__(
        self,
        from_logits: bool = False,
        ignore_class: int | None = None,
        reduction: str | None = "sum_over_batch_size",
        axis: int = -1,
        name: str | None = "sparse_categorical_crossentropy",
        dtype: DTypeLike | None = None,
    ) -> None:
        super().__init__(
            sparse_categorical_crossentropy,
            name=name,
            reduction=reduction,
            dtype=dtype,
            from_logits=from_logits,
            ignore_class=ignore_class,
            axis=axis,
        )

    def values_and_mask(self, y_true: ArrayLike, y_pred: ArrayLike) -> tuple[jax.Array, jax.Array | None]:
        y_true, y_pred = squeeze_or_expand_to_same_rank(jnp.asarray(y_true), jnp.asarray(y_pred))
        return sparse_crossentropy_and_mask(y_true, y_pred, self.from_logits, self.ignore_class, self.axis)


# ---------------------------------------------------------------------------
# Lookup.
# ---------------------------------------------------------------------------

_CLASSES = (
    MeanSquaredError,
    MeanAbsoluteError,
    MeanAbsolutePercentageError,
    MeanSquaredLogarithmicError,
    CosineSimilarity,
    Huber,
    LogCosh,
    Hinge,
    SquaredHinge,
    CategoricalHinge,
    KLDivergence,
    Poisson,
    BinaryCrossentropy,
    BinaryFocalCrossentropy,
    CategoricalCrossentropy,
    CategoricalFocalCrossentropy,
    SparseCategoricalCrossentropy,
)

# Function names and short aliases (as in keras.losses), plus "logcosh" and
# "kullback_leibler_divergence" from Keras's legacy aliases.
_FUNCTION_NAMES = {
    "mean_squared_error": MeanSquaredError,
    "mse": MeanSquaredError,
    "MSE": MeanSquaredError,
    "mean_absolute_error": MeanAbsoluteError,
    "mae": MeanAbsoluteError,
    "MAE": MeanAbsoluteError,
    "mean_absolute_percentage_error": MeanAbsolutePercentageError,
    "mape": MeanAbsolutePercentageError,
    "MAPE": MeanAbsolutePercentageError,
    "mean_squared_logarithmic_error": MeanSquaredLogarithmicError,
    "msle": MeanSquaredLogarithmicError,
    "MSLE": MeanSquaredLogarithmicError,
    "cosine_similarity": CosineSimilarity,
    "huber": Huber,
    "log_cosh": LogCosh,
    "logcosh": LogCosh,
    "hinge": Hinge,
    "squared_hinge": SquaredHinge,
    "categorical_hinge": CategoricalHinge,
    "kl_divergence": KLDivergence,
    "kld": KLDivergence,
    "KLD": KLDivergence,
    "kullback_leibler_divergence": KLDivergence,
    "poisson": Poisson,
    "binary_crossentropy": BinaryCrossentropy,
    "bce": BinaryCrossentropy,
    "BCE": BinaryCrossentropy,
    "binary_focal_crossentropy": BinaryFocalCrossentropy,
    "categorical_crossentropy": CategoricalCrossentropy,
    "categorical_focal_crossentropy": CategoricalFocalCrossentropy,
    "sparse_categorical_crossentropy": SparseCategoricalCrossentropy,
}
_CLASS_NAMES = {cls.__name__: cls for cls in _CLASSES}


def get(identifier: Any) -> Loss:
    """Returns a `Loss` for a name, a `Loss` instance or a callable.

    Strings are Keras function names and aliases (`"mse"`, `"mae"`, `"mape"`,
    `"msle"`, `"kld"`, `"bce"`, `"huber"`, `"log_cosh"`/`"logcosh"`, ...), which
    give the default-configured loss named by the string (as Keras's compile
    does), or class names (`"MeanSquaredError"`), which give the loss with its
    default name. A `Loss` is returned as is; any other callable
    `(y_true, y_pred) -> per-sample values (or a scalar)` is wrapped in `LossFunctionWrapper`.

    Args:
        identifier: a string, `Loss` or callable.
    """
    if isinstance(identifier, Loss):
        return identifier
    if isinstance(identifier, str):
        if identifier in _FUNCTION_NAMES:
            return _FUNCTION_NAMES[identifier](name=identifier)
        if identifier in _CLASS_NAMES:
            return _CLASS_NAMES[identifier]()
        valid = sorted({*_FUNCTION_NAMES, *_CLASS_NAMES})
        raise ValueError(
            f"Expected a known loss name. Received: identifier={identifier!r}; "
            f"use one of {valid}, a meshfit.losses.Loss, or a callable."
        )
    if isinstance(identifier, type) and issubclass(identifier, Loss):
        return identifier()
    if callable(identifier):
        return LossFunctionWrapper(identifier)
    raise TypeError(
        "Expected a loss name (str), a meshfit.losses.Loss or a callable "
        f"(y_true, y_pred) -> per-sample losses. Received: "
        f"identifier={identifier!r} of type {type(identifier).__name__}."
    )
