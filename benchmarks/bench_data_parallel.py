"""Data-parallel fit throughput on 8 simulated devices, and the gradient all-reduce from the HLO.

Compares, in one run and on the same data:
  * raw:     a hand-written loop: `jax.jit` over a ("data",) mesh, state replicated
             with `NamedSharding(mesh, P())`, each batch `device_put` with
             `NamedSharding(mesh, P("data"))`, donated buffers;
  * meshfit: `model.fit` under `MirroredStrategy()`.
Then reads meshfit's compiled train step and reports the bytes its all-reduces
move per step against the parameter bytes (1.0 = each gradient reduced once),
the number of all-reduce ops, and any all-gathers.

    python benchmarks/bench_data_parallel.py [--repeats 5] [--epochs 2]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from bench_fit import MLP, make_data, optimizer, train_step  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import meshfit as mf  # noqa: E402

_DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "f64": 8, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1, "s64": 8}


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


def meshfit_model(sizes, strategy):
    with strategy.scope():
        model = mf.Model(MLP(sizes, rngs=nnx.Rngs(0)))
        model.compile(optimizer=optimizer(), loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def collective_bytes(hlo: str):
    """(all-reduce bytes, all-reduce ops, all-gather ops) in a compiled HLO module."""
    total, reduces, gathers = 0, 0, 0
    for line in hlo.splitlines():
        match = re.search(r"=\s*(\(.*?\)|\S+)\s+(all-reduce(?:-start)?|all-gather(?:-start)?)\(", line)
        if not match:
            continue
        if match.group(2).startswith("all-gather"):
            gathers += 1
            continue
        reduces += 1
        for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", match.group(1)):
            count = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
            total += count * _DTYPE_BYTES.get(dtype, 4)
    return total, reduces, gathers


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=256, help="global batch size")
    args = parser.parse_args()
    sizes, steps_per_epoch = (784, 512, 512, 10), 32
    print(
        f"jax {jax.__version__}, {len(jax.devices())} x {jax.devices()[0].device_kind} "
        f"({jax.default_backend()}), {os.cpu_count()} cpus"
    )
    x, y = make_data(args.batch * steps_per_epoch, sizes[0], sizes[-1])
    strategy = mf.strategies.MirroredStrategy()
    model = meshfit_model(sizes, strategy)

    def meshfit_go():
        model.fit(x, y, batch_size=args.batch, epochs=args.epochs, verbose=0)
        jax.block_until_ready(model.params)

    contenders = {"raw": raw_epochs(sizes, x, y, args.batch, args.epochs, strategy), "meshfit": meshfit_go}
    for go in contenders.values():
        go()
    times = {k: [] for k in contenders}
    for _ in range(args.repeats):
        for k, go in contenders.items():
            t0 = time.perf_counter()
            go()
            times[k].append(time.perf_counter() - t0)
    steps = steps_per_epoch * args.epochs
    sps = {k: steps / statistics.median(v) for k, v in times.items()}
    print(
        f"\nMLP {'-'.join(map(str, sizes))}, global batch {args.batch} on {strategy.num_replicas_in_sync} "
        f"replicas, {steps} steps/run, median of {args.repeats}"
    )
    for k, v in sps.items():
        print(f"  {k:8s} {v:8.1f} steps/s  {1e3 / v:7.2f} ms/step")
    print(f"  ratio meshfit/raw = {sps['meshfit'] / sps['raw']:.3f}  (target >= 0.95)")

    session = model.session
    _, staged = next(session.train_executions(model._make_data(x, y, None, args.batch), 0))  # the step fit ran
    hlo = session._train_staged.lower(session.state, staged.stage, staged.indices[0]).compile().as_text()
    reduced, n_reduce, n_gather = collective_bytes(hlo)
    param_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(model.params))
    print(
        f"\nall-reduce: {n_reduce} op(s), {reduced:,} bytes per step; parameters {param_bytes:,} bytes; "
        f"ratio {reduced / param_bytes:.4f} (target 1.0); all-gathers: {n_gather}"
    )


if __name__ == "__main__":
    main()
