"""Metrics with the names, arguments and numbers of `keras.metrics`, as pure state.

A `Metric` works like an optax transformation: `init()` gives a pytree of
float32 zero accumulators, `update(state, y_true, y_pred, sample_weight)` returns
a new state, and `compute(state)` gives the scalar result. Accumulators are sums
and counts, so states from several replicas or processes combine by summing
(`Metric.merge`), never by averaging averages. A sample weight of 0 means "not
counted": meshfit passes 0 for the padding rows of partial batches.

`update_state` / `result` / `reset_state` give the eager Keras interface on one
internal state, for use outside a jitted step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from meshfit import losses as losses_lib
from meshfit.losses import (
    EPSILON,
    align_to,
    divide_no_nan,
    squeeze_or_expand_to_same_rank,
    to_snake_case,
)

__all__ = [
    "Metric",
    "Sum",
    "Mean",
    "MeanMetricWrapper",
    "Accuracy",
    "BinaryAccuracy",
    "CategoricalAccuracy",
    "SparseCategoricalAccuracy",
    "TopKCategoricalAccuracy",
    "SparseTopKCategoricalAccuracy",
    "MeanSquaredError",
    "MeanAbsoluteError",
    "MeanAbsolutePercentageError",
    "MeanSquaredLogarithmicError",
    "RootMeanSquaredError",
    "CosineSimilarity",
    "LogCoshError",
    "Hinge",
    "SquaredHinge",
    "CategoricalHinge",
    "KLDivergence",
    "Poisson",
    "BinaryCrossentropy",
    "CategoricalCrossentropy",
    "SparseCategoricalCrossentropy",
    "TruePositives",
    "FalsePositives",
    "TrueNegatives",
    "FalseNegatives",
    "Precision",
    "Recall",
    "AUC",
    "FBetaScore",
    "F1Score",
    "R2Score",
    "accuracy",
    "binary_accuracy",
    "categorical_accuracy",
    "sparse_categorical_accuracy",
    "top_k_categorical_accuracy",
    "sparse_top_k_categorical_accuracy",
    "get",
]

NEG_INF = -1e10  # Keras's metrics_utils.NEG_INF, used by top_k filtering.


def _zeros(shape: tuple[int, ...] = ()) -> jax.Array:
    return jnp.zeros(shape, jnp.float32)


def _weigh(values: jax.Array, weights: jax.Array) -> jax.Array:
    """`values * weights`, with 0 (not NaN) where the weight is 0."""
    return jnp.where(weights == 0, jnp.zeros((), values.dtype), values * weights)


#: meshfit's metric contract, as errors about a Keras-style metric show it.
_CONTRACT = (
    "Implement `init()` -> a dict of accumulators (each Keras `add_weight` a key: {'tp': jnp.zeros(())}), "
    "`update(state, y_true, y_pred, sample_weight=None)` -> the new dict, and `compute(state)` -> the value "
    "(see 'Smaller differences' in docs/keras.md)."
)


class Metric:
    """Base class of pure, summable metrics.

    Subclasses implement `init`, `update` and `compute`.

    Args:
        name: the metric's name (the key in logs and History); defaults to the
            snake-cased class name.
        dtype: dtype values are cast to before they are summed; defaults to
            `"float32"`. Accumulators are float32 whatever it is.
    """

    def __init__(self, name: str | None = None, dtype: DTypeLike | None = None) -> None:
        self.name = name or to_snake_case(type(self).__name__)
        self.dtype = jnp.dtype(dtype or "float32")
        self._state = None

    def init(self) -> dict[str, jax.Array]:
        if type(self).update_state is not Metric.update_state or type(self).result is not Metric.result:
            raise TypeError(
                f"{type(self).__name__} implements Keras's stateful `update_state`/`result`; meshfit's metrics are "
                f"pure. {_CONTRACT}"
            )
        raise NotImplementedError(f"{type(self).__name__} must implement `init()`. {_CONTRACT}")

    def add_weight(self, *args: Any, **kwargs: Any) -> None:
        """Keras's way to hold a metric's variables, which a compiled, sharded step cannot assign: a `TypeError`
        showing meshfit's contract."""
        raise TypeError(
            f"{type(self).__name__}.add_weight(): meshfit's metrics hold no variables (Keras's stateful "
            f"contract). {_CONTRACT}"
        )

    add_variable = add_weight

    def update(
        self, state: dict[str, jax.Array], y_true: ArrayLike, y_pred: ArrayLike, sample_weight: ArrayLike | None = None
    ) -> dict[str, jax.Array]:
        raise NotImplementedError(
            f"{type(self).__name__} must implement `update(state, y_true, y_pred, sample_weight=None)`."
        )

    def compute(self, state: dict[str, jax.Array]) -> jax.Array:
        raise NotImplementedError(f"{type(self).__name__} must implement `compute(state)`.")

    @staticmethod
    def merge(state_a: dict[str, jax.Array], state_b: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """Combines two states (e.g. from two replicas) by summing them."""
        return jax.tree.map(jnp.add, state_a, state_b)

    # Eager Keras-style interface on one internal state.
    def reset_state(self) -> None:
        self._state = self.init()

    def update_state(self, *args: Any, **kwargs: Any) -> None:
        if self._state is None:
            if len(args) >= 2:
                self.build(args[0], args[1])
            self.reset_state()
        self._state = self.update(self._state, *args, **kwargs)

    def result(self) -> jax.Array:
        if self._state is None:
            self.reset_state()
        return self.compute(self._state)

    def __call__(self, *args: Any, **kwargs: Any) -> jax.Array:
        self.update_state(*args, **kwargs)
        return self.result()

    # Keras's stateless names, for a custom `Model.train_step` (pure: the state in, the state out).
    def stateless_update_state(self, metric_state, *args, **kwargs):
        """`update(metric_state, *args, **kwargs)`: the accumulators with one more batch (Keras's name)."""
        return self.update(metric_state, *args, **kwargs)

    def stateless_result(self, metric_state) -> jax.Array:
        """`compute(metric_state)`: the metric's value for these accumulators (Keras's name)."""
        return self.compute(metric_state)

    def stateless_reset_state(self):
        """`init()`: fresh accumulators (Keras's name)."""
        return self.init()

    def build(self, y_true: Any, y_pred: Any) -> None:
        """Learns what `init` needs from the shapes of a batch's `y_true` and `y_pred` (arrays or
        `jax.ShapeDtypeStruct`s); `compile` calls it on the first batch. Most metrics need nothing."""

    def get_config(self) -> dict[str, Any]:
        """The constructor's arguments: `type(self)(**self.get_config())` is an equal metric.

        A subclass with arguments of its own adds them (`model.save` writes
        the config of meshfit's built-in metrics, and `load_model` rebuilds them).
        """
        return {"name": self.name, "dtype": self.dtype.name}

    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self.name}>"


# ---------------------------------------------------------------------------
# Reductions.
# ---------------------------------------------------------------------------


def _reduce_to_samplewise(
    values: ArrayLike, sample_weight: ArrayLike | None, reduce_fn: Callable[..., jax.Array], dtype: DTypeLike | None
) -> tuple[jax.Array, jax.Array | None]:
    """Keras's `reduce_to_samplewise_values`: per-row values and weights.

    Values are reduced to the rank of the weights, weighted, then reduced to
    one value per row; weights are reduced to one per row the same way.
    """
    values = jnp.asarray(values, dtype)
    if sample_weight is not None:
        sample_weight = jnp.asarray(sample_weight, dtype)
        values, sample_weight = squeeze_or_expand_to_same_rank(values, sample_weight)
        weight_ndim = sample_weight.ndim
        if values.ndim > weight_ndim:
            values = reduce_fn(values, axis=tuple(range(weight_ndim, values.ndim)))
        sample_weight = jnp.broadcast_to(sample_weight, values.shape)
        values = _weigh(values, sample_weight)
        if weight_ndim > 1:
            sample_weight = reduce_fn(sample_weight, axis=tuple(range(1, weight_ndim)))
    if values.ndim > 1:
        values = reduce_fn(values, axis=tuple(range(1, values.ndim)))
    return values, sample_weight


class Sum(Metric):
    """Weighted sum of values.

    Use `update(state, values, sample_weight=None)`.
    """

    def __init__(self, name: str | None = "sum", dtype: DTypeLike | None = None) -> None:
        super().__init__(name=name, dtype=dtype)

    def init(self) -> dict[str, jax.Array]:
        return {"total": _zeros()}

    def update(
        self, state: dict[str, jax.Array], values: ArrayLike, sample_weight: ArrayLike | None = None
    ) -> dict[str, jax.Array]:
        values, _ = _reduce_to_samplewise(values, sample_weight, jnp.sum, self.dtype)
        return {"total": state["total"] + jnp.sum(values)}

    def compute(self, state: dict[str, jax.Array]) -> jax.Array:
        return state["total"]

    def update_state(self, values: ArrayLike, sample_weight: ArrayLike | None = None) -> None:
        super().update_state(values, sample_weight=sample_weight)


class Mean(Metric):
    """Weighted mean of values, as `keras.metrics.Mean`.

    Unlike the other metrics it takes values, not labels and predictions:
    `update(state, values, sample_weight=None)`. Values of shape
    `(batch, ...)` are first averaged per row; the count is the number of rows,
    or the sum of the row weights.
    """

    def __init__(self, name: str | None = "mean", dtype: DTypeLike | None = None) -> None:
        super().__init__(name=name, dtype=dtype)

    def init(self) -> dict[str, jax.Array]:
        return {"total": _zeros(), "count": _zeros()}

    def update(
        self, state: dict[str, jax.Array], values: ArrayLike, sample_weight: ArrayLike | None = None
    ) -> dict[str, jax.Array]:
        values, sample_weight = _reduce_to_samplewise(values, sample_weight, jnp.mean, self.dtype)
        if sample_weight is not None:
            count = jnp.sum(sample_weight)
        else:
            count = values.shape[0] if values.ndim >= 1 else 1
        return {
            "total": state["total"] + jnp.sum(values),
            "count": state["count"] + jnp.asarray(count, self.dtype),
        }

    def compute(self, state: dict[str, jax.Array]) -> jax.Array:
        return divide_no_nan(state["total"], state["count"])

    def update_state(self, values: ArrayLike, sample_weight: ArrayLike | None = None) -> None:
        super().update_state(values, sample_weight=sample_weight)


class MeanMetricWrapper(Mean):
    """Mean of a per-sample function `fn(y_true, y_pred, **kwargs)`.

    Args:
        fn: returns per-sample values of shape `(batch,)` or `(batch, ...)`.
        name: the metric name; defaults to the function's snake-cased name
            (the name Keras's `compile` gives it; Keras's own default here is
            "mean_metric_wrapper").
        dtype: see `Metric`.
        **kwargs: extra keyword arguments passed to `fn`.
    """

    def __init__(self, fn: Callable, name: str | None = None, dtype: DTypeLike | None = None, **kwargs: Any) -> None:
        if not callable(fn):
            raise TypeError(
                f"Expected a callable metric function. Received: fn={fn!r} of "
                f"type {type(fn).__name__}; pass a function (y_true, y_pred)."
            )
        name = name or to_snake_case(getattr(fn, "__name__", "mean_metric_wrapper"))
        super().__init__(name=name, dtype=dtype)
        self._fn = fn
        self._fn_kwargs = kwargs
        for key, value in kwargs.items():  # Keras exposes these as attributes
            setattr(self, key, value)

    def get_config(self) -> dict[str, Any]:
        """`Metric.get_config` plus the keyword arguments of `fn`, and `fn` itself where `__init__` takes it."""
        config = {**super().get_config(), **self._fn_kwargs}
        if type(self).__init__ is MeanMetricWrapper.__init__:
            config["fn"] = self._fn
        return config

    def _values_and_mask(self, y_true: ArrayLike, y_pred: ArrayLike) -> tuple[jax.Array, jax.Array | None]:
        return self._fn(y_true, y_pred, **self._fn_kwargs), None

    def update(
        self, state: dict[str, jax.Array], y_true: ArrayLike, y_pred: ArrayLike, sample_weight: ArrayLike | None = None
    ) -> dict[str, jax.Array]:
        values, mask = self._values_and_mask(y_true, y_pred)
        values = jnp.asarray(values)
        if values.ndim == 0:
            raise ValueError(
                f"Expected metric function of `{self.name}` to return "
                "per-sample values of shape (batch,) or (batch, ...). Received: "
                "a scalar; meshfit needs per-sample values to leave out the "
                "padded rows of partial batches, so return e.g. "
                "`jnp.mean(..., axis=-1)` instead."
            )
        if mask is not None:  # entries the function itself leaves out
            mask = mask.astype(self.dtype)
            if sample_weight is None:
                sample_weight = mask
            else:
                sample_weight = mask * align_to(jnp.asarray(sample_weight, self.dtype), mask)
        return super().update(state, values, sample_weight)

    def update_state(self, y_true: ArrayLike, y_pred: ArrayLike, sample_weight: ArrayLike | None = None) -> None:
        Metric.update_state(self, y_true, y_pred, sample_weight=sample_weight)


# ---------------------------------------------------------------------------
# Accuracy functions (per sample, as keras.metrics).
# ---------------------------------------------------------------------------


def accuracy(y_true: ArrayLike, y_pred: ArrayLike) -> jax.Array:
    """1.0 where `y_true == y_pred`, else 0.0."""
    y_pred = jnp.asarray(y_pred)
    y_true, y_pred = squeeze_or_expand_to_same_rank(jnp.asarray(y_true, y_pred.dtype), y_pred)
    return (y_true == y_pred).astype(jnp.float32)


def binary_accuracy(y_true: ArrayLike, y_pred: ArrayLike, threshold: float = 0.5) -> jax.Array:
    """1.0 where `y_true == (y_pred > threshold)`, else 0.0."""
    y_true, y_pred = squeeze_or_expand_to_same_rank(jnp.asarray(y_true), jnp.asarray(y_pred))
    y_pred = (y_pred > threshold).astype(y_true.dtype)
    return (y_true == y_pred).astype(jnp.float32)


def categorical_accuracy(y_true: ArrayLike, y_pred: ArrayLike) -> jax.Array:
    """1.0 where `argmax(y_true) == argmax(y_pred)` on the last axis."""
    return (jnp.argmax(jnp.asarray(y_true), axis=-1) == jnp.argmax(jnp.asarray(y_pred), axis=-1)).astype(jnp.float32)


def sparse_categorical_accuracy(y_true: ArrayLike, y_pred: ArrayLike) -> jax.Array:
    """1.0 where the integer label equals `argmax(y_pred)` on the last axis."""
    y_pred = jnp.asarray(y_pred)
    y_true = jnp.asarray(y_true, y_pred.dtype)
    if y_true.ndim == y_pred.ndim and y_true.shape[-1] == 1:
        y_true = jnp.squeeze(y_true, -1)
    y_pred = jnp.argmax(y_pred, axis=-1).astype(y_true.dtype)
    return (y_true == y_pred).astype(jnp.float32)


def _in_top_k(targets: jax.Array, predictions: jax.Array, k: int) -> jax.Array:
    """Keras's `in_top_k`: rank of the target's score among all scores <= k."""
    at_label = jnp.take_along_axis(predictions, jnp.expand_dims(targets, -1), axis=-1)
    at_label = jnp.where(jnp.isnan(at_label), -jnp.inf, at_label)
    rank = 1 + jnp.sum(predictions > at_label, axis=-1)
    return rank <= k


def sparse_top_k_categorical_accuracy(y_true: ArrayLike, y_pred: ArrayLike, k: int = 5) -> jax.Array:
    """1.0 where the integer label is among the `k` highest scores."""
    y_pred = jnp.asarray(y_pred)
    y_true = jnp.asarray(y_true).astype(jnp.int32)
    shape = y_true.shape
    y_pred = jnp.reshape(y_pred, (-1, y_pred.shape[-1]))
    matches = _in_top_k(jnp.reshape(y_true, (-1,)), y_pred, k)
    return jnp.reshape(matches.astype(jnp.float32), shape)


def top_k_categorical_accuracy(y_true: ArrayLike, y_pred: ArrayLike, k: int = 5) -> jax.Array:
    """1.0 where `argmax(y_true)` is among the `k` highest scores."""
    y_pred = jnp.asarray(y_pred)
    y_true = jnp.argmax(jnp.asarray(y_true, y_pred.dtype), axis=-1)
    return sparse_top_k_categorical_accuracy(y_true, y_pred, k)


def _cosine_similarity(y_true: ArrayLike, y_pred: ArrayLike, axis: int = -1) -> jax.Array:
    return -losses_lib.cosine_similarity(y_true, y_pred, axis=axis)


# ---------------------------------------------------------------------------
# Mean-of-function metrics.
# ---------------------------------------------------------------------------


class Accuracy(MeanMetricWrapper):
    """How often predictions equal labels exactly."""

    def __init__(self, name: str | None = "accuracy", dtype: DTypeLike | None = None) -> None:
        super().__init__(accuracy, name=name, dtype=dtype)


class BinaryAccuracy(MeanMetricWrapper):
    """How often `y_pred > threshold` equals the 0/1 label.

    Args:
        threshold: the decision threshold on `y_pred` (0.5 for
            probabilities; use 0.0 for logits).
    """

    def __init__(
        self, name: str | None = "binary_accuracy", dtype: DTypeLike | None = None, threshold: float = 0.5
    ) -> None:
        super().__init__(binary_accuracy, name=name, dtype=dtype, threshold=threshold)
        self.threshold = threshold


class CategoricalAccuracy(MeanMetricWrapper):
    """How often `argmax(y_pred)` equals `argmax` of the one-hot label."""

    def __init__(self, name: str | None = "categorical_accuracy", dtype: DTypeLike | None = None) -> None:
        super().__init__(categorical_accuracy, name=name, dtype=dtype)


class SparseCategoricalAccuracy(MeanMetricWrapper):
    """How often `argmax(y_pred)` equals the integer label."""

    def __init__(self, name: str | None = "sparse_categorical_accuracy", dtype: DTypeLike | None = None) -> None:
        super().__init__(sparse_categorical_accuracy, name=name, dtype=dtype)


class TopKCategoricalAccuracy(MeanMetricWrapper):
    """How often the one-hot label's class is among the top `k` predictions.

    Args:
        k: number of top predictions considered.
    """

    def __init__(
        self, k: int = 5, name: str | None = "top_k_categorical_accuracy", dtype: DTypeLike | None = None
    ) -> None:
        super().__init__(top_k_categorical_accuracy, name=name, dtype=dtype, k=k)
        self.k = k


class SparseTopKCategoricalAccuracy(MeanMetricWrapper):
    """How often the integer label is among the top `k` predictions.

    Args:
        k: number of top predictions considered.
    """

    def __init__(
        self, k: int = 5, name: str | None = "sparse_top_k_categorical_accuracy", dtype: DTypeLike | None = None
    ) -> None:
        super().__init__(sparse_top_k_categorical_accuracy, name=name, dtype=dtype, k=k)


class MeanSquaredError(MeanMetricWrapper):
    """Mean of `(y_true - y_pred) ** 2`."""

    def __init__(self, name: str | None = "mean_squared_error", dtype: DTypeLike | None = None) -> None:
        super().__init__(losses_lib.mean_squared_error, name=name, dtype=dtype)


class MeanAbsoluteError(MeanMetricWrapper):
    """Mean of `|y_true - y_pred|`."""

    def __init__(self, name: str | None = "mean_absolute_error", dtype: DTypeLike | None = None) -> None:
        super().__init__(losses_lib.mean_absolute_error, name=name, dtype=dtype)


class MeanAbsolutePercentageError(MeanMetricWrapper):
    """Mean of `100 * |y_true - y_pred| / |y_true|`."""

    def __init__(self, name: str | None = "mean_absolute_percentage_error", dtype: DTypeLike | None = None) -> None:
        super().__init__(losses_lib.mean_absolute_percentage_error, name=name, dtype=dtype)


class MeanSquaredLogarithmicError(MeanMetricWrapper):
    """Mean of `(log(y_pred + 1) - log(y_true + 1)) ** 2`."""

    def __init__(self, name: str | None = "mean_squared_logarithmic_error", dtype: DTypeLike | None = None) -> None:
        super().__init__(losses_lib.mean_squared_logarithmic_error, name=name, dtype=dtype)


class CosineSimilarity(MeanMetricWrapper):
    """Mean cosine similarity between labels and predictions (1 is best).

    Args:
        axis: the feature axis.
    """

    def __init__(self, name: str | None = "cosine_similarity", dtype: DTypeLike | None = None, axis: int = -1) -> None:
        super().__init__(_cosine_similarity, name=name, dtype=dtype, axis=axis)
        self.axis = axis


class LogCoshError(MeanMetricWrapper):
    """Mean of `log(cosh(y_pred - y_true))`."""

    def __init__(self, name: str | None = "logcosh", dtype: DTypeLike | None = None) -> None:
        super().__init__(losses_lib.log_cosh, name=name, dtype=dtype)


class Hinge(MeanMetricWrapper):
    """Mean hinge loss."""

    def __init__(self, name: str | None = "hinge", dtype: DTypeLike | None = None) -> None:
        super().__init__(losses_lib.hinge, name=name, dtype=dtype)


class SquaredHinge(MeanMetricWrapper):
    """Mean squared hinge loss."""

    def __init__(self, name: str | None = "squared_hinge", dtype: DTypeLike | None = None) -> None:
        super().__init__(losses_lib.squared_hinge, name=name, dtype=dtype)


class CategoricalHinge(MeanMetricWrapper):
    """Mean categorical hinge loss."""

    def __init__(self, name: str | None = "categorical_hinge", dtype: DTypeLike | None = None) -> None:
        super().__init__(losses_lib.categorical_hinge, name=name, dtype=dtype)


class KLDivergence(MeanMetricWrapper):
    """Mean Kullback-Leibler divergence."""

    def __init__(self, name: str | None = "kl_divergence", dtype: DTypeLike | None = None) -> None:
        super().__init__(losses_lib.kl_divergence, name=name, dtype=dtype)


class Poisson(MeanMetricWrapper):
    """Mean Poisson loss."""

    def __init__(self, name: str | None = "poisson", dtype: DTypeLike | None = None) -> None:
        super().__init__(losses_lib.poisson, name=name, dtype=dtype)


class BinaryCrossentropy(MeanMetricWrapper):
    """Mean binary cross-entropy.

    Args:
        from_logits: whether `y_pred` holds logits.
        label_smoothing: in `[0, 1]`; squeezes labels towards 0.5.
    """

    def __init__(
        self,
        name: str | None = "binary_crossentropy",
        dtype: DTypeLike | None = None,
        from_logits: bool = False,
        label_smoothing: float = 0,
    ) -> None:
        super().__init__(
            losses_lib.binary_crossentropy,
            name=name,
            dtype=dtype,
            from_logits=from_logits,
            label_smoothing=label_smoothing,
        )


class CategoricalCrossentropy(MeanMetricWrapper):
    """Mean categorical cross-entropy.

    Args:
        from_logits: whether `y_pred` holds logits.
        label_smoothing: in `[0, 1]`.
        axis: the class axis.
    """

    def __init__(
        self,
        name: str | None = "categorical_crossentropy",
        dtype: DTypeLike | None = None,
        from_logits: bool = False,
        label_smoothing: float = 0,
        axis: int = -1,
    ) -> None:
        super().__init__(
            losses_lib.categorical_crossentropy,
            name=name,
            dtype=dtype,
            from_logits=from_logits,
            label_smoothing=label_smoothing,
            axis=axis,
        )


class SparseCategoricalCrossentropy(MeanMetricWrapper):
    """Mean sparse categorical cross-entropy.

    Args:
        from_logits: whether `y_pred` holds logits.
        ignore_class: optional label whose entries are not counted.
        axis: the class axis.
    """

    def __init__(
        self,
        name: str | None = "sparse_categorical_crossentropy",
        dtype: DTypeLike | None = None,
        from_logits: bool = False,
        ignore_class: int | None = None,
        axis: int = -1,
    ) -> None:
        super().__init__(
            losses_lib.sparse_categorical_crossentropy,
            name=name,
            dtype=dtype,
            from_logits=from_logits,
            ignore_class=ignore_class,
            axis=axis,
        )

    def _values_and_mask(self, y_true: ArrayLike, y_pred: ArrayLike) -> tuple[jax.Array, jax.Array | None]:
        return losses_lib.sparse_crossentropy_and_mask(y_true, y_pred, self.from_logits, self.ignore_class, self.axis)


class RootMeanSquaredError(Mean):
    """Square root of the mean of `(y_true - y_pred) ** 2`.

    Takes `update(state, y_true, y_pred, sample_weight=None)`.
    """

    def __init__(self, name: str | None = "root_mean_squared_error", dtype: DTypeLike | None = None) -> None:
        super().__init__(name=name, dtype=dtype)

    def update(
        self, state: dict[str, jax.Array], y_true: ArrayLike, y_pred: ArrayLike, sample_weight: ArrayLike | None = None
    ) -> dict[str, jax.Array]:
        y_true, y_pred = squeeze_or_expand_to_same_rank(
            jnp.asarray(y_true, self.dtype), jnp.asarray(y_pred, self.dtype)
        )
        return super().update(state, jnp.square(y_pred - y_true), sample_weight)

    def compute(self, state: dict[str, jax.Array]) -> jax.Array:
        return jnp.sqrt(super().compute(state))

    def update_state(self, y_true: ArrayLike, y_pred: ArrayLike, sample_weight: ArrayLike | None = None) -> None:
        Metric.update_state(self, y_true, y_pred, sample_weight=sample_weight)


# ---------------------------------------------------------------------------
# Confusion-matrix metrics.
# ---------------------------------------------------------------------------

_CONFUSION_KEYS = ("true_positives", "false_positives", "true_negatives", "false_negatives")


def _prepare_confusion_inputs(
    y_true: ArrayLike,
    y_pred: ArrayLike,
    sample_weight: ArrayLike | None,
    top_k: int | None = None,
    class_id: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Shapes labels, predictions and weights as Keras's confusion update does."""
    y_true = jnp.asarray(y_true, jnp.float32)
    y_pred = jnp.asarray(y_pred, jnp.float32)
    y_pred, y_true = squeeze_or_expand_to_same_rank(y_pred, y_true)
    if sample_weight is not None:
        sample_weight = jnp.expand_dims(jnp.asarray(sample_weight, jnp.float32), -1)
        _, sample_weight = squeeze_or_expand_to_same_rank(y_true, sample_weight, expand_rank_1=False)
    if top_k is not None:
        _, idx = jax.lax.top_k(y_pred, top_k)
        in_top = jnp.sum(jax.nn.one_hot(idx, y_pred.shape[-1]), axis=-2)
        y_pred = y_pred * in_top + NEG_INF * (1 - in_top)
    if class_id is not None:
        if y_pred.ndim == 1:
            raise ValueError(
                "Expected y_pred of shape (batch, num_classes) with `class_id`. "
                f"Received: y_pred.shape={y_pred.shape}; drop class_id for "
                "single-output predictions."
            )
        y_true = y_true[..., class_id, None]
        y_pred = y_pred[..., class_id, None]
    if sample_weight is None:
        weights = jnp.ones_like(y_pred)
    else:
        weights = jnp.broadcast_to(sample_weight, y_pred.shape)
    return y_true, y_pred, weights


def _confusion_counts(
    y_true: jax.Array, y_pred: jax.Array, weights: jax.Array, thresholds: ArrayLike
) -> dict[str, jax.Array]:
    """Weighted tp/fp/tn/fn entries per threshold, not yet summed.

    `y_pred > threshold` counts as positive, a nonzero label as positive. Each
    result has shape `(len(thresholds),) + y_pred.shape`.
    """
    thresholds = jnp.asarray(thresholds, jnp.float32)
    t = thresholds.reshape((-1,) + (1,) * y_pred.ndim)
    pred_pos = y_pred[None] > t
    label_pos = y_true.astype(bool)[None]
    w = weights[None]
    zero = jnp.zeros((), jnp.float32)

    def count(cond: jax.Array) -> jax.Array:
        return jnp.where(cond, w, zero)

    return {
        "true_positives": count(label_pos & pred_pos),
        "false_positives": count(~label_pos & pred_pos),
        "true_negatives": count(~label_pos & ~pred_pos),
        "false_negatives": count(label_pos & ~pred_pos),
    }


def _check_single_threshold(thresholds: float | Sequence[float] | None, default: float) -> float:
    if thresholds is None:
        return float(default)
    value = thresholds
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    if isinstance(value, (list, tuple)) or value is None or not 0 <= value <= 1:
        raise ValueError(
            "Expected `thresholds` to be one float in [0, 1] (meshfit metrics "
            f"return scalars). Received: thresholds={thresholds!r}; create one "
            "metric per threshold."
        )
    return float(value)


class _ConfusionMetric(Metric):
    """Counts some of tp/fp/tn/fn at one threshold (`y_pred > threshold`)."""

    _keys: tuple[str, ...] = ()

    def __init__(
        self,
        thresholds: float | Sequence[float] | None = None,
        top_k: int | None = None,
        class_id: int | None = None,
        name: str | None = None,
        dtype: DTypeLike | None = None,
    ) -> None:
        super().__init__(name=name, dtype=dtype)
        self.thresholds = _check_single_threshold(thresholds, 0.5 if top_k is None else NEG_INF)
        self.top_k = top_k
        self.class_id = class_id

    def get_config(self) -> dict[str, Any]:
        # With `top_k` and no threshold, `thresholds` holds NEG_INF, which the constructor takes as None.
        default = self.top_k is not None and self.thresholds == NEG_INF
        thresholds = None if default else self.thresholds
        return {**super().get_config(), "thresholds": thresholds, "top_k": self.top_k, "class_id": self.class_id}

    def init(self) -> dict[str, jax.Array]:
        return {k: _zeros() for k in self._keys}

    def update(
        self, state: dict[str, jax.Array], y_true: ArrayLike, y_pred: ArrayLike, sample_weight: ArrayLike | None = None
    ) -> dict[str, jax.Array]:
        y_true, y_pred, weights = _prepare_confusion_inputs(y_true, y_pred, sample_weight, self.top_k, self.class_id)
        counts = _confusion_counts(y_true, y_pred, weights, [self.thresholds])
        return {k: state[k] + jnp.sum(counts[k]) for k in self._keys}


class _ConfusionCount(_ConfusionMetric):
    """One weighted count (`_keys[0]`) at one threshold; no `top_k` or `class_id`, as in Keras."""

    def __init__(
        self, thresholds: float | Sequence[float] | None = None, name: str | None = None, dtype: DTypeLike | None = None
    ) -> None:
        super().__init__(thresholds=thresholds, name=name, dtype=dtype)

    def compute(self, state: dict[str, jax.Array]) -> jax.Array:
        return state[self._keys[0]]

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        del config["top_k"], config["class_id"]
        return config


class TruePositives(_ConfusionCount):
    """Weighted count of true positives at `thresholds` (default 0.5)."""

    _keys = ("true_positives",)


class FalsePositives(_ConfusionCount):
    """Weighted count of false positives at `thresholds` (default 0.5)."""

    _keys = ("false_positives",)


class TrueNegatives(_ConfusionCount):
    """Weighted count of true negatives at `thresholds` (default 0.5)."""

    _keys = ("true_negatives",)


class FalseNegatives(_ConfusionCount):
    """Weighted count of false negatives at `thresholds` (default 0.5)."""

    _keys = ("false_negatives",)


class Precision(_ConfusionMetric):
    """`tp / (tp + fp)` with `y_pred > threshold` counted positive.

    Args:
        thresholds: one threshold in [0, 1]; default 0.5 (or, with `top_k`,
            every top-k prediction counts as positive).
        top_k: only the `k` highest predictions of each row can be positive.
        class_id: only this class (column of `y_pred`) is evaluated.
    """

    _keys = ("true_positives", "false_positives")

    def compute(self, state: dict[str, jax.Array]) -> jax.Array:
        tp = state["true_positives"]
        return divide_no_nan(tp, tp + state["false_positives"])


class Recall(_ConfusionMetric):
    """`tp / (tp + fn)` with `y_pred > threshold` counted positive.

    Args:
        thresholds: one threshold in [0, 1]; default 0.5 (or, with `top_k`,
            every top-k prediction counts as positive).
        top_k: only the `k` highest predictions of each row can be positive.
        class_id: only this class (column of `y_pred`) is evaluated.
    """

    _keys = ("true_positives", "false_negatives")

    def compute(self, state: dict[str, jax.Array]) -> jax.Array:
        tp = state["true_positives"]
        return divide_no_nan(tp, tp + state["false_negatives"])


def _is_evenly_distributed(thresholds: np.ndarray) -> bool:
    n = len(thresholds)
    if n < 3:
        return False
    even = np.arange(n, dtype=np.float32) / (n - 1)
    return bool(np.allclose(thresholds, even, atol=EPSILON))


class AUC(Metric):
    """Area under the ROC or PR curve, approximated on fixed thresholds.

    Port of `keras.metrics.AUC`: confusion counts are accumulated per
    threshold and the curve is summed with Keras's rules (for PR with
    interpolation, the Davis & Goadrich interpolation).

    Args:
        num_thresholds: number of thresholds (> 1) evenly spaced in [0, 1].
        curve: `"ROC"` or `"PR"`.
        summation_method: `"interpolation"`, `"minoring"` or `"majoring"`.
        thresholds: optional explicit thresholds in [0, 1] (replace
            `num_thresholds`).
        multi_label: whether each column of `y_pred` is a separate label whose
            AUCs are averaged; needs `num_labels`.
        num_labels: number of labels when `multi_label=True`.
        label_weights: optional per-label weights for the average (or, when
            not multi-label, for the counts).
        from_logits: whether `y_pred` holds logits (a sigmoid is applied).
    """

    def __init__(
        self,
        num_thresholds: int = 200,
        curve: str = "ROC",
        summation_method: str = "interpolation",
        name: str | None = None,
        dtype: DTypeLike | None = None,
        thresholds: float | Sequence[float] | None = None,
        multi_label: bool = False,
        num_labels: int | None = None,
        label_weights: ArrayLike | None = None,
        from_logits: bool = False,
    ) -> None:
        super().__init__(name=name, dtype=dtype)
        curves = {"roc": "ROC", "pr": "PR"}
        if str(curve).lower() not in curves:
            raise ValueError(
                f'Expected `curve` to be one of ["ROC", "PR"]. Received: '
                f"curve={curve!r}; PRGAIN is not supported by meshfit."
            )
        methods = ("interpolation", "minoring", "majoring")
        if str(summation_method).lower() not in methods:
            raise ValueError(
                f"Expected `summation_method` to be one of {list(methods)}. "
                f"Received: summation_method={summation_method!r}."
            )
        self.curve = curves[str(curve).lower()]
        self.summation_method = str(summation_method).lower()
        if thresholds is not None:
            if any(t is None or t < 0 or t > 1 for t in thresholds):
                raise ValueError(f"Expected every threshold in [0, 1]. Received: thresholds={thresholds!r}.")
            thresholds = sorted(thresholds)
            self._given_thresholds = [float(t) for t in thresholds]
            self.num_thresholds = len(thresholds) + 2
            self._evenly = _is_evenly_distributed(np.array([0.0] + thresholds + [1.0]))
        else:
            if num_thresholds <= 1:
                raise ValueError(
                    f"Expected `num_thresholds` to be an integer > 1. Received: num_thresholds={num_thresholds}."
                )
            self.num_thresholds = num_thresholds
            self._given_thresholds = None
            thresholds = [(i + 1) * 1.0 / (num_thresholds - 1) for i in range(num_thresholds - 2)]
            self._evenly = True
        self._thresholds = np.array([0.0 - EPSILON] + thresholds + [1.0 + EPSILON], dtype=np.float32)
        if multi_label and not num_labels:
            raise ValueError(
                "Expected `num_labels` with `multi_label=True`. Received: "
                f"num_labels={num_labels!r}; pass the number of columns of y_pred "
                "(meshfit builds the state before seeing data)."
            )
        if not multi_label and num_labels:
            raise ValueError(
                "Expected `num_labels` only with `multi_label=True`. Received: "
                f"num_labels={num_labels!r}, multi_label=False."
            )
        self.multi_label = multi_label
        self.num_labels = num_labels
        self.label_weights = None if label_weights is None else jnp.asarray(label_weights, jnp.float32)
        self.from_logits = from_logits

    @property
    def thresholds(self) -> list[float]:
        return list(self._thresholds)

    def get_config(self) -> dict[str, Any]:
        label_weights = None if self.label_weights is None else np.asarray(self.label_weights).tolist()
        return {
            **super().get_config(),
            "num_thresholds": self.num_thresholds,
            "curve": self.curve,
            "summation_method": self.summation_method,
            "thresholds": self._given_thresholds,
            "multi_label": self.multi_label,
            "num_labels": self.num_labels,
            "label_weights": label_weights,
            "from_logits": self.from_logits,
        }

    def init(self) -> dict[str, jax.Array]:
        shape = (self.num_thresholds,)
        if self.multi_label:
            shape += (self.num_labels,)
        return {k: _zeros(shape) for k in _CONFUSION_KEYS}

    def update(
        self, state: dict[str, jax.Array], y_true: ArrayLike, y_pred: ArrayLike, sample_weight: ArrayLike | None = None
    ) -> dict[str, jax.Array]:
        if self.from_logits:
            y_pred = jax.nn.sigmoid(jnp.asarray(y_pred, jnp.float32))
        y_true, y_pred, weights = _prepare_confusion_inputs(y_true, y_pred, sample_weight)
        if self.label_weights is not None and not self.multi_label:
            weights = weights * jnp.broadcast_to(self.label_weights, y_pred.shape)
        if self.multi_label:
            if y_pred.ndim != 2:
                raise ValueError(
                    f"Expected y_pred of rank 2 with `multi_label=True`. Received: y_pred.shape={y_pred.shape}."
                )
        else:
            y_true, y_pred, weights = (jnp.reshape(x, (-1,)) for x in (y_true, y_pred, weights))
        if self._evenly:
            counts = self._bucket_counts(y_true, y_pred, weights)
        else:
            counts = _confusion_counts(y_true, y_pred, weights, self._thresholds)
            counts = {k: jnp.sum(v, axis=1) for k, v in counts.items()}
        return {k: state[k] + counts[k] for k in _CONFUSION_KEYS}

    def _bucket_counts(self, y_true: jax.Array, y_pred: jax.Array, weights: jax.Array) -> dict[str, jax.Array]:
        """Keras's optimized path for evenly spaced thresholds (O(n) buckets)."""
        n = self.num_thresholds
        y_pred = jnp.clip(y_pred, 0.0, 1.0)
        y_true = y_true.astype(bool).astype(jnp.float32)
        true_labels = _weigh(y_true, weights)
        false_labels = _weigh(1.0 - y_true, weights)
        buckets = jnp.ceil(y_pred * (n - 1)) - 1
        if self._thresholds[0] < 0.0 or self._thresholds[-1] > 1.0:
            buckets = jnp.maximum(buckets, 0)
        buckets = buckets.astype(jnp.int32)

        def cumulative(labels: jax.Array) -> jax.Array:
            def one(lab: jax.Array, ids: jax.Array) -> jax.Array:
                per_bucket = jax.ops.segment_sum(lab, ids, num_segments=n)
                return jnp.flip(jnp.cumsum(jnp.flip(per_bucket)))

            if self.multi_label:
                return jax.vmap(one, in_axes=1, out_axes=1)(labels, buckets)
            return one(labels, buckets)

        tp, fp = cumulative(true_labels), cumulative(false_labels)
        return {
            "true_positives": tp,
            "false_positives": fp,
            "true_negatives": jnp.sum(false_labels, axis=0) - fp,
            "false_negatives": jnp.sum(true_labels, axis=0) - tp,
        }

    def _average(self, by_threshold: jax.Array) -> jax.Array:
        if not self.multi_label:
            return jnp.sum(by_threshold)
        by_label = jnp.sum(by_threshold, axis=0)
        if self.label_weights is None:
            return jnp.mean(by_label)
        return divide_no_nan(jnp.sum(by_label * self.label_weights), jnp.sum(self.label_weights))

    def _interpolate_pr_auc(self, s: dict[str, jax.Array]) -> jax.Array:
        tp, fp, fn = s["true_positives"], s["false_positives"], s["false_negatives"]
        dtp = tp[:-1] - tp[1:]
        p = tp + fp
        dp = p[:-1] - p[1:]
        prec_slope = divide_no_nan(dtp, jnp.maximum(dp, 0))
        intercept = tp[1:] - prec_slope * p[1:]
        safe_p_ratio = jnp.where(
            (p[:-1] > 0) & (p[1:] > 0),
            divide_no_nan(p[:-1], jnp.maximum(p[1:], 0)),
            jnp.ones_like(p[1:]),
        )
        increment = divide_no_nan(
            prec_slope * (dtp + intercept * jnp.log(safe_p_ratio)),
            jnp.maximum(tp[1:] + fn[1:], 0),
        )
        return self._average(increment)

    def compute(self, state: dict[str, jax.Array]) -> jax.Array:
        if self.curve == "PR" and self.summation_method == "interpolation":
            return self._interpolate_pr_auc(state)
        tp, fp = state["true_positives"], state["false_positives"]
        tn, fn = state["true_negatives"], state["false_negatives"]
        recall = divide_no_nan(tp, tp + fn)
        if self.curve == "ROC":
            x, y = divide_no_nan(fp, fp + tn), recall
        else:
            x, y = recall, divide_no_nan(tp, tp + fp)
        if self.summation_method == "interpolation":
            heights = (y[:-1] + y[1:]) / 2.0
        elif self.summation_method == "minoring":
            heights = jnp.minimum(y[:-1], y[1:])
        else:
            heights = jnp.maximum(y[:-1], y[1:])
        return self._average((x[:-1] - x[1:]) * heights)


# ---------------------------------------------------------------------------
# Lookup.
# ---------------------------------------------------------------------------

# ---------------------------------------------------------------------------
# Scores over classes: F-beta and R^2 (accumulators shaped by the number of classes).
# ---------------------------------------------------------------------------


def _two_dims(who: str, y_true: Any, y_pred: Any) -> int:
    """The number of classes (columns) of 2D `y_true` and `y_pred`; a ValueError otherwise."""
    t_shape, p_shape = _shape(y_true), _shape(y_pred)
    if len(t_shape) != 2 or len(p_shape) != 2:
        raise ValueError(
            f"{who} expects 2D inputs with shape (batch_size, output_dim). Received input shapes: "
            f"y_pred.shape={p_shape} and y_true.shape={t_shape}."
        )
    return int(p_shape[-1])


class _ClassScore(Metric):
    """A metric whose accumulators have one entry per class: `build` learns how many."""

    def __init__(self, name: str | None = None, dtype: DTypeLike | None = None) -> None:
        super().__init__(name=name, dtype=dtype)
        self.num_classes: int | None = None

    def _classes(self) -> int:
        if self.num_classes is None:
            raise ValueError(
                f"{type(self).__name__} learns the number of classes from the first batch: call "
                "`build(y_true, y_pred)` (compile does it) or `update_state` before `init`."
            )
        return self.num_classes


class FBetaScore(_ClassScore):
    """The F-beta score per class, or averaged, as `keras.metrics.FBetaScore`.

    Sums of true positives, false positives, false negatives and label
    weights per class are accumulated (exact across batches and replicas);
    the score is computed from them at the end.

    Args:
        average: None (a score per class), "micro" (from counts over all
            classes), "macro" (mean of the classes' scores) or "weighted"
            (the classes' scores weighted by their label counts).
        beta: weight of recall against precision (a float > 0).
        threshold: predictions above it count positive; None: each row's
            highest prediction counts positive (ties too; 0 never does).
    """

    def __init__(
        self,
        average: str | None = None,
        beta: float = 1.0,
        threshold: float | None = None,
        name: str = "fbeta_score",
        dtype: DTypeLike | None = None,
    ) -> None:
        super().__init__(name=name, dtype=dtype)
        if average not in (None, "micro", "macro", "weighted"):
            raise ValueError(
                "Invalid `average` argument value. Expected one of: {None, 'micro', 'macro', 'weighted'}. "
                f"Received: average={average!r}"
            )
        if not isinstance(beta, float) or beta <= 0.0:
            raise ValueError(f"`beta` must be a Python float > 0. Received: beta={beta!r}.")
        if threshold is not None and (not isinstance(threshold, float) or not 0.0 < threshold <= 1.0):
            raise ValueError(f"`threshold` must be a Python float with 0 < threshold <= 1. Received: {threshold!r}.")
        self.average = average
        self.beta = beta
        self.threshold = threshold

    def build(self, y_true: Any, y_pred: Any) -> None:
        self.num_classes = _two_dims(type(self).__name__, y_true, y_pred)

    def init(self) -> dict[str, jax.Array]:
        shape = (self._classes(),)
        return {k: _zeros(shape) for k in ("true_positives", "false_positives", "false_negatives", "weights")}

    def update(
        self, state: dict[str, jax.Array], y_true: ArrayLike, y_pred: ArrayLike, sample_weight: ArrayLike | None = None
    ) -> dict[str, jax.Array]:
        y_true = jnp.asarray(y_true, self.dtype)
        y_pred = jnp.asarray(y_pred, self.dtype)
        if self.threshold is None:
            top = jnp.max(y_pred, axis=-1, keepdims=True)
            y_pred = jnp.logical_and(y_pred >= top, jnp.abs(y_pred) > 1e-9)
        else:
            y_pred = y_pred > self.threshold
        y_pred = y_pred.astype(self.dtype)

        def weighted_sum(values: jax.Array) -> jax.Array:
            if sample_weight is not None:
                weights = jnp.reshape(jnp.asarray(sample_weight, self.dtype), (-1, 1))
                values = _weigh(values, weights)
            return jnp.sum(values, axis=0).astype(jnp.float32)

        return {
            "true_positives": state["true_positives"] + weighted_sum(y_pred * y_true),
            "false_positives": state["false_positives"] + weighted_sum(y_pred * (1 - y_true)),
            "false_negatives": state["false_negatives"] + weighted_sum((1 - y_pred) * y_true),
            "weights": state["weights"] + weighted_sum(y_true),
        }

    def compute(self, state: dict[str, jax.Array]) -> jax.Array:
        tp, fp, fn = state["true_positives"], state["false_positives"], state["false_negatives"]
        if self.average == "micro":
            tp, fp, fn = jnp.sum(tp), jnp.sum(fp), jnp.sum(fn)
        precision = tp / (tp + fp + EPSILON)
        recall = tp / (tp + fn + EPSILON)
        beta2 = self.beta**2
        score = precision * recall / (beta2 * precision + recall + EPSILON) * (1 + beta2)
        if self.average == "weighted":
            weights = state["weights"] / (jnp.sum(state["weights"]) + EPSILON)
            return jnp.sum(score * weights)
        if self.average is not None:
            return jnp.mean(score)
        return score

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "average": self.average, "beta": self.beta, "threshold": self.threshold}


class F1Score(FBetaScore):
    """The F1 score (`FBetaScore` with beta 1), as `keras.metrics.F1Score`; see `FBetaScore`."""

    def __init__(
        self,
        average: str | None = None,
        threshold: float | None = None,
        name: str = "f1_score",
        dtype: DTypeLike | None = None,
    ) -> None:
        super().__init__(average=average, beta=1.0, threshold=threshold, name=name, dtype=dtype)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        del config["beta"]
        return config


class R2Score(_ClassScore):
    """The coefficient of determination, as `keras.metrics.R2Score`.

    Weighted sums of `y`, `y**2` and squared residuals per output are
    accumulated (exact across batches and replicas). Rows of weight 0 (the
    padding of partial batches) are not counted in `num_samples` either.

    Args:
        class_aggregation: "uniform_average" (mean over outputs),
            "variance_weighted_average" (weighted by each output's variance)
            or None (a score per output).
        num_regressors: for the adjusted R^2, the number of independent
            variables (0: the plain R^2). With too few samples the plain R^2
            is returned (Keras also warns; a compiled step cannot).
    """

    def __init__(
        self,
        class_aggregation: str | None = "uniform_average",
        num_regressors: int = 0,
        name: str = "r2_score",
        dtype: DTypeLike | None = None,
    ) -> None:
        super().__init__(name=name, dtype=dtype)
        if class_aggregation not in (None, "uniform_average", "variance_weighted_average"):
            raise ValueError(
                "Invalid value for argument `class_aggregation`. Expected one of "
                f"(None, 'uniform_average', 'variance_weighted_average'). Received: {class_aggregation!r}"
            )
        if num_regressors < 0:
            raise ValueError(f"`num_regressors` must be >= 0. Received: num_regressors={num_regressors!r}")
        self.class_aggregation = class_aggregation
        self.num_regressors = int(num_regressors)

    def build(self, y_true: Any, y_pred: Any) -> None:
        t_shape, p_shape = _shape(y_true), _shape(y_pred)
        if len(t_shape) == len(p_shape) - 1 and p_shape[-1:] == (1,):  # Keras's squeeze_or_expand_to_same_rank
            t_shape = (*t_shape, 1)
        self.num_classes = _two_dims(type(self).__name__, np.zeros(t_shape), np.zeros(p_shape))

    def init(self) -> dict[str, jax.Array]:
        shape = (self._classes(),)
        return {**{k: _zeros(shape) for k in ("sum", "squared_sum", "residual", "count")}, "num_samples": _zeros()}

    def update(
        self, state: dict[str, jax.Array], y_true: ArrayLike, y_pred: ArrayLike, sample_weight: ArrayLike | None = None
    ) -> dict[str, jax.Array]:
        y_true = jnp.asarray(y_true, self.dtype)
        y_pred = jnp.asarray(y_pred, self.dtype)
        y_true, y_pred = squeeze_or_expand_to_same_rank(y_true, y_pred)
        weights = jnp.ones((), self.dtype) if sample_weight is None else jnp.asarray(sample_weight, self.dtype)
        if weights.ndim == 1:
            weights = weights[:, None]
        weights = jnp.broadcast_to(weights, y_true.shape)
        weighted = _weigh(y_true, weights)
        column = lambda v: jnp.sum(v, axis=0).astype(jnp.float32)  # noqa: E731
        return {
            "sum": state["sum"] + column(weighted),
            "squared_sum": state["squared_sum"] + column(y_true * weighted),
            "residual": state["residual"] + column(_weigh((y_true - y_pred) ** 2, weights)),
            "count": state["count"] + column(weights),
            "num_samples": state["num_samples"] + jnp.sum(weights != 0).astype(jnp.float32),
        }

    def compute(self, state: dict[str, jax.Array]) -> jax.Array:
        mean = state["sum"] / state["count"]
        total = state["squared_sum"] - state["sum"] * mean
        raw = 1 - state["residual"] / total
        raw = jnp.where(jnp.isinf(raw), 0.0, raw)
        if self.class_aggregation == "uniform_average":
            score = jnp.mean(raw)
        elif self.class_aggregation == "variance_weighted_average":
            score = jnp.sum(total * raw) / jnp.sum(total)
        else:
            score = raw
        if self.num_regressors:
            n, p = state["num_samples"], float(self.num_regressors)
            adjusted = 1.0 - (1.0 - score) * (n - 1.0) / (n - p - 1.0)
            score = jnp.where(p < n - 1, adjusted, score)
        return score

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "class_aggregation": self.class_aggregation,
            "num_regressors": self.num_regressors,
        }


_CLASSES = (
    Accuracy,
    BinaryAccuracy,
    CategoricalAccuracy,
    SparseCategoricalAccuracy,
    TopKCategoricalAccuracy,
    SparseTopKCategoricalAccuracy,
    MeanSquaredError,
    MeanAbsoluteError,
    MeanAbsolutePercentageError,
    MeanSquaredLogarithmicError,
    RootMeanSquaredError,
    CosineSimilarity,
    LogCoshError,
    Hinge,
    SquaredHinge,
    CategoricalHinge,
    KLDivergence,
    Poisson,
    BinaryCrossentropy,
    CategoricalCrossentropy,
    SparseCategoricalCrossentropy,
    TruePositives,
    FalsePositives,
    TrueNegatives,
    FalseNegatives,
    Precision,
    Recall,
    AUC,
    FBetaScore,
    F1Score,
    R2Score,
)

# Same keys as keras.metrics.get: class names, their snake case, short aliases.
# (Mean and Sum take values, not (y_true, y_pred), so they are left out.)
_NAMES = {cls.__name__: cls for cls in _CLASSES}
_NAMES.update({to_snake_case(cls.__name__): cls for cls in _CLASSES})
_NAMES.update(
    {
        "bce": BinaryCrossentropy,
        "BCE": BinaryCrossentropy,
        "mse": MeanSquaredError,
        "MSE": MeanSquaredError,
        "mae": MeanAbsoluteError,
        "MAE": MeanAbsoluteError,
        "mape": MeanAbsolutePercentageError,
        "MAPE": MeanAbsolutePercentageError,
        "msle": MeanSquaredLogarithmicError,
        "MSLE": MeanSquaredLogarithmicError,
        "fbeta_score": FBetaScore,
    }
)


def _accuracy_from_loss(loss: Any) -> type[Metric] | None:
    """The accuracy that fits a loss, for when no shapes are known."""
    if loss is None:
        return None
    try:
        loss = losses_lib.get(loss)
    except (TypeError, ValueError):
        return None
    if isinstance(loss, losses_lib.LossFunctionWrapper):
        fn = loss.fn
    else:
        fn = None
    if isinstance(loss, (losses_lib.BinaryCrossentropy, losses_lib.BinaryFocalCrossentropy)) or fn in (
        losses_lib.binary_crossentropy,
        losses_lib.binary_focal_crossentropy,
    ):
        return BinaryAccuracy
    if isinstance(loss, losses_lib.SparseCategoricalCrossentropy) or (fn is losses_lib.sparse_categorical_crossentropy):
        return SparseCategoricalAccuracy
    if isinstance(loss, (losses_lib.CategoricalCrossentropy, losses_lib.CategoricalFocalCrossentropy)) or fn in (
        losses_lib.categorical_crossentropy,
        losses_lib.categorical_focal_crossentropy,
    ):
        return CategoricalAccuracy
    return None


class _LossMean(MeanMetricWrapper):
    """Mean of a `Loss`'s per-sample values (its own reduction is not used)."""

    def __init__(self, loss: losses_lib.Loss) -> None:
        super().__init__(loss.call, name=loss.name)
        self._loss = loss

    def _values_and_mask(self, y_true: ArrayLike, y_pred: ArrayLike) -> tuple[jax.Array, jax.Array | None]:
        cast = lambda x: jnp.asarray(x, self._loss.dtype)  # noqa: E731
        return self._loss.values_and_mask(jax.tree.map(cast, y_true), jax.tree.map(cast, y_pred))


def _shape(x: Any) -> tuple[int, ...]:
    """The shape of an array, a `jax.ShapeDtypeStruct` or a nested list."""
    return tuple(x.shape) if hasattr(x, "shape") else np.shape(x)


def _resolve_accuracy(identifier: Any, y_true: ArrayLike, y_pred: ArrayLike, loss: Any) -> Metric:
    """Keras 3's `compile_utils.get_metric` rule for "accuracy" / "acc".

    From the shapes: `y_pred.shape[-1] == 1` -> binary; else labels of lower
    rank than `y_pred`, or with a last axis of 1, -> sparse categorical; else
    categorical. Keras 3 ignores the loss; meshfit uses it only when the
    shapes are not given.
    """
    if y_true is not None and y_pred is not None:
        t_shape, p_shape = _shape(y_true), _shape(y_pred)
        if not t_shape or not p_shape:
            raise ValueError(
                'Expected y_true and y_pred of rank >= 1 to resolve "accuracy". '
                f"Received: y_true.shape={t_shape}, y_pred.shape={p_shape}."
            )
        if p_shape[-1] == 1:
            cls = BinaryAccuracy
        elif len(t_shape) < len(p_shape) or (t_shape[-1] == 1 and p_shape[-1] > 1):
            cls = SparseCategoricalAccuracy
        else:
            cls = CategoricalAccuracy
    else:
        cls = _accuracy_from_loss(loss)
        if cls is None:
            raise ValueError(
                f"Expected y_true and y_pred (arrays or jax.ShapeDtypeStruct) or "
                f"a cross-entropy loss to resolve {identifier!r}. Received: "
                f"y_true={y_true!r}, y_pred={y_pred!r}, loss={loss!r}; pass the "
                "shapes, or name the metric explicitly (e.g. "
                '"sparse_categorical_accuracy").'
            )
    return cls(name=identifier)


def get(identifier: Any, *, y_true: ArrayLike = None, y_pred: ArrayLike = None, loss: Any = None) -> Metric:
    """Returns a `Metric` for a name, a `Metric` instance or a callable.

    Names follow Keras 3's `compile`: the returned metric is named by the
    string itself, which is the key Keras puts in History (`"mse"` -> `"mse"`,
    `"acc"` -> `"acc"`, `"MeanSquaredError"` -> `"MeanSquaredError"`).
    `"accuracy"`/`"acc"` (any case) pick binary, sparse categorical or
    categorical accuracy from the shapes of `y_true` and `y_pred`, as Keras does.
    A `Metric` is returned as is; a `meshfit.losses.Loss` becomes the mean of
    its per-sample values, named like the loss (Keras would average the loss's
    per-batch reduced values instead, a mean of batch means); any other callable
    `(y_true, y_pred) -> per-sample values` is wrapped in `MeanMetricWrapper`,
    named by its snake-cased `__name__`.

    Args:
        identifier: a string, `Metric`, `Loss` or callable.
        y_true: labels or their `jax.ShapeDtypeStruct` (for "accuracy", and
            passed to the metric's `build`: F1Score learns its classes).
        y_pred: predictions or their `jax.ShapeDtypeStruct` (likewise).
        loss: the loss, used for "accuracy" only when shapes are not given.
    """
    metric = _get(identifier, y_true, y_pred, loss)
    if y_true is not None and y_pred is not None:
        metric.build(y_true, y_pred)
    return metric


def _get(identifier: Any, y_true: ArrayLike, y_pred: ArrayLike, loss: Any) -> Metric:
    if isinstance(identifier, Metric):
        return identifier
    if isinstance(identifier, str):
        if identifier.lower() in ("accuracy", "acc"):
            return _resolve_accuracy(identifier, y_true, y_pred, loss)
        if identifier in _NAMES:
            return _NAMES[identifier](name=identifier)
        raise ValueError(
            f"Expected a known metric name. Received: identifier={identifier!r}; "
            f"use one of {sorted({'acc', *_NAMES})}, a meshfit.metrics.Metric, "
            "or a callable (y_true, y_pred) -> per-sample values."
        )
    if isinstance(identifier, type) and issubclass(identifier, Metric):
        return identifier()
    if isinstance(identifier, losses_lib.Loss):
        return _LossMean(identifier)
    if callable(identifier):
        return MeanMetricWrapper(identifier, name=getattr(identifier, "name", None))
    raise TypeError(
        "Expected a metric name (str), a meshfit.metrics.Metric or a callable "
        "(y_true, y_pred) -> per-sample values. Received: "
        f"identifier={identifier!r} of type {type(identifier).__name__}."
    )
