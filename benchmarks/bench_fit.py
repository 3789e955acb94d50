"""Fit throughput of meshfit against hand-written JAX loops, in one run.

For each model (MLP 784-512-512-10 at batch 128; MLP 64-64-10 at batch 32) it
times, on the same data and optimizer:
  * raw:       a best-practice loop, one jitted step with donated buffers, the
               loss summed on device, host batches sliced from a shuffled order;
  * meshfit:   `model.fit(..., verbose=0)` with `steps_per_execution=1`;
  * raw_scan:  the same loop running 32 steps per call in a `lax.scan`;
  * meshfit32: `model.fit` with `steps_per_execution=32`;
  * keras:     Keras 3 on its JAX backend, if installed (`pip install meshfit[bench]`).
Runs alternate between contenders and the median of the rounds is kept: `--repeats` rounds at least,
more for short fits (up to `--min-seconds` of timing a model).

    python benchmarks/bench_fit.py [--repeats 5] [--min-seconds 6] [--epochs 3] [--only tiny]
        [--tiny-steps-per-epoch 512 128]

The tiny MLP runs twice: with 512 steps an epoch (fits of about 40 ms: throughput) and with 128 (fits of
about 10 ms, where the fixed costs of a call of fit show: checks, callbacks, the first batch's gather).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from smoke import parse_args

import meshfit as mf


class MLP(nnx.Module):
    def __init__(self, sizes, *, rngs):
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes[:-1], sizes[1:], strict=True)])

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = nnx.relu(layer(x))
        return self.layers[-1](x)


def make_data(n, din, classes, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, din), dtype=np.float32)
    y = rng.integers(0, classes, n).astype(np.int32)
    return x, y


def optimizer():
    return optax.adam(1e-3, eps=1e-7)


def loss_fn(graphdef, params, x, y):
    logits = nnx.merge(graphdef, params)(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def train_step(graphdef, tx):
    """The hand-written baselines' step: state = (params, opt_state, loss sum), donated by the caller's jit."""

    def step(state, xb, yb):
        params, opt_state, loss_sum = state
        loss, grads = jax.value_and_grad(lambda p: loss_fn(graphdef, p, xb, yb))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss_sum + loss

    return step


def raw_epochs(sizes, x, y, batch, epochs, scan_steps=1):
    """Hand-written loop; returns a function that runs `epochs` epochs and blocks."""
    graphdef, params = nnx.split(MLP(sizes, rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(params)
    tx = optimizer()
    state = jax.device_put((params, tx.init(params), jnp.zeros((), jnp.float32)))

    step = train_step(graphdef, tx)
    if scan_steps == 1:
        run = jax.jit(step, donate_argnums=0)
    else:
        run = jax.jit(
            lambda s, xs, ys: jax.lax.scan(lambda c, b: (step(c, *b), None), s, (xs, ys))[0], donate_argnums=0
        )
    steps = len(x) // batch
    rng = np.random.default_rng(0)

    def go():
        nonlocal state
        for _ in range(epochs):
            order = rng.permutation(len(x))
            for i in range(0, steps, scan_steps):
                idx = order[i * batch : (i + scan_steps) * batch]
                xb, yb = x[idx], y[idx]
                if scan_steps > 1:
                    xb, yb = xb.reshape(scan_steps, batch, -1), yb.reshape(scan_steps, batch)
                state = run(state, xb, yb)
        jax.block_until_ready(state)

    return go


def meshfit_epochs(sizes, x, y, batch, epochs, steps_per_execution=1):
    model = mf.Model(MLP(sizes, rngs=nnx.Rngs(0)))
    model.compile(
        optimizer=optimizer(),
        loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=steps_per_execution,
    )

    def go():
        model.fit(x, y, batch_size=batch, epochs=epochs, verbose=0)
        jax.block_until_ready(model.params)

    return go


def keras_epochs(sizes, x, y, batch, epochs):
    os.environ.setdefault("KERAS_BACKEND", "jax")
    try:
        import keras
    except Exception:  # noqa: BLE001 - Keras is an optional benchmark dependency
        return None
    layers = [keras.Input((sizes[0],))]
    layers += [keras.layers.Dense(s, activation="relu") for s in sizes[1:-1]] + [keras.layers.Dense(sizes[-1])]
    model = keras.Sequential(layers)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )

    def go():
        model.fit(x, y, batch_size=batch, epochs=epochs, verbose=0)

    return go


def paired_ratio(times: dict, ours: str, baseline: str) -> float:
    """Median over rounds of baseline time / our time, each pair run back to back.

    Less sensitive than the ratio of medians to the machine's speed drifting
    between rounds (short runs on a shared 2-core machine).
    """
    return statistics.median(b / o for b, o in zip(times[baseline], times[ours], strict=True))


def bench(name, sizes, batch, steps_per_epoch, epochs, repeats, min_seconds=0.0):
    x, y = make_data(batch * steps_per_epoch, sizes[0], sizes[-1])
    contenders = {
        "raw": raw_epochs(sizes, x, y, batch, epochs),
        "meshfit": meshfit_epochs(sizes, x, y, batch, epochs),
        "raw_scan32": raw_epochs(sizes, x, y, batch, epochs, scan_steps=32),
        "meshfit_spe32": meshfit_epochs(sizes, x, y, batch, epochs, steps_per_execution=32),
    }
    keras_go = keras_epochs(sizes, x, y, batch, epochs)
    if keras_go is not None:
        contenders["keras"] = keras_go
    for go in contenders.values():  # compile and warm up
        go()
    ours = [k for k in contenders if k != "keras"]
    round_start = time.perf_counter()
    for k in ours:  # a round's time, compiled
        contenders[k]()
    round_s = time.perf_counter() - round_start
    # Short fits (the tiny MLP's take 10-40 ms) vary by several % from round to round on a shared machine:
    # they get more rounds, up to `min_seconds` of timing in all. Keras, 3-4x slower on them, runs in the
    # first `repeats` rounds only (its ratio is not close to any bar).
    rounds = max(repeats, min(50, math.ceil(min_seconds / round_s)))
    times = {k: [] for k in contenders}
    for r in range(rounds):
        for k, go in contenders.items():
            if k not in ours and r >= repeats:
                continue
            t0 = time.perf_counter()
            go()
            times[k].append(time.perf_counter() - t0)
    steps = steps_per_epoch * epochs
    sps = {k: steps / statistics.median(v) for k, v in times.items()}
    print(f"\n{name}: batch {batch}, {steps_per_epoch} steps/epoch, {epochs} epochs/run, median of {rounds} rounds")
    for k, v in sps.items():
        print(f"  {k:14s} {v:10.1f} steps/s   {1e6 / v:8.1f} us/step")
    print(
        f"  ratio meshfit/raw               = {sps['meshfit'] / sps['raw']:.3f}  (target >= 0.95)"
        f"   paired: {paired_ratio(times, 'meshfit', 'raw'):.3f}"
    )
    print(
        f"  ratio meshfit_spe32/raw_scan32  = {sps['meshfit_spe32'] / sps['raw_scan32']:.3f}  (target >= 0.95)"
        f"   paired: {paired_ratio(times, 'meshfit_spe32', 'raw_scan32'):.3f}"
    )
    if "keras" in sps:
        print(f"  ratio meshfit/keras             = {sps['meshfit'] / sps['keras']:.3f}")
    return sps


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="rounds at least (each contender once a round)")
    parser.add_argument(
        "--min-seconds",
        type=float,
        default=6.0,
        help="more rounds for short fits, up to this much timing a model (at most 50 rounds)",
    )
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--large-steps-per-epoch", type=int, default=64, help="epoch length of the large MLP")
    parser.add_argument("--only", choices=["large", "tiny"], help="run one of the two models")
    parser.add_argument(
        "--tiny-steps-per-epoch",
        type=int,
        nargs="+",
        default=[512, 128],
        help="epoch lengths of the tiny MLP's runs: 512 measures throughput; 128 makes a fit "
        "last about 10 ms, so fit's fixed costs (setup, epoch ends) weigh too",
    )
    args = parse_args(parser, repeats=1, min_seconds=0.0, epochs=1, tiny_steps_per_epoch=[32], large_steps_per_epoch=32)
    print(
        f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({jax.default_backend()}), "
        f"{os.cpu_count()} cpus, {platform.processor() or platform.machine()}"
    )
    if args.only != "tiny":
        bench(
            "MLP 784-512-512-10",
            (784, 512, 512, 10),
            128,
            args.large_steps_per_epoch,
            args.epochs,
            args.repeats,
            args.min_seconds,
        )
    if args.only != "large":
        for steps_per_epoch in args.tiny_steps_per_epoch:
            bench("MLP 64-64-10", (64, 64, 10), 32, steps_per_epoch, args.epochs, args.repeats, args.min_seconds)


if __name__ == "__main__":
    main()
