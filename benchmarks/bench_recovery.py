"""Recovery from a killed rank: steps lost and seconds to the first resumed step, disk backups vs the memory tier.

A `meshfit launch --max-restarts F` job trains a model
(MultiWorkerMirroredStrategy, batches of 32, 44 steps an epoch) with
`BackupAndRestore`. `--model` picks it, or several, comma-separated (each row
names its model): `digits`, the MLP of `examples/digits.py`; `transformer`,
`examples/transformer_lm.py`'s decoder at a small CPU size (2 layers, d_model
64, 4 heads, context 32: tens of ms a step) on the example's windows of
standard-library bytes, its module and data built by the example's own
functions; `wide`, the digits MLP at 64-8192-8192-10, whose Adam state is 775
MiB (a snapshot of a real size for the 2-core machine). `--nprocs` sets the
job's processes on the CPU (default 2). In the i-th start, the last rank
SIGKILLs itself at a random step
(seeded) once its devices have computed that step (JAX dispatches steps ahead
of the device: the Python step counter alone can run several steps past the
state that exists), and the launcher restarts the job. For each failure: the
steps lost (killed step - resumed step) and the wall time from the kill to the
first step after the resume, with when each rank reached each phase of its
start (process created, meshfit imported, `jax.distributed` joined, the
script's libraries imported, the model built, the backup restored), in
seconds from the kill. The compilation cache is on from before the model is
built (`mf.compilation_cache.use`, the one BackupAndRestore then keeps;
`--no-early-cache`: only BackupAndRestore's own, from the fit's start). Two
settings: disk-only backups every `--disk-freq` steps, and the same disk
backups plus the memory tier every `--memory-freq` steps.

The tier's cost per step: two jobs without failures and without disk backups
within the run, one with the memory tier and one without; from the loop's phases (`FitTimer`), the time the loop is held
in "checkpoint" per step after the first, over the mean step time, and the
difference of the runs' mean step times (noisier: it includes the background
copy and transfer, on a shared 2-core machine).

    python benchmarks/bench_recovery.py [--model digits|transformer|digits,transformer] [--failures 3]
                                        [--memory-freq 5] [--disk-freq 100] [--seed 0] [--no-early-cache]
                                        [--cost-rounds 1] [--no-fork-server]

`--smoke` runs the digits MLP only (a transformer job adds its own start-up and compiles). `--gpu` runs one
process on the machine's GPU (it is the rank killed) and `--model decoder` a GPU-sized decoder (the 350 M
preset, a 4.2-GB state to snapshot); `--memory-only` leaves out the disk-only failures:

    python benchmarks/bench_recovery.py --gpu --model decoder --epochs 2 --failures 1 --memory-only
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

from smoke import parse_args  # noqa: E402

STEPS_PER_EPOCH = 44  # 1437 training rows of digits in batches of 32, the partial batch dropped; as many windows
# Small enough for tens of ms a step on a CPU; the example's flags, so its own parser fills in the rest.
TRANSFORMER_FLAGS = ["--layers", "2", "--d-model", "64", "--heads", "4", "--context", "32", "--max-bytes", "100000"]
# A GPU's size: the 350 M preset at context 512 on synthetic tokens, bf16 compute with float32 Adam (a 4.2-GB
# state, so each snapshot moves that much from the device to the keeper).
DECODER_FLAGS = ["--preset", "350m", "--context", "512", "--vocab", "32768", "--scan-layers", "--position", "rope"]
DECODER_FLAGS += ["--remat", "minimal", "--dtype-policy", "mixed_bfloat16", "--batch-size", "32"]
DECODER_FLAGS += ["--steps-per-epoch", str(STEPS_PER_EPOCH)]
MODELS = {
    "digits": "digits MLP (64-128-128-10)",
    "transformer": "transformer_lm (2 layers, d_model 64, 4 heads, context 32, bytes)",
    "decoder": "transformer_lm 350m preset at context 512 (24 x 1024, vocab 32,768), mixed_bfloat16: for a GPU",
    "wide": "digits MLP 64-8192-8192-10 with Adam: a 775-MiB state to snapshot (67.7 M parameters x 3)",
}
EARLY_CACHE = True  # --no-early-cache: only BackupAndRestore's cache, from the fit's start
GPU = False  # --gpu: one process on the machine's GPU (the killed rank is rank 0), not 2 on the CPU
NPROCS = 2  # --nprocs: processes of the job on the CPU (the last is the one killed)
FORK_SERVER = True  # --no-fork-server: `meshfit launch --no-fork-server` (each rank a new interpreter)


def build(name: str):
    """(a factory of the module, x, y, dtype policy) of `--model` `name`; prints the "libraries" phase once its
    example is imported, before the data are loaded."""
    from flax import nnx

    if name in ("digits", "wide"):
        from digits import MLP, load_data  # with scikit-learn

        _phase("libraries")
        x, _, y, _ = load_data()
        width = 128 if name == "digits" else 8192
        return (lambda: MLP(64, width, 10, rngs=nnx.Rngs(0))), x, y, "float32"
    import transformer_lm

    _phase("libraries")
    options = transformer_lm.parse_args(TRANSFORMER_FLAGS if name == "transformer" else DECODER_FLAGS)
    (x, y), _, _ = transformer_lm.load_data(options)
    if len(x) < STEPS_PER_EPOCH * 32:
        raise RuntimeError(f"transformer: {len(x)} windows, fewer than an epoch's {STEPS_PER_EPOCH * 32}")
    kwargs = transformer_lm.module_options(options)
    return (lambda: transformer_lm.TransformerLM(**kwargs, rngs=nnx.Rngs(0))), x, y, options.dtype_policy


def _phase(name: str, when: float | None = None) -> None:
    """Prints "a<start> phase <name> t=<time>": when this start of the rank reached `name` (wall clock)."""
    start = os.environ.get("MESHFIT_RESTART_COUNT", "0")
    print(f"a{start} phase {name} t={time.time() if when is None else when:.4f}", flush=True)


def worker(args) -> None:
    """One rank: trains, prints "a<start> step <n> t=<time>" after each batch; rank 1 kills itself at its step
    once the devices have computed it (so the step killed at is a step whose state existed).

    Each rank also prints "a<start> phase <name> t=<time>" as it starts: the process created, meshfit (and JAX)
    imported, the `jax.distributed` job joined, the model compiled, the backup restored."""
    start = int(os.environ.get("MESHFIT_RESTART_COUNT", "0"))
    from meshfit.runtime.start_phases import process_created  # (no JAX: the phases below stay apart)

    _phase("process", process_created())
    import meshfit as mf

    _phase("imported")
    strategy = mf.strategies.MultiWorkerMirroredStrategy()
    _phase("joined")
    if args.early_cache:
        # The cache from the first compile on, the model's initialisers included (BackupAndRestore turns its
        # own on only when fit starts, and keeps a cache the user chose).
        mf.compilation_cache.use(args.backup + ".jax-cache")
    import jax

    module, x, y, policy = build(args.model)  # imports the example (flax, and scikit-learn or the corpus)
    x, y = x[: STEPS_PER_EPOCH * 32], y[: STEPS_PER_EPOCH * 32]
    with strategy.scope():
        model = mf.Model(module, seed=0)  # a factory: a resume reads the backup into it, creating nothing
        loss = mf.losses.SparseCategoricalCrossentropy(from_logits=True)
        model.compile(optimizer="adam", loss=loss, dtype_policy=policy)
    _phase("built")
    kills = [int(s) for s in args.kill_at.split(",")] if args.kill_at else []
    kill_at = kills[start] if start < len(kills) else None
    rank, killer = strategy.process_index, strategy.process_count - 1
    held = {}

    class Report(mf.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            step, now = model.session.step, time.time()
            if "first" not in held:
                totals = self.context.timer.totals()
                held["first"] = (totals["checkpoint"], totals["compile"], time.perf_counter(), step)
            if rank == 0:
                print(f"a{start} step {step} t={now:.4f}", flush=True)
            if rank == killer and step == kill_at:
                jax.block_until_ready(self.context.latest)  # the step is computed, not only dispatched
                print(f"a{start} kill at step {step} t={time.time():.4f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_end(self, logs=None):
            checkpoint, compiled, began, step = held["first"]
            steps, totals = model.session.step - step, self.context.timer.totals()
            if rank == 0 and steps > 0:
                total = {
                    "held": (totals["checkpoint"] - checkpoint) / steps,
                    # Compiling once (the snapshot's copy program at the first snapshot) is not a cost per step.
                    "step": (time.perf_counter() - began - (totals["compile"] - compiled)) / steps,
                    "steps": steps,
                }
                print(f"a{start} cost {json.dumps(total)}", flush=True)

    class Restored(mf.callbacks.Callback):
        def on_train_begin(self, logs=None):
            _phase("restored")

    backup = mf.callbacks.BackupAndRestore(
        args.backup,
        save_freq=args.disk_freq,
        memory_freq=args.memory_freq or None,
        compilation_cache=mf.compilation_cache.directory() if args.early_cache else True,
    )
    model.fit(x, y, batch_size=32, epochs=args.epochs, callbacks=[Report(), backup, Restored()], verbose=0)


def launch(
    base: str, model: str, name: str, epochs: int, disk_freq: int, memory_freq: int | None, kills: list[int]
) -> str:
    """Runs one job training `model`; returns its output (stdout, then stderr)."""
    from processes import LAUNCH, Job

    argv = LAUNCH + ["--nprocs", "1" if GPU else str(NPROCS), "--devices-per-proc", "1"]
    argv += ["--max-restarts", str(len(kills))]
    argv += ["--stop-grace", "1", "--verbose"]  # --verbose: each rank's own account of its start's phases
    argv += [] if FORK_SERVER else ["--no-fork-server"]
    argv += [__file__, "--worker", "--model", model, "--backup", os.path.join(base, name)]
    argv += ["--epochs", str(epochs), "--disk-freq", str(disk_freq)]
    argv += ["--memory-freq", str(memory_freq or 0)]  # 0: disk backups only
    argv += ["--early-cache"] if EARLY_CACHE else []
    argv += ["--kill-at", ",".join(map(str, kills))] if kills else []
    env = dict(os.environ, PYTHONPATH=os.path.join(HERE, ".."), **({} if GPU else {"JAX_PLATFORMS": "cpu"}))
    with Job(argv, timeout=1800, env=env) as job:
        status = job.finish()
    if status != 0:
        raise RuntimeError(f"{model} {name}: the job failed ({status}):\n{job.stdout[-2000:]}\n{job.stderr[-2000:]}")
    return job.stdout + job.stderr


def failures(output: str, kills: list[int]) -> list[dict]:
    """Per failure: the step killed, the step resumed from, the tier, and seconds from the kill to the next step."""
    found = []
    for start, killed in enumerate(kills):
        kill = re.search(rf"a{start} kill at step {killed} t=([\d.]+)", output)
        # Non-greedy: a memory resume's line names the disk backup's step after its own.
        pattern = r"\[rank 0\] BackupAndRestore: resumed from (the launcher's memory snapshot)?.*? \(step (\d+)\)"
        first = re.search(rf"\[rank 0\] a{start + 1} step (\d+) t=([\d.]+)", output)
        # The resume of this restart only: between the kill and the restarted job's first step.
        resumed = re.search(pattern, output[kill.end() : first.start()]) if kill and first else None
        step = int(resumed.group(2)) if resumed else 0
        split = {}
        for rank in (0,) if GPU else (0, 1):  # when each rank reached each phase, in seconds from the kill (cumulative)
            phases = re.findall(rf"\[rank {rank}\] a{start + 1} phase (\w+) t=([\d.]+)", output)
            split[rank] = {name: round(float(t) - float(kill.group(1)), 2) for name, t in phases}
        # meshfit's own account of each rank's restarted start (`meshfit launch --verbose`).
        said = re.findall(rf"\[rank (\d+)\] meshfit: start {start + 1} reached its first step (.*)", output)
        found.append(
            {
                "meshfit phases": {int(rank): text for rank, text in said},
                "killed": killed,
                "resumed": step,
                "tier": ("memory" if resumed.group(1) else "disk") if resumed else "none (from scratch)",
                "lost": killed - step,
                "seconds": float(first.group(2)) - float(kill.group(1)),
                "phases": split,
            }
        )
    return found


def cost(output: str) -> dict:
    return json.loads(re.search(r"a0 cost (\{.*\})", output).group(1))


def models(text: str) -> list[str]:
    """`--model`'s comma-separated names, checked."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in MODELS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"expected names of {sorted(MODELS)}, comma-separated; received {text!r}")
    return names


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--backup", help=argparse.SUPPRESS)
    parser.add_argument("--kill-at", default="", help=argparse.SUPPRESS)
    parser.add_argument("--early-cache", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--no-early-cache",
        action="store_true",
        help="no compilation cache before the model is built (only BackupAndRestore's, from fit's start)",
    )
    parser.add_argument(
        "--model", type=models, default=["digits"], help="digits, transformer, wide, or several: digits,transformer"
    )
    parser.add_argument("--memory-freq", type=int, default=5)
    parser.add_argument("--disk-freq", type=int, default=100)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--failures", type=int, default=3, help="SIGKILLs per setting (0: only the cost)")
    parser.add_argument("--cost-rounds", type=int, default=1, help="pairs of jobs without failures for the cost")
    parser.add_argument("--gpu", action="store_true", help="one process on the GPU (it is the rank killed)")
    parser.add_argument("--nprocs", type=int, default=2, help="processes on the CPU (the last is the rank killed)")
    parser.add_argument(
        "--no-fork-server", action="store_true", help="meshfit launch --no-fork-server: each rank a new interpreter"
    )
    parser.add_argument("--memory-only", action="store_true", help="SIGKILLs with the memory tier only")
    args = parse_args(parser, epochs=1, failures=1, cost_rounds=0)
    if args.worker:
        (args.model,) = args.model
        worker(args)
        return
    global EARLY_CACHE, GPU, NPROCS, FORK_SERVER
    EARLY_CACHE, GPU, NPROCS, FORK_SERVER = not args.no_early_cache, args.gpu, args.nprocs, not args.no_fork_server
    steps = args.epochs * STEPS_PER_EPOCH
    rng = random.Random(args.seed)
    # One kill in each of `failures` equal stretches of the run, past the first stretch's start-up.
    stretch = steps // (args.failures + 1)
    kills = [(i + 1) * stretch + rng.randrange(stretch // 2) for i in range(args.failures)]
    base = tempfile.mkdtemp(prefix="bench_recovery_")
    try:
        where = "1 process x 1 GPU, SIGKILL of rank 0" if GPU else f"{NPROCS} process(es) x 1 CPU device"
        print(f"{where} at steps {kills}, {steps} steps", flush=True)
        print(f"load average before: {' '.join(f'{v:.2f}' for v in os.getloadavg())}", flush=True)
        rows = []
        for model in args.model:
            print(f"{model}: {MODELS[model]}", flush=True)
            for label, memory in (
                (f"disk every {args.disk_freq}", None),
                (f"memory every {args.memory_freq}", args.memory_freq),
            )[(1 if args.smoke or args.memory_only else 0) : 2 if kills else 0]:  # the memory tier's row only
                out = launch(base, model, label.replace(" ", "_"), args.epochs, args.disk_freq, memory, kills)
                for failure in failures(out, kills):
                    rows.append((model, label, failure))
                    print(f"  {model}, {label}: {failure}", flush=True)
        if rows:
            print()
            print("| model | setting | killed at | resumed from (tier) | steps lost | kill to first resumed step (s) |")
            print("| --- | --- | --- | --- | --- | --- |")
        for model, label, f in rows:
            print(
                f"| {model} | {label} | {f['killed']} | {f['resumed']} ({f['tier']}) | {f['lost']} "
                f"| {f['seconds']:.1f} |"
            )
        for key in dict.fromkeys((model, label) for model, label, _ in rows):
            mine = [f for *name, f in rows if tuple(name) == key]
            print(
                f"{key[0]}, {key[1]}: steps lost mean {statistics.mean(f['lost'] for f in mine):.1f}, max "
                f"{max(f['lost'] for f in mine)}; seconds mean {statistics.mean(f['seconds'] for f in mine):.1f}, "
                f"max {max(f['seconds'] for f in mine):.1f}"
            )
        print()
        for model in args.model:
            for i in range(args.cost_rounds):  # disk-only and with the tier back to back, first one then the other
                order = [("off", None), ("on", args.memory_freq)][:: 1 if i % 2 == 0 else -1]
                runs = {}
                for name, k in order:
                    # No disk backup within the run: the loop's hold is the tier's alone, not a disk save's noise.
                    runs[name] = cost(launch(base, model, f"cost_{name}{i}", args.epochs, steps + 1, k, []))
                off, on = runs["off"], runs["on"]
                change = 100 * (on["step"] / off["step"] - 1)
                print(
                    f"{model}: cost of the memory tier (K={args.memory_freq}): loop held {1e3 * on['held']:.3f} "
                    f"ms/step (disk-only {1e3 * off['held']:.3f} ms/step) of a {1e3 * off['step']:.2f} ms step: "
                    f"{100 * (on['held'] - off['held']) / off['step']:.2f} %; mean step {1e3 * on['step']:.2f} ms "
                    f"with the tier vs {1e3 * off['step']:.2f} ms without ({change:+.1f} %)",
                    flush=True,
                )
        print(f"load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
