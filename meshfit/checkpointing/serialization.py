"""Compile settings as JSON: names, meshfit's built-in losses and metrics, and optimizers `get` built.

`model.save` writes how the model was compiled so that `load_model(path,
module)` evaluates, predicts and trains on with nothing passed again. What
can be written down:

- a name (`"adam"`, `"mse"`, `"accuracy"`) passes through;
- a built-in loss or metric (every public class of `meshfit.losses` and
  `meshfit.metrics`) is written as `{"__class__": "meshfit.losses.Huber",
  "config": {...}}`: its class and `get_config()`, from which
  `cls(**config)` builds an equal object; a built-in class itself, or a
  built-in function (`meshfit.losses.huber`), as `{"__class__": ...}` or
  `{"__function__": ...}`;
- a learning-rate schedule of `meshfit.optimizers.schedules` (`CosineDecay`,
  ...), as a class with its config, like a loss;
- an optimizer from `meshfit.optimizers.get` (`serialize_optimizer`), as
  `{"name": "adam", "config": {...}}`, when its arguments are JSON or such
  schedules;
- dicts, lists and tuples of these, nested (per-output losses and metrics),
  with None and number leaves; a tuple comes back a list, as JSON has no tuples.

Anything else (a user's function, loss or metric class, a raw optax
transformation, an optax learning-rate schedule) is code, which JSON cannot hold:
it is written as `{"__custom__": "<what it was>"}` and `unsaved` lists it, so
that `load_model` can ask for it instead of compiling with something else.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import optax

from meshfit import losses, metrics, optimizers, schedules

CLASS, FUNCTION, CUSTOM = "__class__", "__function__", "__custom__"
_MARKERS = (CLASS, FUNCTION, CUSTOM)
_MODULES = (losses, metrics, schedules)
_BASES = (losses.Loss, metrics.Metric, schedules.LearningRateSchedule)


def _qualified(obj) -> str:
    return f"{obj.__module__}.{obj.__name__}"


def _public(module, keep) -> dict[str, Any]:
    """The public names `module` defines itself that pass `keep`, by qualified name."""
    return {
        _qualified(value): value
        for name, value in vars(module).items()
        if not name.startswith("_") and getattr(value, "__module__", None) == module.__name__ and keep(value)
    }


def _is_builtin_class(value) -> bool:
    return (
        isinstance(value, type)
        and issubclass(value, _BASES)
        and value not in _BASES  # abstract: `call`, `update` left to subclasses
    )


def _is_builtin_function(value) -> bool:
    """A per-sample loss or metric function, `fn(y_true, y_pred, ...)`."""
    return inspect.isfunction(value) and list(inspect.signature(value).parameters)[:2] == ["y_true", "y_pred"]


#: Every public class of `meshfit.losses`, `meshfit.metrics` and `meshfit.schedules`, by qualified name
#: ("meshfit.losses.Huber").
CLASSES: dict[str, type] = {k: v for m in _MODULES for k, v in _public(m, _is_builtin_class).items()}
#: Every public loss and metric function, `fn(y_true, y_pred, ...)`, by qualified name ("meshfit.losses.huber").
FUNCTIONS: dict[str, Any] = {k: v for m in _MODULES for k, v in _public(m, _is_builtin_function).items()}


def describe(obj) -> str:
    """A short name for an object that cannot be saved, for error messages (`my_loss`, `MyMetric(name='m')`)."""
    if isinstance(obj, optax.GradientTransformation):
        recipe = optimizers.recipe_of(obj)
        if recipe is None:
            return "an optax transformation"
        odd = {k: v for k, v in recipe.config.items() if unsaved(serialize(v))}
        shown = ", ".join(f"{k}={describe(v) if callable(v) else type(v).__name__}" for k, v in odd.items())
        return f"{recipe.name!r} with {shown}"
    if hasattr(obj, "__qualname__"):  # a function or class
        return obj.__qualname__
    name = getattr(obj, "name", None)
    return f"{type(obj).__qualname__}(name={name!r})" if isinstance(name, str) else f"a {type(obj).__qualname__}"


def _custom(obj) -> dict:
    return {CUSTOM: describe(obj)}


_NOT_JSON = object()


def _scalar(value):
    """The Python value of a numpy or JAX scalar, else `_NOT_JSON`."""
    if isinstance(value, np.generic) or (hasattr(value, "item") and getattr(value, "shape", None) == ()):
        return value.item()
    return _NOT_JSON


def serialize(obj) -> Any:
    """A JSON-able record of a loss, metric, name or a nested dict/list/tuple of them.

    Never raises for what it cannot save: that part becomes `{"__custom__":
    description}` (see `unsaved`).
    """
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if _scalar(obj) is not _NOT_JSON:
        return _scalar(obj)
    if isinstance(obj, dict):
        if all(isinstance(k, str) and k not in _MARKERS for k in obj):
            return {k: serialize(v) for k, v in obj.items()}
        return {CUSTOM: f"a dict with keys {sorted(map(repr, obj))}"}
    if type(obj) in (list, tuple):  # not a NamedTuple such as an optax transformation
        return [serialize(v) for v in obj]
    if isinstance(obj, type) and CLASSES.get(_qualified(obj)) is obj:
        return {CLASS: _qualified(obj)}
    if inspect.isfunction(obj) and FUNCTIONS.get(_qualified(obj)) is obj:
        return {FUNCTION: _qualified(obj)}
    cls = type(obj)
    if CLASSES.get(_qualified(cls)) is cls:
        config = serialize(obj.get_config())
        if not unsaved(config):
            return {CLASS: _qualified(cls), "config": config}
    return _custom(obj)


def deserialize(record) -> Any:
    """The objects `serialize` wrote down: `deserialize(serialize(x))` equals `x` (tuples as lists).

    Raises:
        ValueError: for a part that could not be saved, or a class or function
            this meshfit does not have.
    """
    if isinstance(record, list):
        return [deserialize(v) for v in record]
    if not isinstance(record, dict):
        return record
    if CUSTOM in record:
        raise ValueError(
            "Expected a saved setting. Received: the placeholder of one that could not be saved, "
            f"{record[CUSTOM]} (code: not a name or one of meshfit's built-in losses, metrics and optimizers); "
            "pass the object itself again."
        )
    if CLASS in record:
        cls = _lookup(CLASSES, record[CLASS], "class")
        return cls(**deserialize(record["config"])) if "config" in record else cls
    if FUNCTION in record:
        return _lookup(FUNCTIONS, record[FUNCTION], "function")
    return {k: deserialize(v) for k, v in record.items()}


def _lookup(table: dict, name: str, what: str):
    if name not in table:
        raise ValueError(
            f"Expected a built-in meshfit loss, metric or schedule {what}. Received: {name!r}, which this version of "
            "meshfit does not have (saved by another version?); pass the setting again, or load with compile=False."
        )
    return table[name]


def unsaved(record) -> list[str]:
    """The descriptions of the parts of a `serialize` (or `serialize_optimizer`) record that could not be saved."""
    if isinstance(record, list):
        return [d for v in record for d in unsaved(v)]
    if isinstance(record, dict):
        if CUSTOM in record:
            return [record[CUSTOM]]
        return [d for v in record.values() for d in unsaved(v)]
    return []


def serialize_optimizer(optimizer) -> Any:
    """A JSON-able record of an optimizer: a name as is, `{"name": ..., "config": {...}}` for what
    `meshfit.optimizers.get` built from a name with JSON arguments (a float learning rate or a
    `meshfit.optimizers.schedules` schedule, not an optax one), else `{"__custom__": description}`."""
    if optimizer is None or isinstance(optimizer, str):  # None: compiled without one (`compile(optimizer=None)`)
        return optimizer
    recipe = optimizers.recipe_of(optimizer)
    config = None if recipe is None else serialize(recipe.config)
    if config is None or unsaved(config):
        return _custom(optimizer)
    return {"name": recipe.name, "config": config}


def deserialize_optimizer(record) -> Any:
    """The optimizer `serialize_optimizer` wrote down: a name, or `meshfit.optimizers.get(name, **config)`."""
    if isinstance(record, dict) and "name" in record and CUSTOM not in record:
        return optimizers.get(record["name"], **deserialize(record["config"]))
    return deserialize(record)
