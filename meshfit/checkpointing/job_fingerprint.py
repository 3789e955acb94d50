"""What a backup belongs to: the model and compile settings of the fit that wrote it.

`BackupAndRestore` restores a fit's arrays into the live state, and a backup
of the same architecture fits any compile of it: restored into a fit compiled
with `lr=0.001`, one written by a fit compiled with `lr=0.5` would carry its
optimizer state and injected learning rate over and train on with 0.5,
silently. So every backup (on disk and in a memory snapshot) records the
fingerprint of the fit that wrote it, and a fit refuses one whose fingerprint
differs from its own, naming what differs (`differences`).

The fingerprint is JSON, one entry per thing that must match (the model's
arrays are compared by the restore itself, which names the arrays that differ:
`CheckpointMismatch`):

  * the compile record `model.save` writes (`checkpointing.saving.compile_record`):
    optimizer and its hyperparameters, loss, loss weights, metrics,
    steps_per_execution, dtype policy, gradient accumulation;
  * `optimizer_constants`, for an optimizer that record cannot write down (an
    optax transformation built by hand): a digest of the constants its
    functions close over (`optax.adam(0.5)` and `optax.adam(1e-3)` differ
    there), so hand-built optimizers are told apart too.

Callbacks that change a hyperparameter during training (`ReduceLROnPlateau`)
change the optimizer's state, not the compile: the fingerprint stays the same.
"""

from __future__ import annotations

import functools
import hashlib
import json
import types
from typing import Any

import jax
import numpy as np

from meshfit.checkpointing import saving, serialization

#: The backup's JSON entry holding it.
KEY = "job"
#: How deep `_constants` follows closures and containers: optax chains nest a few levels.
_DEPTH = 12


class BackupOfAnotherJob(ValueError):
    """A backup written by a fit compiled differently from the one restoring it."""


def of(model) -> dict[str, Any]:
    """The fingerprint of `model` as compiled (see the module)."""
    record = saving.compile_record(model) or {}
    found: dict[str, Any] = dict(record)
    settings = model.compile_settings
    if settings is not None and serialization.unsaved(record.get("optimizer")):
        found["optimizer_constants"] = _digest(_constants(settings.optimizer_id, _DEPTH, set()))
    return found


def differences(saved: Any, live: dict[str, Any]) -> list[str]:
    """What differs between a backup's fingerprint and this fit's, as "entry: saved ..., now ..." lines;
    empty when they match or the backup has none (written before fingerprints were recorded)."""
    if not isinstance(saved, dict):
        return []
    found = []
    for entry in sorted(set(saved) | set(live)):
        if _canonical(saved.get(entry)) != _canonical(live.get(entry)):
            found.append(f"{entry}: saved {_short(saved.get(entry))}, now {_short(live.get(entry))}")
    return found


def _constants(value: Any, depth: int, seen: set[int]) -> Any:
    """The plain values `value` is made of, following functions' closures and defaults: what tells two
    transformations built by the same code with different numbers apart. Addresses and ids never enter."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if depth == 0 or id(value) in seen:
        return type(value).__qualname__
    seen = seen | {id(value)}
    if isinstance(value, (np.ndarray, np.generic, jax.Array)):
        array = np.asarray(value)
        return [str(array.dtype), list(array.shape), _digest(array.tobytes()) if array.nbytes <= 1 << 20 else None]
    if isinstance(value, (list, tuple)):
        return [type(value).__qualname__, [_constants(v, depth - 1, seen) for v in value]]
    if isinstance(value, dict):
        return {str(k): _constants(v, depth - 1, seen) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, functools.partial):
        return ["partial", _constants((value.func, value.args, value.keywords), depth - 1, seen)]
    if isinstance(value, types.FunctionType):
        cells = [cell.cell_contents for cell in value.__closure__ or () if _filled(cell)]
        return [value.__qualname__, _constants((value.__defaults__, value.__kwdefaults__, cells), depth - 1, seen)]
    if isinstance(value, types.MethodType):
        return _constants(value.__func__, depth - 1, seen)
    return type(value).__qualname__


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _digest(value: Any) -> str:
    raw = value if isinstance(value, bytes) else _canonical(value).encode()
    return hashlib.sha256(raw).hexdigest()[:16]


def _short(value: Any) -> str:
    text = _canonical(value)
    return text if len(text) <= 120 else text[:117] + "..."
