"""How long checkpointing stalls training: async against sync saving, and restore time.

A model with >= 100 MB of state (parameters + Adam moments) trains for a fixed
number of steps in three runs: no checkpoints (baseline), ModelCheckpoint every
`--every` steps with `async_save=True`, and the same with `async_save=False`.
The stall per checkpoint is (run time - baseline time) / checkpoints. Then it
times `load_weights` and a full `load_model` restore from the written files.

    python benchmarks/bench_checkpoint.py [--steps 60] [--every 20]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import jax
import numpy as np
from flax import nnx
from smoke import parse_args

import meshfit as mf


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


class TimedCheckpoint(mf.callbacks.ModelCheckpoint):
    """ModelCheckpoint that records how long each save blocks the training loop."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.blocked = []

    def _maybe_save(self, *args, **kwargs):
        t0 = time.perf_counter()
        super()._maybe_save(*args, **kwargs)
        self.blocked.append(time.perf_counter() - t0)


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
    saves = args.steps // args.every
    results = {"none": [], "async": [], "sync": []}
    blocked = {"async": [], "sync": []}
    try:
        for r in range(args.repeats):
            for kind in results:
                callbacks = []
                if kind != "none":
                    path = os.path.join(root, f"{kind}{r}")
                    callbacks = [
                        TimedCheckpoint(path, save_freq=args.every, max_to_keep=2, async_save=(kind == "async"))
                    ]
                results[kind].append(timed_fit(model, x, y, callbacks))
                if callbacks:
                    blocked[kind] += callbacks[0].blocked
        base = statistics.median(results["none"])
        print(f"  no checkpoints: {base:.2f} s")
        for kind in ("async", "sync"):
            total = statistics.median(results[kind])
            print(
                f"  {kind:5s}: loop blocked {statistics.median(blocked[kind]) * 1e3:7.1f} ms per checkpoint "
                f"(median of {len(blocked[kind])}); whole fit {total:.2f} s, "
                f"{(total - base) / saves * 1e3:.0f} ms more per checkpoint than none"
            )
        ratio = statistics.median(blocked["async"]) / statistics.median(blocked["sync"])
        print(f"  blocked async / blocked sync = {ratio:.3f}")

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
