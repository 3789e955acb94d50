"""What a rank tells `meshfit launch` of its end: the exception it raised, and whether it had taken a step.

The launcher restarts a failed job; but an error that every start repeats (a
backup directory that cannot be written, a bad argument) fails again the same
way, and a restart only spends time. So each rank the launcher starts writes,
when an exception ends it, one small JSON file the launcher named for it
(`ENV_EXIT_REPORT`, in a directory of mode 0700): the exception's type and
first line, when it was raised, and whether this process had finished a
training step (`start_phases`' "first step" mark). From the reports the launcher tells an
error before the first step on every failing rank (no restart: the launch
ends at once, naming the rank that raised first) from a failure mid-training
(restart), and blames the rank that raised, not the one that died waiting for it.

A rank of a multi-process job that an exception ends exits at once after its
traceback and report: its peers are blocked in a collective with it, and the
`jax.distributed` shutdown would otherwise wait for them until a timeout.
When the exception is a collective that broke because a peer is gone
(`PEER_GONE`: the connection closed under it), the rank prints one line
instead of the traceback (all of it under `meshfit launch --verbose`): the
cause is the peer, which the launcher names, and a traceback through the
step would read like an error of this rank's own (often wrapped in a
checkpoint write that was gathering across the ranks).

Imports nothing of JAX: it is installed when meshfit is imported.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

from meshfit.runtime import job_env, start_phases

#: The file a rank writes its report to (set by `meshfit launch` for each rank of each start).
ENV_EXIT_REPORT = "MESHFIT_EXIT_REPORT"

#: What a collective's error says when the peer it was talking to is gone (gloo's TCP pairs, NCCL's remote
#: errors, the coordination service's disconnections).
PEER_GONE = re.compile(
    r"Connection (closed|reset) by peer|Gloo \w+ failed|Broken pipe|ncclRemoteError|"
    r"task .* (disconnected|has been stopped)|heartbeat timeout",
    re.IGNORECASE,
)

_state = {"installed": False}


def broken_collective(error: BaseException) -> BaseException | None:
    """`error`, or the exception it was raised from or while handling, that is a collective broken by a peer
    that is gone (`PEER_GONE`); None when there is none."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if PEER_GONE.search(str(current)):
            return current
        current = current.__cause__ or current.__context__
    return None


def install() -> None:
    """Reports the exception that ends this process to the launcher, if one started it (idempotent)."""
    path = os.environ.get(ENV_EXIT_REPORT)
    if not path or _state["installed"]:
        return
    _state["installed"] = True
    previous = sys.excepthook

    def report(kind, error, trace):
        several = int(os.environ.get(job_env.ENV_NUM_PROCESSES, "1")) > 1
        broken = broken_collective(error) if several else None
        if broken is not None and not start_phases.verbose():
            first = (str(broken).strip().splitlines() or [""])[0][:300]
            print(
                f"meshfit: this process ends: a collective broke because another process of the job is gone "
                f"({type(broken).__name__}: {first}). `meshfit launch --verbose` shows the traceback.",
                file=sys.stderr,
                flush=True,
            )
        else:
            previous(kind, error, trace)
        if issubclass(kind, (KeyboardInterrupt, SystemExit)):
            return
        lines = str(error).strip().splitlines()
        record = {
            "type": kind.__name__,
            "message": lines[0][:300] if lines else "",
            "first_step": start_phases.reached("first step"),
            "time": time.time(),
        }
        try:
            with open(path, "x") as f:  # (a name of the launcher's private directory; never overwritten)
                json.dump(record, f)
        except OSError:
            pass
        if several:
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
    fields = {"type": str, "message": str, "first_step": bool}
    if not isinstance(record, dict) or not all(isinstance(record.get(k), kind) for k, kind in fields.items()):
        return None  # not a report this module wrote: nothing to act on
    return record
