"""How long a resumed job takes to its first step, with and without the persistent compilation cache.

For each setting, `examples/transformer_lm.py --backup-dir DIR` trains until it
is preempted (SIGTERM after a few steps: meshfit backs up and exits 143), then
runs again and resumes from the backup, as a restarted job would. The resumed
run reports the seconds XLA spent compiling (JAX's
`/jax/core/compile/backend_compile_duration` events), how many programs came
from the cache, and the time from its process start to its first step. With
the cache (BackupAndRestore's default, `<backup_dir>/.compilation_cache`), the
resumed run loads what the preempted one compiled; without it
(`--no-compilation-cache`), it compiles everything again. Target: compilation
>= 5x shorter with the cache.

    python benchmarks/bench_restart.py [--layers 2] [--d-model 128] [--context 64] [--settings without,with]

(`--smoke` resumes with the cache only: the script's path, not the ratio.)
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

from processes import Job  # noqa: E402
from smoke import parse_args  # noqa: E402

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
CACHE_REQUEST_EVENT = "/jax/compilation_cache/compile_requests_use_cache"


def child(argv: list[str], started: float, preempt_at: int | None) -> None:
    """Runs the example, printing each step and, at exit, the compile seconds, cache hits and first-step time."""
    import atexit

    devices = int(os.environ.pop("BENCH_RESTART_DEVICES"))
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={devices}")  # 8: the example's mesh
    import jax

    import meshfit as mf

    compiled = {"before": 0.0, "after": 0.0}  # compile seconds before and after the first step
    hits, misses, steps, first_step = [0], [0], [0], []

    def on_duration(event, seconds, **kwargs):
        if event == COMPILE_EVENT:
            compiled["after" if first_step else "before"] += seconds

    def on_event(event, **kwargs):
        if event == CACHE_HIT_EVENT:
            hits[0] += 1
        elif event == CACHE_REQUEST_EVENT:
            misses[0] += 1

    def on_batch_end(batch, logs):
        if not first_step:
            first_step.append(time.time() - started)
        steps[0] += 1
        if steps[0] == preempt_at:  # the way a cluster preempts: SIGTERM; meshfit backs up and exits 143
            os.kill(os.getpid(), signal.SIGTERM)

    def report():
        print(
            f"compile {compiled['before']:.3f} s before the first step, {compiled['after']:.3f} s after; "
            f"cache hits {hits[0]}, misses {misses[0] - hits[0]}; first step {first_step[0]:.3f} s",
            flush=True,
        )

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)
    atexit.register(report)
    import transformer_lm

    transformer_lm.main(argv, callbacks=[mf.callbacks.LambdaCallback(on_train_batch_end=on_batch_end)])


def run(args, backup: str, cache: bool) -> dict:
    """Preempts a first run after `--steps-before` steps, then times the resumed run."""
    argv = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        "--",
        f"--layers={args.layers}",
        f"--d-model={args.d_model}",
        f"--heads={args.heads}",
        f"--context={args.context}",
        f"--batch-size={args.batch_size}",
        f"--steps-per-epoch={args.steps_per_epoch}",
        "--epochs=2",
        "--validation-steps=2",
        "--sample-len=8",
        "--verbose=0",
        f"--backup-dir={backup}",
        *([] if cache else ["--no-compilation-cache"]),
    ]
    env = {**os.environ, "BENCH_RESTART_DEVICES": str(args.devices)}
    with Job([*argv, f"--preempt-at={args.steps_before}", f"--started={time.time()}"], 600, env) as first:
        if first.finish() != 143:
            raise RuntimeError(f"the preempted run exited {first.returncode}, not 143:\n{first.stderr[-2000:]}")
    with Job([*argv, f"--started={time.time()}"], 600, env) as resumed:
        if resumed.finish() != 0:
            raise RuntimeError(f"the resumed run exited {resumed.returncode}:\n{resumed.stderr[-2000:]}")
    (numbers,) = re.findall(
        r"^compile (\S+) s before the first step, (\S+) s after; cache hits (\d+), misses (\d+); first step (\S+) s$",
        resumed.stdout,
        re.M,
    ) or [RuntimeError(f"the resumed run did not report:\n{resumed.stdout[-2000:]}\n{resumed.stderr[-2000:]}")]
    if isinstance(numbers, Exception):
        raise numbers
    keys = ("compile", "compile_after", "hits", "misses", "first_step")
    return {key: float(n) for key, n in zip(keys, numbers, strict=True)}


def main():
    if "--child" in sys.argv:
        rest = sys.argv[sys.argv.index("--") + 1 :]
        started = float(rest.pop()[len("--started=") :])
        preempt_at = int(rest.pop()[len("--preempt-at=") :]) if rest[-1].startswith("--preempt-at=") else None
        child(rest, started, preempt_at)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps-per-epoch", type=int, default=20)
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (8: the example's 1x4x2 mesh)")
    parser.add_argument(
        "--steps-before", type=int, default=22, help="steps of the first run before its preemption (in epoch 2)"
    )
    parser.add_argument(
        "--settings",
        default="without,with",
        help="which resumes to run, of without,with (the cache); the ratio needs both",
    )
    args = parse_args(
        parser,
        layers=1,
        d_model=32,
        heads=2,
        context=16,
        batch_size=8,
        steps_per_epoch=4,
        steps_before=5,
        devices=1,
        settings="with",
    )
    settings = args.settings.split(",")
    if not settings or set(settings) - {"without", "with"}:
        parser.error(f"--settings takes a comma-separated subset of without,with. Received: {args.settings!r}.")
    root = tempfile.mkdtemp(prefix="meshfit-bench-restart-")
    try:
        results = {
            cache: run(args, os.path.join(root, f"cache{cache:d}"), cache)
            for cache in (False, True)
            if ("with" if cache else "without") in settings
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"transformer_lm {args.layers} layers, d_model {args.d_model}, context {args.context}, batch "
        f"{args.batch_size}; resumed after a preemption at step {args.steps_before}"
    )
    print(
        f"  {'':24s} {'compile s to 1st step':>22s} {'start to 1st step s':>20s} {'compile s after':>16s} "
        f"{'cache hits':>11s} {'misses':>7s}"
    )
    for cache, r in results.items():
        name = "with the cache" if cache else "without (compile again)"
        print(
            f"  {name:24s} {r['compile']:22.2f} {r['first_step']:20.2f} {r['compile_after']:16.2f} "
            f"{r['hits']:11.0f} {r['misses']:7.0f}"
        )
    if len(results) < 2:
        return
    ratio = results[False]["compile"] / max(results[True]["compile"], 1e-9)
    print(f"  compilation to the first step, without / with the cache = {ratio:.1f}x  (target >= 5)")
    print(f"  first step without / with = {results[False]['first_step'] / results[True]['first_step']:.2f}x")


if __name__ == "__main__":
    main()
