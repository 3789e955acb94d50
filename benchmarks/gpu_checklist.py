"""What a lent GPU measures, stage by stage, each stage one command under the device's 10-minute limit.

A GPU comes to a session rarely and for 30 minutes of device time; this list
keeps those minutes for measuring, not for typing commands. The figures are
those issues 29 and 30 wait for (`benchmarks/RESULTS.md` says which row each
fills):

    python benchmarks/gpu_checklist.py --list            # the stages and their commands
    python benchmarks/gpu_checklist.py mfu fit           # runs stages in order; logs under --logs
    python benchmarks/gpu_checklist.py --check           # every command's flags parse (the suite runs this)

On the device machine (`run` tool): `pip install --no-deps -e . && python
benchmarks/gpu_checklist.py --logs $OUT mfu`, one or two stages a call.
"""

from __future__ import annotations

import argparse
import os
import runpy
import subprocess
import sys
import time
from typing import NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))


class Stage(NamedTuple):
    name: str
    what: str  # the figure it gives, and the issue item waiting for it
    script: str
    args: tuple[str, ...]
    minutes: int  # about how long it takes on an H100/H200 (compilation included)


def decoder(name: str, what: str, preset: str, contenders: str, batch: int, repeats: int, minutes: int) -> Stage:
    """`bench_transformer.py` on the fast decoder options (docs/performance.md, "Fast decoder options")."""
    fast = ("--scan-layers", "--position", "rope", "--attention", "cudnn", "--remat", "minimal", "--loss-chunk", "512")
    sizes = ("--batch", str(batch), "--steps", "10", "--repeats", str(repeats))
    args = ("--preset", preset, *fast, "--policies", "mixed_bfloat16", "--contenders", contenders, *sizes)
    return Stage(name, what, "bench_transformer.py", args, minutes)


STAGES = (
    decoder(
        "mfu",
        "issue 30 item 1: MFU >= 50 % of a >= 1 B decoder through fit, and meshfit / hand-written >= 0.98",
        "1b",
        "raw,meshfit",
        batch=8,
        repeats=3,
        minutes=8,
    ),
    decoder("350m", "issue 30 item 1: the table's smallest size, 350 M (meshfit only)", "350m", "meshfit", 16, 2, 5),
    decoder(
        "2b",
        "issue 30 item 1: the largest preset that trains in bf16 with Adam on one 80 GB GPU (meshfit only)",
        "2b",
        "meshfit",
        batch=8,
        repeats=2,
        minutes=8,
    ),
    Stage(
        "fit",
        "issue 30 item 2: the tiny MLP's spe=32 scan against the raw scan on the GPU (>= 0.95)",
        "bench_fit.py",
        ("--repeats", "5"),
        3,
    ),
    Stage(
        "checkpoint",
        "issue 30 item 3: the time a save holds the loop, async / sync <= 0.10, at the default interval",
        "bench_checkpoint.py",
        (),
        4,
    ),
    Stage(
        "checkpoint-200",
        "issue 30 item 3: the same at a save every 200 steps",
        "bench_checkpoint.py",
        ("--steps", "400", "--every", "200", "--repeats", "2"),
        5,
    ),
    Stage(
        "plan",
        "issue 29: predicted against measured peak memory and step time, each candidate in its own process",
        "bench_plan.py",
        ("--isolate",),
        8,
    ),
    Stage(
        "snapshot",
        "issue 39: where a 3.75-GiB memory-tier snapshot's seconds go, against device_get and a socket",
        "bench_snapshot.py",
        ("--gib", "3.75", "--repeats", "2"),
        2,
    ),
    Stage(
        "recovery",
        "issue 39: kill to first resumed step and the loop's hold with a GPU-sized state (350 M decoder)",
        "bench_recovery.py",
        ("--gpu", "--model", "decoder", "--epochs", "2", "--failures", "1", "--memory-only", "--cost-rounds", "0"),
        5,
    ),
)


def command(stage: Stage) -> list[str]:
    return [sys.executable, os.path.join(HERE, stage.script), *stage.args]


class _Parsed(Exception):
    """Raised by the checking `parse_args` once a benchmark's flags parsed: nothing after it runs."""


def check(stage: Stage) -> None:
    """Parses `stage`'s flags with its benchmark's own parser, running nothing after the parse."""
    real = argparse.ArgumentParser.parse_args

    def parse_only(parser, args=None, namespace=None):
        real(parser, args, namespace)  # exits 2 naming the flag, as argparse does, if one is wrong
        raise _Parsed

    argparse.ArgumentParser.parse_args, argv = parse_only, sys.argv
    sys.argv, sys.path = [stage.script, *stage.args], [HERE, *sys.path]
    try:
        runpy.run_path(os.path.join(HERE, stage.script), run_name="__main__")
    except _Parsed:
        return
    finally:
        argparse.ArgumentParser.parse_args, sys.argv, sys.path = real, argv, sys.path[1:]
    raise RuntimeError(f"{stage.script} ran without parsing its arguments")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stages", nargs="*", help=f"stages to run, in order: {', '.join(s.name for s in STAGES)}")
    parser.add_argument("--list", action="store_true", help="print the stages and their commands")
    parser.add_argument("--check", action="store_true", help="parse every stage's flags; run nothing")
    parser.add_argument("--logs", default=os.environ.get("OUT", "gpu-logs"), help="where each stage's log goes")
    args = parser.parse_args()
    by_name = {stage.name: stage for stage in STAGES}
    unknown = [name for name in args.stages if name not in by_name]
    if unknown:
        parser.error(f"unknown stages {unknown}; the stages are {list(by_name)}")
    if args.list or not (args.stages or args.check):
        for stage in STAGES:
            print(f"{stage.name:15s} ~{stage.minutes} min  {stage.what}\n{'':15s} {' '.join(command(stage)[1:])}")
        return
    if args.check:
        for stage in STAGES:
            check(stage)
            print(f"{stage.name}: flags parse")
        return
    os.makedirs(args.logs, exist_ok=True)
    failed = []
    for name in args.stages:
        stage = by_name[name]
        log = os.path.join(args.logs, f"{name}.log")
        print(f"== {name}: {stage.what}\n   {' '.join(command(stage)[1:])}  (log: {log})", flush=True)
        start = time.perf_counter()
        with open(log, "w") as out:
            done = subprocess.run(command(stage), stdout=out, stderr=subprocess.STDOUT, check=False)
        print(f"   exit {done.returncode} after {time.perf_counter() - start:.0f} s", flush=True)
        with open(log) as out:
            print("".join(out.readlines()[-40:]), flush=True)
        if done.returncode != 0:
            failed.append(name)
    if failed:
        sys.exit(f"stages that failed: {failed}")


if __name__ == "__main__":
    main()
