"""A warm spare: a rank's process started ahead of a restart, its libraries already imported.

A restarted rank spends its first seconds starting Python and importing JAX,
Flax, Optax, Orbax and meshfit, the same for every start. `meshfit launch`
(`meshfit.launch.spares`) therefore starts, beside each running rank, this
module with the environment the rank's next start will have: it imports
those libraries, without initialising any JAX backend (`jax.distributed`
must come first), and waits. At a restart the launcher writes it one line of
JSON on its stdin, `{"env": {...}, "argv": [...]}`: the variables of that
start (its coordinator port, its exit report), and the script with its
arguments. The spare takes them as its own and runs the script as
`python script.py` would (`__main__`, `sys.argv`, the script's directory
first on `sys.path`), or a `-m module` as `python -m` would.

A spare whose import turned a JAX backend on (a site customisation), or
whose stdin closes before a start, exits; the launcher then starts that
rank from scratch.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time

#: What a rank's start imports that a spare imports before it is needed.
PRELOADED = ("numpy", "jax", "jax.numpy", "flax.nnx", "optax", "orbax.checkpoint", "meshfit.model", "meshfit.callbacks")
#: The line a spare prints when it has imported `PRELOADED` and waits for its start.
READY = "meshfit-spare-ready"


def _preload() -> bool:
    """Imports `PRELOADED`; whether the process can still join a `jax.distributed` job (no backend on)."""
    import importlib

    for name in PRELOADED:
        importlib.import_module(name)
    from meshfit.core import compat

    return not compat.backends_are_initialized()


def _take(start: dict) -> list[str]:
    """Makes this process the rank `start` describes: its environment, stdin, reports; returns its argv."""
    os.environ.clear()
    os.environ.update(start["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the launcher's pipe served its purpose; a rank reads no input
    os.close(null)
    from meshfit.runtime import exit_report, start_phases

    start_phases.restart_clock(time.time())  # the start's phases count from the hand-over
    exit_report.install()  # the start's report file is known only now
    return list(start["argv"])


def main() -> None:
    if not _preload():
        print("meshfit: a warm spare found a JAX backend on after its imports; not usable.", flush=True)
        sys.exit(3)
    print(READY, flush=True)
    line = sys.stdin.readline()
    if not line.strip():
        return  # the launcher is done with this spare
    argv = _take(json.loads(line))
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
