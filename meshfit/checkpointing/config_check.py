"""Checks a saved model's compile record against what meshfit's built-ins accept, before anything is built.

`load_model` reads the JSON `model.save` wrote (`meshfit.checkpointing.serialization`) and
compiles with it. A record edited by hand, damaged, or written by a hostile
party could name a built-in with arguments it never takes (`Huber(delta=
Mean())`, `steps_per_execution=10**12`); `check_compile_record` refuses such a
record with a `ValueError` naming the field (`loss.config.delta`), what was
expected and what was received, before the module is made.

What a built-in accepts is read from the built-in itself: each argument's
annotation in the signature of a loss, metric or schedule class's
`__init__`, of the optax factory behind an optimizer name, or of
`meshfit.optimizers.get` (its default's type where there is no annotation).
Numbers must be finite. Ranges are the built-ins' own: once every type
passes, the object is built once (a loss, metric, schedule or optax
transformation: Python objects, nothing compiled or run) and a refusal
(`decay_steps` must be > 0, a threshold outside [0, 1], an unknown dtype) is
reported with the field's path. The entries of `compile` itself are checked
here: a step count must fit the int32 step counter.
"""

from __future__ import annotations

import collections.abc
import inspect
import json
import math
import types
import typing
from typing import Any

import jax
import numpy as np

from meshfit import losses, metrics, optimizers, schedules
from meshfit.checkpointing import serialization
from meshfit.checkpointing.serialization import CLASS, CUSTOM, FUNCTION
from meshfit.core import precision
from meshfit.steps.compile_settings import STEP_LIMIT

__all__ = ["ENTRIES", "STEP_LIMIT", "check_compile_record"]

#: The compile arguments a saved record holds, in `Model.compile`'s order.
ENTRIES = (
    "optimizer",
    "loss",
    "loss_weights",
    "metrics",
    "weighted_metrics",
    "steps_per_execution",
    "dtype_policy",
    "gradient_accumulation_steps",
)


_EMPTY = inspect.Parameter.empty


def check_compile_record(record: Any, skip: collections.abc.Container[str] = ()) -> None:
    """Raises a `ValueError` naming the first field of a saved compile record that meshfit would not accept.

    Args:
        record: the `"compile"` part of a saved model's record (None: saved uncompiled).
        skip: entries not to check (given again to `load_model`, which replace the saved ones).

    A placeholder for what `save` could not write down (`{"__custom__": ...}`)
    passes: `load_model` asks for it, or loads without the optimizer.
    """
    if record is None:
        return
    if not isinstance(record, dict):
        raise _refused("compile", "a dict of compile settings or null", record)
    unknown = sorted(set(record) - set(ENTRIES))
    if unknown:
        raise _refused(f"compile.{unknown[0]}", f"one of the entries {list(ENTRIES)}", record[unknown[0]])
    for entry, value in record.items():
        if entry not in skip:
            _ENTRY_CHECKS[entry](value, entry)


# -- the entries of compile ----------------------------------------------------------------------


def _check_optimizer(value: Any, path: str) -> None:
    if value is None or _is_custom(value):
        return
    if isinstance(value, str):
        if value.lower() not in optimizers.names():
            raise _refused(path, f"an optimizer name, one of {optimizers.names()}", value)
        return
    if not isinstance(value, dict) or set(value) != {"name", "config"}:
        raise _refused(path, 'an optimizer name or {"name": ..., "config": {...}}', value)
    if not isinstance(value["name"], str):
        raise _refused(f"{path}.name", f"an optimizer name, one of {optimizers.names()}", value["name"])
    _check_optimizer(value["name"], f"{path}.name")
    config = value["config"]
    if not isinstance(config, dict):
        raise _refused(f"{path}.config", "a dict of the optimizer's arguments", config)
    factory = optimizers.factory_of(value["name"])
    _check_arguments(config, {**_parameters(factory), **_parameters(optimizers.get, keyword_only=True)}, path)
    _build(lambda: optimizers.get(value["name"], **serialization.deserialize(config)), path, value["name"])


def _check_loss(value: Any, path: str) -> None:
    _check_identifiers(value, path, losses.Loss, lambda name: losses.get(name), "a loss")


def _check_metrics(value: Any, path: str) -> None:
    def known(name: str) -> None:
        if name.lower() not in ("accuracy", "acc"):  # resolved from the first batch's shapes
            metrics.get(name)

    _check_identifiers(value, path, (metrics.Metric, losses.Loss), known, "a metric")


def _check_loss_weights(value: Any, path: str) -> None:
    if value is None or _is_number(value):
        return
    if isinstance(value, list):
        for i, v in enumerate(value):
            _check_loss_weights(v, f"{path}[{i}]")
    elif isinstance(value, dict) and not _is_marked(value):
        for key, v in value.items():
            _check_loss_weights(v, f"{path}.{key}")
    else:
        raise _refused(path, "a finite number, or a dict/list of them per output", value)


def _step_count(optional: bool):
    def check(value: Any, path: str) -> None:
        if value is None and optional:
            return
        if not (isinstance(value, int) and not isinstance(value, bool) and 1 <= value < STEP_LIMIT):
            expected = f"a positive int below 2**31 (the step counter is int32){' or null' * optional}"
            raise _refused(path, expected, value)

    return check


def _check_dtype_policy(value: Any, path: str) -> None:
    if value is not None and value not in precision.names():
        raise _refused(path, f"a dtype policy name, one of {precision.names()}", value)


_ENTRY_CHECKS = {
    "optimizer": _check_optimizer,
    "loss": _check_loss,
    "loss_weights": _check_loss_weights,
    "metrics": _check_metrics,
    "weighted_metrics": _check_metrics,
    "steps_per_execution": _step_count(optional=False),
    "dtype_policy": _check_dtype_policy,
    "gradient_accumulation_steps": _step_count(optional=True),
}


# -- losses, metrics and schedules: names and built-in records -------------------------------------


def _check_identifiers(value: Any, path: str, base: type | tuple[type, ...], known_name, what: str) -> None:
    """A loss or metric setting: None, a name, a built-in's record, or a dict/list of these (per output)."""
    base_module = "meshfit.losses" if base is losses.Loss else "meshfit.metrics"
    if value is None or _is_custom(value):
        return
    if isinstance(value, str):
        try:
            known_name(value)
        except (TypeError, ValueError):
            raise _refused(path, f"{what} name meshfit knows (see {base_module})", value) from None
    elif _is_marked(value):
        _check_builtin(value, path, base)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_identifiers(v, f"{path}[{i}]", base, known_name, what)
    elif isinstance(value, dict):
        for key, v in value.items():
            _check_identifiers(v, f"{path}.{key}", base, known_name, what)
    else:
        raise _refused(path, f"{what} name, a built-in's record, or a dict/list of them per output", value)


def _check_builtin(record: dict, path: str, base: type | tuple[type, ...]) -> None:
    """A record of a built-in class (with its config) or function; `base`: the kinds of class the field takes."""
    if _is_custom(record):
        return
    if FUNCTION in record:
        if base is schedules.LearningRateSchedule:  # a loss or metric function is no learning rate
            raise _refused(path, "a finite number or a record of a meshfit.optimizers.schedules class", record)
        if set(record) != {FUNCTION} or record[FUNCTION] not in serialization.FUNCTIONS:
            raise _refused(path, f"a built-in function, one of {sorted(serialization.FUNCTIONS)}", record)
        return
    name = record.get(CLASS)
    cls = serialization.CLASSES.get(name) if isinstance(name, str) else None
    kinds = sorted(name for name, c in serialization.CLASSES.items() if issubclass(c, base))
    if cls is None or not issubclass(cls, base) or not set(record) <= {CLASS, "config"}:
        raise _refused(path, f"a record of a built-in class, one of {kinds}", record)
    if "config" not in record:  # the class itself
        return
    config = record["config"]
    if not isinstance(config, dict):
        raise _refused(f"{path}.config", f"a dict of {cls.__name__}'s arguments", config)
    accepted = _parameters(cls.__init__)
    if _takes_any_keyword(cls.__init__):  # a wrapper: the rest goes to its function, checked first
        fn = config.get("fn")
        _check_arguments({"fn": fn} if "fn" in config else {}, accepted, path)
        if isinstance(fn, dict) and fn.get(FUNCTION) in serialization.FUNCTIONS:
            accepted = {**_parameters(serialization.FUNCTIONS[fn[FUNCTION]]), **accepted}
    _check_arguments(config, accepted, path)
    _build(lambda: cls(**serialization.deserialize(config)), path, cls.__name__)


# -- arguments against a signature ------------------------------------------------------------------


def _parameters(fn, keyword_only: bool = False) -> dict[str, tuple[Any, Any]]:
    """`fn`'s named parameters: name -> (annotation, default), annotations resolved where they can be."""
    return {
        name: (_resolved(fn, name, p.annotation), p.default)
        for name, p in inspect.signature(fn).parameters.items()
        if name != "self"
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        and (not keyword_only or p.kind is p.KEYWORD_ONLY)
    }


def _resolved(fn, name: str, annotation: Any) -> Any:
    """One parameter's annotation as a type; `_EMPTY` (the default's type decides) where it does not resolve."""

    def holder() -> None: ...

    holder.__annotations__ = {name: annotation}
    try:
        return typing.get_type_hints(holder, globalns=getattr(inspect.unwrap(fn), "__globals__", None))[name]
    except Exception:  # a name the module imports only for type checkers
        return _EMPTY


def _takes_any_keyword(fn) -> bool:
    return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())


def _check_arguments(config: dict, accepted: dict[str, tuple[Any, Any]], path: str) -> None:
    for key, value in config.items():
        field = f"{path}.config.{key}"
        if key not in accepted:
            raise _refused(field, f"an argument the built-in takes, one of {sorted(accepted)}", value)
        annotation, default = accepted[key]
        if annotation is _EMPTY:
            annotation = _type_of_default(default)
        if _is_marked(value):
            if not _accepts_callable(annotation):
                raise _refused(field, _describe(annotation), value)
            base = schedules.LearningRateSchedule if key == "learning_rate" else object
            _check_builtin(value, field, base)
        elif not _accepts(annotation, value):
            raise _refused(field, _describe(annotation), value)


def _type_of_default(default: Any) -> Any:
    """What a parameter without annotation takes, from its default: its type; anything where it is None or absent."""
    if default is _EMPTY or default is None:
        return Any
    if isinstance(default, bool):
        return bool
    if isinstance(default, (int, float)):
        return float if isinstance(default, float) else int
    return type(default)


def _accepts(annotation: Any, value: Any) -> bool:
    """Whether a JSON value is of the annotated type (numbers finite)."""
    if annotation is Any:
        return True
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(a, value) for a in args)
    if annotation is type(None):
        return value is None
    if origin is typing.Literal:
        return value in args
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation in (float, complex):
        return _is_number(value)
    if annotation is str:
        return isinstance(value, str)
    if origin in (list, tuple, collections.abc.Sequence) or annotation in (list, tuple, collections.abc.Sequence):
        item = args[0] if args else Any
        return isinstance(value, list) and all(_accepts(item, v) for v in value)
    if annotation in (np.ndarray, jax.Array):
        return _is_number(value) or (isinstance(value, list) and all(_accepts(annotation, v) for v in value))
    return False  # a type JSON has no value of (np.dtype, a protocol, a callable: see `_accepts_callable`)


def _accepts_callable(annotation: Any) -> bool:
    if annotation is Any or annotation is collections.abc.Callable:
        return True
    if typing.get_origin(annotation) is collections.abc.Callable:
        return True
    return typing.get_origin(annotation) in (typing.Union, types.UnionType) and any(
        _accepts_callable(a) for a in typing.get_args(annotation)
    )


def _describe(annotation: Any) -> str:
    """What an annotation accepts, in words."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        words = [_describe(a) for a in args]
        return " or ".join(dict.fromkeys(w for w in words if w))
    if annotation is type(None):
        return "null"
    if origin is typing.Literal:
        return f"one of {list(args)}"
    if origin in (list, tuple, collections.abc.Sequence):
        return f"a list of ({_describe(args[0]) if args else 'anything'})"
    if _accepts_callable(annotation):
        return "a built-in function or schedule"
    simple = {bool: "a bool", int: "an int", float: "a finite number", complex: "a finite number", str: "a str"}
    if annotation in simple:
        return simple[annotation]
    if annotation in (np.ndarray, jax.Array):
        return "a list of finite numbers"
    return ""  # a type JSON has no value of: left out of the words


# -- small helpers --------------------------------------------------------------------------------


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_marked(value: Any) -> bool:
    return isinstance(value, dict) and any(marker in value for marker in (CLASS, FUNCTION, CUSTOM))


def _is_custom(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {CUSTOM} and isinstance(value[CUSTOM], str)


def _build(make, path: str, what: str) -> None:
    """Builds the object once (nothing compiled or run): its own checks of ranges, reported at `path`."""
    try:
        make()
    except (TypeError, ValueError) as error:
        raise _refused_because(path, f"{what} refuses its saved arguments: {str(error).rstrip('.')}") from None


def _refused(path: str, expected: str, received: Any) -> ValueError:
    text = json.dumps(received, default=repr)
    if len(text) > 200:
        text = text[:200] + "..."
    return _refused_because(path, f"expected {expected}. Received: {path}={text}")


def _refused_because(path: str, why: str) -> ValueError:
    entry = path.split(".")[0].split("[")[0]
    again = f"pass `{entry}` to load_model again (load_model(path, module, {entry}=...)), or "
    again = again if entry in ENTRIES else ""
    return ValueError(
        f"The saved model's compile setting `{path}` is not one meshfit accepts: {why}. The record was written "
        f"by another version, edited or damaged: {again}load with compile=False for the weights alone."
    )
