"""What a loss returning a scalar costs against the per-sample built-in it equals.

A scalar loss cannot be masked, so a partial batch runs through its own step,
which computes the scalar on the real rows only (compiled on first use, once per
partial size: see `meshfit.training.executables`). This measures, for an MLP:
  * compile: XLA compilations and their seconds (JAX's backend-compile events)
    of a fresh model's first fit with validation, rows leaving a partial last
    batch in both the training and the validation data; the difference is
    the scalar loss's extra cost;
  * step: milliseconds a training step takes on full batches only (rows that
    divide by the batch size), per-sample and scalar runs alternating; the
    fastest and the median of `--repeats` fits are kept (the fastest is the
    steadier figure on a loaded machine).

Both losses use the same formula (optax's cross-entropy), one per row, one
as the batch's mean, so only the mechanism differs.

    python benchmarks/bench_scalar_loss.py [--repeats 5] [--sizes 784 512 512 10] [--batch-size 128]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from smoke import parse_args

import meshfit as mf

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class MLP(nnx.Module):
    def __init__(self, sizes, *, rngs):
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes[:-1], sizes[1:], strict=True)])

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = nnx.relu(layer(x))
        return self.layers[-1](x)


def cross_entropy(y_true, y_pred):
    """Per-sample values: one per row."""
    return optax.softmax_cross_entropy_with_integer_labels(y_pred, y_true)


def scalar_cross_entropy(y_true, y_pred):
    """The same formula as one scalar for the batch: only the mechanism differs."""
    return jnp.mean(cross_entropy(y_true, y_pred))


LOSSES = {"per_sample": cross_entropy, "scalar": scalar_cross_entropy}


class Compiles:
    """XLA compilations and their seconds while entered."""

    def __enter__(self):
        self.count, self.seconds = 0, 0.0
        jax.monitoring.register_event_duration_secs_listener(self._event)
        return self

    def _event(self, event, duration, **kwargs):
        if event == COMPILE_EVENT:
            self.count += 1
            self.seconds += duration

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._event)


def make_model(sizes, loss):
    model = mf.Model(MLP(sizes, rngs=nnx.Rngs(0)))
    model.compile(optimizer="adam", loss=loss)
    return model


def data(rows, sizes):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, sizes[0]), dtype=np.float32)
    return x, rng.integers(0, sizes[-1], rows).astype(np.int32)


def compile_cost(sizes, batch_size):
    """{loss: (compilations, seconds)} of a first fit with a partial last batch in training and validation."""
    x, y = data(20 * batch_size + batch_size // 3, sizes)
    validation = (x[: 3 * batch_size + 5], y[: 3 * batch_size + 5])
    make_model(sizes, LOSSES["per_sample"]).fit(x, y, batch_size=batch_size, verbose=0)  # warms shared helpers
    cost = {}
    for name, loss in LOSSES.items():
        model = make_model(sizes, loss)
        with Compiles() as compiles:
            model.fit(x, y, batch_size=batch_size, validation_data=validation, verbose=0)
        cost[name] = (compiles.count, compiles.seconds)
    return cost


def step_times(sizes, batch_size, steps, repeats):
    """{loss: (fastest, median) milliseconds per step} of fits on full batches only."""
    x, y = data(steps * batch_size, sizes)
    models = {name: make_model(sizes, loss) for name, loss in LOSSES.items()}
    for model in models.values():
        model.fit(x, y, batch_size=batch_size, verbose=0)  # compiles
    times = {name: [] for name in models}
    for _ in range(repeats):
        for name, model in models.items():
            start = time.perf_counter()
            model.fit(x, y, batch_size=batch_size, verbose=0)
            times[name].append((time.perf_counter() - start) / steps * 1e3)
    return {name: (min(values), statistics.median(values)) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[784, 512, 512, 10])
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parse_args(parser, sizes=[16, 32, 10], batch_size=16, steps=8, repeats=1)
    print(f"MLP {'-'.join(map(str, args.sizes))}, batch {args.batch_size}, {jax.devices()[0].device_kind}")
    cost = compile_cost(args.sizes, args.batch_size)
    for name, (count, seconds) in cost.items():
        print(f"  first fit, {name:>10}: {count} XLA compilations, {seconds:.2f} s")
    extra = cost["scalar"][1] - cost["per_sample"][1]
    print(f"  scalar loss: {cost['scalar'][0] - cost['per_sample'][0]} more compilations, {extra:+.2f} s")
    for name, (fastest, median) in step_times(args.sizes, args.batch_size, args.steps, args.repeats).items():
        print(f"  full-batch step, {name:>10}: {fastest:.3f} ms fastest, {median:.3f} ms median")


if __name__ == "__main__":
    main()
