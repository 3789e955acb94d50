"""Where a process's start goes, from its creation to its first training step.

A restarted job is worth only as much as the seconds it takes to train again;
those seconds go to the interpreter and imports, joining `jax.distributed`,
the user's script building its model, the restore, and the first step's
compile. Each layer marks when it reached its phase (`mark`), and under
`meshfit launch --verbose` (`ENV_VERBOSE`) each rank prints one line at its
first step with every phase's seconds, so the slow one is found without a
profiler:

    [rank 1] meshfit: start 1 reached its first step 3.91 s after its process was created: interpreter and
    imports 0.52 s, JAX and jax.distributed 0.61 s, the script until fit 1.74 s, fit's setup and the restore
    0.31 s, compile 0.45 s, first step 0.28 s.

Imports nothing of JAX: meshfit marks its own import from `meshfit/__init__`.
"""

from __future__ import annotations

import json
import os
import sys
import time

#: Set (to 1) by `meshfit launch --verbose` for every rank: print the start's phases at the first step.
ENV_VERBOSE = "MESHFIT_VERBOSE"
#: Set by `meshfit launch` for rank 0 of each start: the file where it lists, at its first step, the modules
#: its script imported from the installed libraries, which the launch's fork server imports for the next start.
ENV_IMPORTS_REPORT = "MESHFIT_IMPORTS_REPORT"

#: The phases, in the order a start reaches them: (the mark that ends it, how the line names it).
PHASES = (
    ("meshfit imported", "interpreter and imports"),
    ("joined", "JAX and jax.distributed"),
    ("fit called", "the script until fit"),
    ("train began", "fit's setup and the restore"),
    ("first step", "first step"),
)

_marks: dict[str, float] = {}
_handed_over: list[tuple[float, str]] = []  # when and how a process forked ahead became this start's rank


def mark(name: str) -> None:
    """Notes that this process reached the phase-ending mark `name` (one of `PHASES`); the first time counts."""
    _marks.setdefault(name, time.time())


def reached(name: str) -> bool:
    """Whether this process reached the mark `name`."""
    return name in _marks


def restart_clock(now: float, how: str) -> None:
    """This process becomes a start's rank only `now`, `how` says in what way (forked from a process whose
    imports were done before): its phases count from here, the imports taking none of them."""
    _marks.clear()
    _handed_over[:] = [(now, how)]
    mark("meshfit imported")


def verbose() -> bool:
    """Whether the launcher asked for the phases (`meshfit launch --verbose`)."""
    return os.environ.get(ENV_VERBOSE, "") not in ("", "0")


def process_created() -> float | None:
    """When this process was created (wall clock, from /proc), before its interpreter started; None off Linux."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def summary(compile_seconds: float = 0.0) -> str:
    """One line: the seconds from this process's creation to each mark reached, split by phase.

    `compile_seconds` (the fit timer's, spent before the first step was done) is taken out of the first step's
    phase and named on its own.
    """
    created = _handed_over[0][0] if _handed_over else process_created()
    last = created if created is not None else min(_marks.values(), default=time.time())
    parts = []
    for name, label in PHASES:
        if name not in _marks:
            continue
        seconds = _marks[name] - last
        if name == "first step":
            compiled = min(max(compile_seconds, 0.0), seconds)
            parts.append(f"compile {compiled:.2f} s")
            seconds -= compiled
        parts.append(f"{label} {seconds:.2f} s")
        last = _marks[name]
    start = os.environ.get("MESHFIT_RESTART_COUNT", "0")
    since = _handed_over[0][1] if _handed_over else "its process was created"
    total = f" {last - created:.2f} s after {since}" if created is not None else ""
    return f"meshfit: start {start} reached its first step{total}: {', '.join(parts)}."


def first_step(compile_seconds: float = 0.0) -> None:
    """Marks the first training step as done; under `--verbose`, prints the start's phases (once)."""
    if "first step" in _marks:
        return
    mark("first step")
    _report_imports()
    if verbose():
        print(summary(compile_seconds), file=sys.stderr, flush=True)


def _report_imports() -> None:
    """Lists, where the launcher asked (`ENV_IMPORTS_REPORT`), the modules imported from the installed
    libraries, the standard library and meshfit: what every later start's script imports again. Modules from the
    script's own directory are left out (the user may change them; their imports may act)."""
    path = os.environ.get(ENV_IMPORTS_REPORT)
    if not path:
        return
    import sysconfig

    roots = tuple(
        os.path.join(os.path.realpath(p), "")
        for p in {*sysconfig.get_paths().values(), *(p for p in sys.path if p.endswith("-packages"))}
    )
    names = [
        name
        for name, module in list(sys.modules.items())
        if not name.startswith("_")
        and (
            name.partition(".")[0] == "meshfit"
            or os.path.realpath(getattr(module, "__file__", None) or "/").startswith(roots)
        )
    ]
    try:
        with open(path + ".part", "w") as f:
            json.dump(names, f)
        os.replace(path + ".part", path)
    except OSError:
        pass  # a restart then imports them itself
