"""Data-parallel fit throughput and all-reduce bytes, per reduction and gradient compression.

Compares, in one run and on the same data:
  * raw:       a hand-written loop: `jax.jit` over a ("data",) mesh, state replicated
               with `NamedSharding(mesh, P())`, each batch `device_put` with
               `NamedSharding(mesh, P("data"))`, donated buffers;
  * auto:      `model.fit` under `MirroredStrategy()` (XLA inserts the all-reduce);
  * explicit:  `MirroredStrategy(reduction="explicit")` (meshfit's `psum` under `shard_map`);
  * bf16, fp16: the explicit step with `gradient_compression=`.
For each meshfit contender, `model.step_report()` gives the all-reduce bytes per
step of the lowered program (what meshfit asked for) and of the compiled one (what
the backend moves), against the parameter bytes (1.0 = each gradient reduced once).

    python benchmarks/bench_data_parallel.py [--repeats 5] [--epochs 2]    # 8 simulated CPU devices
    JAX_PLATFORMS=cuda python benchmarks/bench_data_parallel.py            # the GPUs of this host
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from bench_fit import MLP, make_data, optimizer, train_step  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from smoke import parse_args  # noqa: E402

import meshfit as mf  # noqa: E402


def raw_epochs(sizes, x, y, batch, epochs, strategy):
    mesh = strategy.mesh
    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    graphdef, params = nnx.split(MLP(sizes, rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(params)
    tx = optimizer()
    state = jax.device_put((params, tx.init(params), np.zeros((), np.float32)), replicated)

    step = jax.jit(train_step(graphdef, tx), donate_argnums=0)
    steps = len(x) // batch
    rng = np.random.default_rng(0)

    def go():
        nonlocal state
        for _ in range(epochs):
            order = rng.permutation(len(x))
            for i in range(steps):
                idx = order[i * batch : (i + 1) * batch]
                xb, yb = jax.device_put((x[idx], y[idx]), sharded)
                state = step(state, xb, yb)
                if i % 8 == 7:  # bound the steps in flight, as meshfit does
                    jax.block_until_ready(state[2])
        jax.block_until_ready(state)

    return go


#: The meshfit contenders: name -> MirroredStrategy arguments.
CONTENDERS = {
    "auto": {},
    "explicit": {"reduction": "explicit"},
    "bf16": {"gradient_compression": "bf16"},
    "fp16": {"gradient_compression": "fp16"},
}


def meshfit_model(sizes, strategy):
    with strategy.scope():
        model = mf.Model(MLP(sizes, rngs=nnx.Rngs(0)))
        model.compile(optimizer=optimizer(), loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=256, help="global batch size")
    parser.add_argument("--sizes", default="784,512,512,10", help="MLP layer widths")
    args = parse_args(parser, repeats=1, epochs=1, batch=32, sizes="16,32,10")
    sizes, steps_per_epoch = tuple(int(n) for n in args.sizes.split(",")), 32
    print(
        f"jax {jax.__version__}, {len(jax.devices())} x {jax.devices()[0].device_kind} "
        f"({jax.default_backend()}), {os.cpu_count()} cpus"
    )
    x, y = make_data(args.batch * steps_per_epoch, sizes[0], sizes[-1])
    models = {}
    for name, options in CONTENDERS.items():
        models[name] = meshfit_model(sizes, mf.strategies.MirroredStrategy(**options))

    def fit(model):
        def go():
            model.fit(x, y, batch_size=args.batch, epochs=args.epochs, verbose=0)
            jax.block_until_ready(model.params)

        return go

    strategy = models["auto"].strategy
    contenders = {"raw": raw_epochs(sizes, x, y, args.batch, args.epochs, strategy)}
    contenders.update({name: fit(model) for name, model in models.items()})
    for go in contenders.values():
        go()
    times = {k: [] for k in contenders}
    for _ in range(args.repeats):
        for k, go in contenders.items():
            t0 = time.perf_counter()
            go()
            times[k].append(time.perf_counter() - t0)
    steps = steps_per_epoch * args.epochs
    ms = {k: 1e3 * statistics.median(v) / steps for k, v in times.items()}
    param_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(models["auto"].params))
    print(
        f"\nMLP {'-'.join(map(str, sizes))} ({param_bytes:,} parameter bytes), global batch {args.batch} on "
        f"{strategy.num_replicas_in_sync} replicas, {steps} steps/run, median of {args.repeats}"
    )
    print(f"  {'':9s} {'ms/step':>8s} {'/ raw':>6s}   all-reduce bytes per step: lowered, compiled (/ parameters)")
    print(f"  {'raw':9s} {ms['raw']:8.2f} {1.0:6.3f}")
    for name, model in models.items():
        report = model.step_report()
        lowered = report.lowered_collectives.get("all-reduce", 0)
        compiled = report.collectives.get("all-reduce", 0)
        others = {k: v for k, v in report.collectives.items() if k != "all-reduce"}
        print(
            f"  {name:9s} {ms[name]:8.2f} {ms['raw'] / ms[name]:6.3f}   "
            f"{lowered:>12,} ({lowered / param_bytes:.3f})  {compiled:>12,} ({compiled / param_bytes:.3f})"
            + ("  widened by the backend" if report.widened_collectives else "")
            + (f"  other collectives: {others}" if others else "")
        )
    print("  (/ raw: the raw loop's time over the contender's; 1.0 = as fast)")


if __name__ == "__main__":
    main()
