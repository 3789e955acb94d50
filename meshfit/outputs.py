"""Which loss and which metrics apply to which of a model's outputs: Keras 3's compile structure.

A module returns one array, or a dict, list or tuple of them (nested too).
`compile` then takes `loss`, `loss_weights`, `metrics` and `weighted_metrics`
per output, as Keras does: one loss for every output, a dict keyed by output
name, or a list in output order. They are resolved once, on the first batch,
when the outputs' structure is known, into flat lists of terms that each
address one output by its path (`meshfit.steps.terms`); the steps in `meshfit.steps.builtin`
only loop over those lists.

Output names: a dict output's keys (nested keys joined with "/"), a
NamedTuple's or dataclass's field names, and `output_0`, `output_1`, ... for
the items of a list or tuple. Logs follow
Keras: `loss` is the weighted sum of the outputs' losses; with more than one
loss, `<output>_loss` is each output's own loss, before its weight; with more
than one output, a metric is logged as `<output>_<metric>`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from meshfit import losses as losses_lib
from meshfit import metrics as metrics_lib
from meshfit.steps.terms import LossTerm, MetricTerm, Output

__all__ = [
    "outputs_of",
    "Output",
]


def outputs_of(y_pred: Any) -> list[Output]:
    """The model's outputs, in `jax.tree` order (dict keys sorted), named as the module docstring says."""
    leaves = jax.tree_util.tree_flatten_with_path(y_pred)[0]
    if len(leaves) == 1 and not leaves[0][0]:
        return [Output("", ())]
    outputs = []
    for key_path, _ in leaves:
        path, names = [], []
        for depth, key in enumerate(key_path):
            if isinstance(key, jax.tree_util.DictKey):
                path.append(key.key)
                names.append(str(key.key))
            elif isinstance(key, jax.tree_util.SequenceKey):
                path.append(key.idx)
                names.append(f"output_{key.idx}" if depth == 0 else str(key.idx))
            elif isinstance(key, jax.tree_util.GetAttrKey):  # a NamedTuple's or a dataclass's field
                path.append(key.name)
                names.append(key.name)
            else:
                raise TypeError(
                    "A model's outputs must be an array, or a dict, list, tuple or NamedTuple of arrays. "
                    f"Received an output at {jax.tree_util.keystr(key_path)} inside a {type(y_pred).__name__}."
                )
        outputs.append(Output("/".join(names), tuple(path)))
    return outputs


def is_structure(value: Any) -> bool:
    """Whether a `compile` argument is given per output (a dict, list or tuple) rather than for all."""
    return isinstance(value, (dict, list, tuple))


def per_output(
    spec: Any, outputs: Sequence[Output], argument: str, entry: Callable[[Any], bool] = lambda value: True
) -> list:
    """`spec` given per output (a dict keyed by output name, or a list in output order), as one entry per output.

    Outputs the spec leaves out get None. `entry(value)` says whether a list
    value is one output's entry (rather than a nested list of them).
    """
    names = [o.name for o in outputs]
    if isinstance(spec, dict):
        unknown = [key for key in spec if key not in names and not _is_nested_key(key, spec, outputs)]
        if unknown:
            raise ValueError(
                f"`{argument}` has keys {unknown} that name no output of the model. "
                f"Expected keys among the output names {names}. Received: {argument}={spec!r}."
            )
        return [_lookup(spec, output) for output in outputs]
    if isinstance(spec, (list, tuple)) and len(spec) == len(outputs) and all(entry(v) for v in spec):
        return list(spec)
    raise ValueError(
        f"`{argument}` for a model with {len(outputs)} outputs must be a dict keyed by output name "
        f"(among {names}) or a list with one entry per output, in that order. Received: {argument}={spec!r}."
    )


def _lookup(spec: dict, output: Output) -> Any:
    """An output's entry in a dict spec: by its full name, or by walking its path through nested dicts."""
    if output.name in spec:
        return spec[output.name]
    node = spec
    for key in output.path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def _is_nested_key(key: Any, spec: dict, outputs: Sequence[Output]) -> bool:
    return isinstance(spec[key], dict) and any(o.path[:1] == (key,) for o in outputs)


def resolve_losses(loss: Any, loss_weights: Any, outputs: Sequence[Output]) -> list[LossTerm]:
    """The loss terms: `loss` for every output, or per output; `loss_weights` likewise (None: unweighted)."""
    if loss is None:
        return []
    losses = per_output(loss, outputs, "loss") if is_structure(loss) else [loss] * len(outputs)
    if loss_weights is None:
        weights = [None] * len(outputs)
    elif is_structure(loss_weights):
        weights = per_output(loss_weights, outputs, "loss_weights")
    elif len(outputs) == 1:
        weights = [loss_weights]
    else:
        raise ValueError(
            f"`loss_weights` for a model with {len(outputs)} outputs must be a dict keyed by output name "
            f"({[o.name for o in outputs]}) or a list in output order. Received: loss_weights={loss_weights!r}."
        )
    terms = [
        LossTerm(output, losses_lib.get(identifier), None if weight is None else float(weight))
        for output, identifier, weight in zip(outputs, losses, weights, strict=True)
        if identifier is not None
    ]
    if not terms:
        raise ValueError(f"`loss` gives no loss for any output. Received: loss={loss!r}.")
    return terms


def find_scalar_losses(terms: Sequence[LossTerm], y_true: Any, y_pred: Any) -> list[LossTerm]:
    """The terms, each marked `scalar` if its loss returns a scalar on these (abstract) targets and outputs.

    Traced with `jax.eval_shape`: nothing runs. Per-sample losses cost
    nothing more; only a scalar one makes the session pick the step by a
    batch's real rows (`meshfit.training.executables`).
    """
    marked = []
    for term in terms:
        values = jax.eval_shape(term.loss.call, term.output.of(y_true), term.output.of(y_pred))
        marked.append(term._replace(scalar=len(getattr(values, "shape", ())) == 0))
    return marked


def resolve_metrics(
    metrics: Any, weighted_metrics: Any, outputs: Sequence[Output], y_true: Any, y_pred: Any, loss: Any
) -> list[MetricTerm]:
    """The metric terms, with Keras's log names (prefixed by the output with several outputs, made unique)."""
    unweighted = _metric_entries(metrics, outputs, "metrics", loss)
    weighted = _metric_entries(weighted_metrics, outputs, "weighted_metrics", loss)
    prefix = len(outputs) > 1
    taken: dict[str, int] = {}
    terms = []
    for is_weighted, entries in ((False, unweighted), (True, weighted)):
        for output, identifier, output_loss in entries:
            metric = metrics_lib.get(
                identifier, y_true=_shape_of(y_true, output), y_pred=output.of(y_pred), loss=output_loss
            )
            name = _log_name(metric.name, output.name if prefix else "", is_weighted, taken)
            terms.append(MetricTerm(output, metric, is_weighted, name))
    return terms


def _metric_entries(spec: Any, outputs: Sequence[Output], argument: str, loss: Any) -> list[tuple]:
    """`(output, metric identifier, that output's loss identifier)` for each metric in `spec`."""
    if not spec:
        return []
    if len(outputs) == 1:
        per = [jax.tree.leaves(spec, is_leaf=lambda v: not is_structure(v))]
    else:
        is_entry = lambda v: not is_structure(v) or all(not is_structure(m) for m in v)  # noqa: E731
        per = per_output(spec, outputs, argument, entry=is_entry)
    output_losses = per_output(loss, outputs, "loss") if is_structure(loss) else [loss] * len(outputs)
    entries = []
    for output, output_loss, value in zip(outputs, output_losses, per, strict=True):
        if value is None:
            continue
        for identifier in value if is_structure(value) else [value]:
            entries.append((output, identifier, output_loss))
    return entries


def _shape_of(y_true: Any, output: Output) -> Any:
    try:
        return output.of(y_true)
    except (KeyError, IndexError, TypeError):
        return None


def _log_name(name: str, prefix: str, weighted: bool, taken: dict[str, int]) -> str:
    """Keras's `CompileMetrics.result` naming: a repeated name gets `_1`, `_2`, ...; a weighted one `weighted_`."""
    key = f"{prefix}_{name}" if prefix else name
    if key in taken and weighted:
        key = f"{prefix}_weighted_{name}" if prefix else f"weighted_{name}"
    if key not in taken:
        taken[key] = 1
        return key
    index = taken[key]
    taken[key] += 1
    return f"{key}_{index}"


def check_targets(
    y_true: Any, terms: Sequence[LossTerm | MetricTerm], outputs: Sequence[Output], argument: str = "y"
) -> None:
    """Raises a ValueError unless `y_true` has a target for every output a loss or metric reads."""
    for term in terms:
        try:
            target = term.output.of(y_true)
        except (KeyError, IndexError, TypeError):
            target = None
        if target is None or is_structure(target):
            expected = "an array" if len(outputs) == 1 else _structure_text(outputs)
            raise ValueError(
                f"`{argument}` has no target for the model's output '{term.output.name or 'output'}'. "
                f"Expected `{argument}` shaped like the model's outputs: {expected}. "
                f"Received: {jax.tree.map(lambda a: tuple(getattr(a, 'shape', ())), y_true)}."
            )


def _structure_text(outputs: Sequence[Output]) -> str:
    if all(isinstance(o.path[0], int) for o in outputs):
        return f"a list of {len(outputs)} arrays"
    return "a dict with keys " + ", ".join(repr(o.name) for o in outputs)
