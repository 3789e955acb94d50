"""What a rank tells `meshfit launch` of its end: the exception it raised, and whether it had taken a step.

The launcher restarts a failed job; but an error that every start repeats (a
backup directory that cannot be written, a bad argument) fails again the same
way, and a restart only spends time. So each rank the launcher starts writes,
when an exception ends it, one small JSON file the launcher named for it
(`ENV_EXIT_REPORT`, in a directory of mode 0700): the exception's type and
first line, when it was raised, and whether this process had finished a
training step (`first_step_taken`). From the reports the launcher tells an
error before the first step on every failing rank (no restart: the launch
ends at once, naming the rank that raised first) from a failure mid-training
(restart), and blames the rank that raised, not the one that died waiting for it.

A rank of a multi-process job that an exception ends exits at once after its
traceback and report: its peers are blocked in a collective with it, and the
`jax.distributed` shutdown would otherwise wait for them until a timeout.

Imports nothing of JAX: it is installed when meshfit is imported.
"""

from __future__ import annotations

import json
import os
import sys
import time

from meshfit.runtime import job_env

#: The file a rank writes its report to (set by `meshfit launch` for each rank of each start).
ENV_EXIT_REPORT = "MESHFIT_EXIT_REPORT"

_state = {"first_step": False, "installed": False}


def first_step_taken() -> None:
    """Notes that this process finished a training step: an error from now on is not a start's setup error."""
    _state["first_step"] = True


def install() -> None:
    """Reports the exception that ends this process to the launcher, if one started it (idempotent)."""
    path = os.environ.get(ENV_EXIT_REPORT)
    if not path or _state["installed"]:
        return
    _state["installed"] = True
    previous = sys.excepthook

    def report(kind, error, trace):
        previous(kind, error, trace)
        if issubclass(kind, (KeyboardInterrupt, SystemExit)):
            return
        lines = str(error).strip().splitlines()
        record = {
            "type": kind.__name__,
            "message": lines[0][:300] if lines else "",
            "first_step": _state["first_step"],
            "time": time.time(),
        }
        try:
            with open(path, "x") as f:  # (a name of the launcher's private directory; never overwritten)
                json.dump(record, f)
        except OSError:
            pass
        if int(os.environ.get(job_env.ENV_NUM_PROCESSES, "1")) > 1:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    sys.excepthook = report


def read(path: str) -> dict | None:
    """A rank's report (for the launcher), or None when it wrote none or it cannot be read."""
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("type"), str):
        return None
    return record
