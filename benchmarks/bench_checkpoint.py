"""How long checkpointing stalls training: async against sync saving, and restore time.

A model with >= 100 MB of state (parameters + Adam moments) trains for a fixed
number of steps in four runs: no checkpoints (baseline), ModelCheckpoint every
`--every` steps with `async_save=True` ("async": the state copied on its devices
and written from a background thread), with `async_save=True,
device_copy=False` ("host": Orbax's asynchronous save, the loop waits for the
copy to the host, as before issue 30), and with `async_save=False` ("sync").
The stall per checkpoint is (run time - baseline time) / checkpoints. "Blocked"
is the time each save holds the loop: the fit timer's "checkpoint" phase
(`meshfit.training.fit_timer`), read after each save; the final wait for the last write
(at the end of `fit`) is shown apart. Under it, where that time goes: the
pieces `CheckpointDir.save` and Orbax record as `jax.monitoring` durations on
the loop's thread. Then it times `load_weights` and a full `load_model` restore
from the written files.

    python benchmarks/bench_checkpoint.py [--steps 60] [--every 20]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time

import jax
import numpy as np
from flax import nnx
from smoke import parse_args

import meshfit as mf
from meshfit.checkpointing.checkpoint import SAVE_EVENTS


class Wide(nnx.Module):
    """4 x (2048 x 2048) layers: 16.8 M parameters, 67 MB; with Adam's two moments, 201 MB of state."""

    def __init__(self, width=2048, depth=4, rngs=None):
        rngs = rngs or nnx.Rngs(0)
        self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(depth)])
        self.head = nnx.Linear(width, 10, rngs=rngs)

    def __call__(self, x):
        for layer in self.layers:
            x = nnx.relu(layer(x))
        return self.head(x)


class Blocked(mf.callbacks.Callback):
    """Reads the fit's timer after the saver at each batch end: the time its save held the loop.

    `ModelCheckpoint` marks each save as the timer's "checkpoint" phase (`meshfit.training.fit_timer`);
    placed after it, this records each save's share, and the final wait for the last write
    (`on_train_end`) apart.
    """

    def __init__(self):
        super().__init__()
        self.blocked, self.final = [], 0.0
        self._seen = 0.0

    def _delta(self) -> float:
        now = self.context.timer.totals()["checkpoint"]
        delta, self._seen = now - self._seen, now
        return delta

    def on_train_begin(self, logs=None):
        self._seen = self.context.timer.totals()["checkpoint"]

    def on_train_batch_end(self, batch, logs=None):
        delta = self._delta()
        if delta > 0:
            self.blocked.append(delta)

    def on_train_end(self, logs=None):
        self.final = self._delta()


class SavePieces:
    """Collects the `jax.monitoring` durations a save records on the loop's thread
    (`meshfit.checkpointing.checkpoint.SAVE_EVENTS`, Orbax's `/jax/orbax/write/blocking_*` and
    `.../checkpoint_start_sync...`), per save."""

    ORBAX = {
        "/jax/orbax/write/blocking_wait_prev_duration_secs": "orbax: wait for previous",
        "/jax/orbax/write/blocking_val_duration_secs": "orbax: validation",
        "/jax/orbax/write/checkpoint_start_sync_duration_secs": "orbax: start sync",
        "/jax/orbax/write/blocking_tree_map_duration_secs": "orbax: tree map",
        "/jax/orbax/write/blocking_d2h_duration_secs": "orbax: device-to-host copy",
    }

    def __init__(self):
        self.kind = None  # what is being measured now ("async", "sync") or None
        self.pieces = {}  # kind -> {piece: [seconds, ...]}
        self.thread = threading.main_thread()
        jax.monitoring.register_event_duration_secs_listener(self._record)

    def _record(self, event, seconds, **kwargs):
        if self.kind is None or threading.current_thread() is not self.thread:
            return
        if event.startswith(SAVE_EVENTS):
            name = event[len(SAVE_EVENTS) :]
        elif event in self.ORBAX:
            name = self.ORBAX[event]
        else:
            return
        self.pieces.setdefault(self.kind, {}).setdefault(name, []).append(seconds)

    def table(self, kind, saves):
        """Per piece: total over the measured saves / number of saves, in ms, largest first."""
        rows = {name: sum(values) / saves * 1e3 for name, values in self.pieces.get(kind, {}).items()}
        orbax = rows.get("orbax", 0.0)
        inner = sum(v for k, v in rows.items() if k.startswith("orbax: "))
        if "orbax" in rows:
            rows["orbax: rest (directories, metadata, handlers)"] = max(0.0, orbax - inner)
            rows["orbax (all of its blocking part)"] = rows.pop("orbax")
        return sorted(rows.items(), key=lambda row: -row[1])


def make_model(width=2048, depth=4):
    model = mf.Model(Wide(width, depth))
    model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def timed_fit(model, x, y, callbacks):
    jax.block_until_ready(model.params)
    t0 = time.perf_counter()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False, callbacks=callbacks)
    jax.block_until_ready(model.params)
    return time.perf_counter() - t0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--width", type=int, default=2048, help="units per layer")
    parser.add_argument("--depth", type=int, default=4, help="hidden layers")
    args = parse_args(parser, steps=6, every=2, repeats=1, width=64, depth=2)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32 * args.steps, args.width), dtype=np.float32)
    y = rng.integers(0, 10, len(x)).astype(np.int32)
    model = make_model(args.width, args.depth)
    state_bytes = sum(a.nbytes for a in jax.tree.leaves((model.session.state.params, model.session.state.opt_state)))
    print(
        f"jax {jax.__version__} on {jax.devices()[0].device_kind}, {os.cpu_count()} cpus; "
        f"state {state_bytes / 1e6:.0f} MB; {args.steps} steps, a checkpoint every {args.every}"
    )
    timed_fit(model, x[:64], y[:64], [])  # compile
    root = tempfile.mkdtemp(prefix="meshfit-bench-")
    warm = mf.callbacks.ModelCheckpoint(os.path.join(root, "warm"), save_freq=1, async_save=True)
    timed_fit(model, x[:64], y[:64], [warm])  # compile what a save runs on the devices (copy, fingerprints)
    saves = args.steps // args.every
    results = {"none": [], "async": [], "host": [], "sync": []}
    blocked = {"async": [], "host": [], "sync": []}
    final = {"async": [], "host": [], "sync": []}
    pieces = SavePieces()
    try:
        for r in range(args.repeats):
            for kind in results:
                callbacks = []
                if kind != "none":
                    path = os.path.join(root, f"{kind}{r}")
                    saver = mf.callbacks.ModelCheckpoint(
                        path, save_freq=args.every, max_to_keep=2, async_save=kind != "sync", device_copy=kind != "host"
                    )
                    callbacks = [saver, Blocked()]
                pieces.kind = None if kind == "none" else kind
                results[kind].append(timed_fit(model, x, y, callbacks))
                pieces.kind = None
                if callbacks:
                    blocked[kind] += callbacks[1].blocked
                    final[kind].append(callbacks[1].final)
        base = statistics.median(results["none"])
        print(f"  no checkpoints: {base:.2f} s")
        for kind in ("async", "host", "sync"):
            total = statistics.median(results[kind])
            print(
                f"  {kind:5s}: loop blocked {statistics.median(blocked[kind]) * 1e3:7.1f} ms per checkpoint "
                f"(median of {len(blocked[kind])}); whole fit {total:.2f} s, "
                f"{(total - base) / saves * 1e3:.0f} ms more per checkpoint than none; "
                f"the final wait for the last write {statistics.median(final[kind]) * 1e3:.0f} ms"
            )
            for name, ms in pieces.table(kind, len(blocked[kind])):
                print(f"      {name:48s} {ms:7.1f} ms per checkpoint (mean)")
        for kind in ("async", "host"):
            ratio = statistics.median(blocked[kind]) / statistics.median(blocked["sync"])
            print(f"  blocked {kind} / blocked sync = {ratio:.3f}")

        path = os.path.join(root, "sync0")
        target = make_model(args.width, args.depth)
        t0 = time.perf_counter()
        target.load_weights(path)
        jax.block_until_ready(target.params)
        t_weights = time.perf_counter() - t0
        model.save(os.path.join(root, "saved"))
        t0 = time.perf_counter()
        loaded = mf.load_model(os.path.join(root, "saved"), Wide(args.width, args.depth))
        jax.block_until_ready(loaded.session.state)
        t_model = time.perf_counter() - t0
        print(
            f"  restore: load_weights {t_weights:.2f} s ({state_bytes / 3 / 1e6:.0f} MB of weights), "
            f"load_model {t_model:.2f} s ({state_bytes / 1e6:.0f} MB incl. optimizer state)"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
