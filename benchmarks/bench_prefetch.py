"""Input read ahead on a thread: a generator whose host work is about as long as the step's device work.

Measured in one run, alternating, median of `--repeats`:
  * device:  a hand-written `jax.jit` loop over batches already on the device (the device time alone);
  * host:    the generator iterated alone (the host time alone);
  * meshfit: `model.fit(generator)`, reading and padding 2 batches ahead on a thread (the default);
  * meshfit_no_prefetch: the same with `meshfit.data.sources.PREFETCH_BATCHES = 0` (read when needed).
With perfect overlap an epoch takes max(host, device); without any, host + device. JAX's asynchronous
dispatch already overlaps a generator with the steps queued on the device while nothing waits for a
step; `--sync-each-batch` adds a callback that reads each batch's loss (a per-batch logger), after
which only the reading thread keeps the input going while the host waits.

    python benchmarks/bench_prefetch.py [--steps 40] [--repeats 5] [--host-work numpy|sleep]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np
import optax
from flax import nnx
from smoke import parse_args

import meshfit as mf
from meshfit.data import sources

SIZES = (784, 1024, 1024, 10)


class MLP(nnx.Module):
    def __init__(self, *, rngs):
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(SIZES[:-1], SIZES[1:], strict=True)])

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = nnx.relu(layer(x))
        return self.layers[-1](x)


def batches(steps: int, batch: int, work: float, seed: int = 0, kind: str = "numpy"):
    """Batches made on the host with `work` of host work each: rounds of numpy work (decoding,
    augmenting: it takes a core) or seconds of waiting (reading files or the network: it takes none)."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        x = rng.standard_normal((batch, SIZES[0]), dtype=np.float32)
        if kind == "sleep":
            time.sleep(work)
        else:
            for _ in range(int(work)):
                x = np.tanh(x * 1.01)
        yield x, rng.integers(0, SIZES[-1], batch).astype(np.int32)


def device_loop(steps: int, batch: int):
    graphdef, params = nnx.split(MLP(rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(params)
    tx = optax.adam(1e-3)
    state = jax.device_put((params, tx.init(params)))
    data = [jax.device_put(b) for b in batches(steps, batch, 0, seed=1)]

    @jax.jit
    def step(state, x, y):
        params, opt_state = state

        def loss_fn(p):
            logits = nnx.merge(graphdef, p)(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        grads = jax.grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def go():
        nonlocal state
        for x, y in data:
            state = step(state, x, y)
        jax.block_until_ready(state)

    return go


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--host-work", choices=["numpy", "sleep"], default="numpy")
    parser.add_argument("--sync-each-batch", action="store_true", help="a callback reads every batch's loss")
    args = parse_args(parser, steps=8, batch=32, repeats=1)

    device = device_loop(args.steps, args.batch)
    device()
    t0 = time.perf_counter()
    device()
    step_time = (time.perf_counter() - t0) / args.steps
    t0 = time.perf_counter()
    for _ in batches(5, args.batch, 10):
        pass
    per_round = (time.perf_counter() - t0) / 50
    # Host work per batch about one step's device time.
    work = step_time if args.host_work == "sleep" else max(1, round(step_time / per_round))

    model = mf.Model(MLP(rngs=nnx.Rngs(0)))
    model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))

    reader = mf.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: float(logs["loss"]))
    callbacks = [reader] if args.sync_each_batch else []

    def fit(prefetch):
        def go():
            sources.PREFETCH_BATCHES = prefetch
            data = batches(args.steps, args.batch, work, kind=args.host_work)
            model.fit(data, epochs=1, verbose=0, callbacks=callbacks)
            jax.block_until_ready(model.params)

        return go

    def host():
        for _ in batches(args.steps, args.batch, work, kind=args.host_work):
            pass

    contenders = {"device": device, "host": host, "meshfit": fit(2), "meshfit_no_prefetch": fit(0)}
    for go in contenders.values():
        go()
    times = {k: [] for k in contenders}
    for _ in range(args.repeats):
        for name, go in contenders.items():
            t0 = time.perf_counter()
            go()
            times[name].append(time.perf_counter() - t0)
    sources.PREFETCH_BATCHES = 2
    t = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"jax {jax.__version__} on {jax.devices()[0].device_kind}; MLP {'-'.join(map(str, SIZES))}, batch "
        f"{args.batch}, {args.steps} steps; host work a batch: {args.host_work} {work:.4g}"
        f"{'; the loss read after each batch' if args.sync_each_batch else ''}; median of {args.repeats}"
    )
    for name, seconds in t.items():
        print(f"  {name:20s} {seconds * 1e3:8.1f} ms an epoch  {seconds / args.steps * 1e3:7.2f} ms a step")
    bound, serial = max(t["device"], t["host"]), t["device"] + t["host"]
    print(f"  meshfit / max(host, device)             = {t['meshfit'] / bound:.3f}  (1.0: full overlap)")
    print(f"  meshfit_no_prefetch / (host + device)   = {t['meshfit_no_prefetch'] / serial:.3f}  (1.0: no overlap)")
    print(f"  meshfit_no_prefetch / meshfit           = {t['meshfit_no_prefetch'] / t['meshfit']:.3f}")


if __name__ == "__main__":
    main()
