"""Where a tiny step's time goes: meshfit's `fit` at steps_per_execution=1 against bench_fit's raw loop.

    python benchmarks/profile_step.py [--steps-per-epoch 512] [--epochs 3] [--rounds 9] [--top 12]

The tiny MLP of bench_fit.py (64-64-10, batch 32), `model.fit(..., verbose=0)`. Three views:

1. A wall-clock breakdown, contenders interleaved round by round, each with the CPU time of the
   calling thread and of the whole process per step (on a shared machine the medians of wall time
   drift; CPU time less so). From the bare compiled step to the whole fit:
     raw      bench_fit's hand-written loop (host slicing, numpy batches into a donated jitted step);
     program  meshfit's compiled step called in a bare loop on one placed stage: its dispatch and
              device time, no loop around it;
     placed   `StateStore.advance` over the executions of whole epochs placed beforehand: the
              loop's per-step work (the in-flight bound included), without the input;
     fed      the feeder's executions (host gather, placement of each stage) and `advance`: the
              input path, without the rest of `fit`;
     fit      `model.fit`: argument checks, callbacks, epoch ends.
2. The fit timer's phases per step (`model.session.timer`).
3. cProfile of the raw loop and of `fit`: Python-level calls per step and the top functions by
   their own time per step (cProfile's overhead inflates every figure; the ranking is what counts).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import jax
from bench_fit import MLP, make_data, meshfit_epochs, optimizer, raw_epochs
from flax import nnx
from smoke import parse_args

import meshfit as mf
from meshfit.training.fit_timer import PHASES

SIZES, BATCH = (64, 64, 10), 32


def timed_rounds(contenders: dict, rounds: int, steps: int) -> dict:
    """Per contender: wall, calling-thread CPU and process CPU, in µs per step, one list entry per round."""
    for go in contenders.values():
        go()
    times = {name: ([], [], []) for name in contenders}
    for _ in range(rounds):
        for name, go in contenders.items():
            wall, thread, process = time.perf_counter(), time.thread_time(), time.process_time()
            go()
            for values, start, now in zip(
                times[name],
                (wall, thread, process),
                (time.perf_counter(), time.thread_time(), time.process_time()),
                strict=True,
            ):
                values.append((now - start) / steps * 1e6)
    return times


def breakdown(x, y, epochs: int, rounds: int) -> None:
    steps_per_epoch = len(x) // BATCH
    steps = steps_per_epoch * epochs
    model = mf.Model(MLP(SIZES, rngs=nnx.Rngs(0)))
    model.compile(optimizer=optimizer(), loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    session = model.session
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)  # builds the feeder and compiles
    seen = []
    executions = session.feeder.executions

    def recording(data, *args, **kwargs):  # the fit's data source, for the contenders without fit
        seen.append(data)
        return executions(data, *args, **kwargs)

    session.feeder.executions = recording
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    session.feeder.executions = executions
    data, store, in_flight = seen[0], session.store, session.in_flight
    epoch = [1000]  # data passes beyond the fits'

    def take_epochs():
        out = [list(executions(data, epoch[0] + e, 0, False)) for e in range(epochs)]
        epoch[0] += epochs
        return out

    program, args = take_epochs()[0][0].calls[0]
    placed_epochs = take_epochs()

    def program_only():  # on the state's leaves, as `StateStore.advance` calls a `LeafProgram`
        leaves, structure = jax.tree.flatten(store.latest)
        run = program.on(structure)
        for _ in range(steps):
            leaves, _logs = run(leaves, *args)
        jax.block_until_ready(leaves)
        store.replace(structure.unflatten(leaves))

    def placed():
        for execution in (e for epoch_executions in placed_epochs for e in epoch_executions):
            store.advance(execution.calls, in_flight)
        store.count(steps)  # the host's step count stays the state's, for the fits after
        jax.block_until_ready(store.latest)

    def fed():
        for _ in range(epochs):
            for execution in executions(data, epoch[0], 0, False):
                store.advance(execution.calls, in_flight)
            epoch[0] += 1
        store.count(steps)
        jax.block_until_ready(store.latest)

    def fit():
        model.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0)
        jax.block_until_ready(model.params)

    contenders = {"raw": raw_epochs(SIZES, x, y, BATCH, epochs), "program": program_only, "placed": placed}
    contenders |= {"fed": fed, "fit": fit}
    times = timed_rounds(contenders, rounds, steps)
    print(f"\n1. wall-clock breakdown, µs/step, {rounds} rounds interleaved (min / median; CPU times median)")
    print(f"  {'':8s} {'wall min':>9s} {'wall med':>9s} {'thread CPU':>11s} {'process CPU':>12s}")
    for name, (wall, thread, process) in times.items():
        print(
            f"  {name:8s} {min(wall):9.1f} {statistics.median(wall):9.1f} {statistics.median(thread):11.1f}"
            f" {statistics.median(process):12.1f}"
        )
    raw_wall, fit_wall = times["raw"][0], times["fit"][0]
    paired = statistics.median(r / f for r, f in zip(raw_wall, fit_wall, strict=True))
    print(f"  fit / raw, paired by round: {paired:.3f}")

    totals = dict.fromkeys(PHASES, 0.0)
    for _ in range(3):
        fit()
        for phase, seconds in session.timer.totals().items():
            totals[phase] += seconds / 3
    shown = ", ".join(f"{phase} {seconds / steps * 1e6:.2f}" for phase, seconds in totals.items() if seconds)
    print(f"\n2. fit timer phases, µs/step (mean of 3 fits): {shown}")


def profile(x, y, epochs: int, top: int) -> None:
    steps = len(x) // BATCH * epochs
    print(f"\n3. cProfile, 3 runs of {steps} steps each")
    for name, go in (
        ("raw", raw_epochs(SIZES, x, y, BATCH, epochs)),
        ("meshfit", meshfit_epochs(SIZES, x, y, BATCH, epochs)),
    ):
        go()
        go()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(3):
            go()
        profiler.disable()
        stats = pstats.Stats(profiler)
        calls = sum(entry[1] for entry in stats.stats.values())  # primitive and recursive calls alike
        print(
            f"\n  {name}: {calls / (3 * steps):.1f} Python-level calls per step; "
            f"{stats.total_tt / (3 * steps) * 1e6:.1f} µs/step under the profiler"
        )
        print(f"  {'own µs/step':>11s} {'calls/step':>10s}  function")
        rows = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:top]
        for (path, line, function), (_, ncalls, own, _cum, _callers) in rows:
            where = f"{path.split('/site-packages/')[-1].split('/wt-tax/')[-1]}:{line}({function})"
            print(f"  {own / (3 * steps) * 1e6:11.2f} {ncalls / (3 * steps):10.3f}  {where[-90:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps-per-epoch", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--top", type=int, default=12, help="functions shown per profile")
    args = parse_args(parser, steps_per_epoch=8, epochs=1, rounds=1, top=5)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}, tiny MLP {SIZES}, batch {BATCH}")
    x, y = make_data(BATCH * args.steps_per_epoch, SIZES[0], SIZES[-1])
    breakdown(x, y, args.epochs, args.rounds)
    profile(x, y, args.epochs, args.top)


if __name__ == "__main__":
    main()
