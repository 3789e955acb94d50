"""MeshStrategy step throughput against a hand-written jit + NamedSharding loop, and bytes per device.

On 8 simulated devices, for several mesh shapes, the same MLP is trained by
  * raw:     `jax.jit` with explicit in/out `NamedSharding`s — the parameter
             specs MeshStrategy chose, Adam moments sharded like their
             parameters, the batch split over (data, fsdp), donated state;
  * meshfit: `model.fit` under `MeshStrategy(axes=...)`.
It prints steps/s and the ratio, and a table of parameter + optimizer bytes
per device for each mesh, measured from the live arrays' addressable shards.

`--memory` prints instead, for mirrored and each mesh, what device 0 holds
after `fit` of a model built from a factory (every live buffer, counted once:
`meshfit.cost.memory.live_bytes`) and the step's peak (`model.step_report()`),
against the ideal: the state's bytes divided as the layout divides them.

    python benchmarks/bench_mesh.py [--repeats 3]
    python benchmarks/bench_mesh.py --memory
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from bench_fit import MLP, paired_ratio, train_step  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from smoke import parse_args  # noqa: E402

import meshfit as mf  # noqa: E402
from meshfit.cost.memory import live_bytes  # noqa: E402
from meshfit.strategies import layout  # noqa: E402

SIZES = (512, 1024, 1024, 512, 16)
MESHES = {
    "data=8": ({"data": 8, "fsdp": 1, "tensor": 1}, ()),
    "fsdp=8": ({"data": 1, "fsdp": 8, "tensor": 1}, ()),
    "fsdp=4 x tensor=2": (
        {"data": 1, "fsdp": 4, "tensor": 2},
        (
            (r"layers/0/kernel", ("fsdp", "tensor")),
            (r"layers/0/bias", ("tensor",)),
            (r"layers/1/kernel", ("tensor", "fsdp")),
        ),
    ),
    "data=2 x fsdp=2 x tensor=2": (
        {"data": 2, "fsdp": 2, "tensor": 2},
        (
            (r"layers/0/kernel", ("fsdp", "tensor")),
            (r"layers/0/bias", ("tensor",)),
            (r"layers/1/kernel", ("tensor", "fsdp")),
        ),
    ),
}


def raw_loop(sizes, strategy, x, y, batch, epochs):
    graphdef, params = nnx.split(MLP(sizes, rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(params)
    tx = optax.adam(1e-3, eps=1e-7)
    mesh = strategy.mesh

    def named(specs):
        return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))

    param_specs = strategy.param_specs(params)
    opt_state = tx.init(params)
    opt_specs = layout.follow_params(opt_state, params, param_specs)
    state_shardings = (named(param_specs), named(opt_specs), NamedSharding(mesh, P()))
    state = jax.device_put((params, opt_state, np.zeros((), np.float32)), state_shardings)
    batch_sharding = NamedSharding(mesh, P(("data", "fsdp")))

    run = jax.jit(
        train_step(graphdef, tx),
        in_shardings=(state_shardings, batch_sharding, batch_sharding),
        out_shardings=state_shardings,
        donate_argnums=0,
    )
    steps = len(x) // batch
    rng = np.random.default_rng(0)

    def go():
        nonlocal state
        for _ in range(epochs):
            order = rng.permutation(len(x))
            for i in range(steps):
                idx = order[i * batch : (i + 1) * batch]
                xb, yb = jax.device_put((x[idx], y[idx]), batch_sharding)
                state = run(state, xb, yb)
                if i % 8 == 7:
                    jax.block_until_ready(state[2])
        jax.block_until_ready(state)

    return go


def bytes_per_device(tree):
    per_device = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values())


def memory_table(sizes, x, y, batch):
    """Device 0 after a fit, per layout: live bytes and the step's peak against the layout's share."""
    print("\n  layout                        state total   ideal on device 0   live on device 0 (/ ideal)   step peak")
    layouts = {"mirrored": mf.strategies.MirroredStrategy()}
    for name in ("fsdp=8", "fsdp=4 x tensor=2"):
        axes, rules = MESHES[name]
        layouts[name] = mf.strategies.MeshStrategy(axes=axes, rules=rules, min_shard_size=1024)
    baseline = live_bytes().total  # the data and anything else alive before the model
    for name, strategy in layouts.items():
        with strategy.scope():
            model = mf.Model(lambda: MLP(sizes, rngs=nnx.Rngs(0)))
            model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
        state = model.session.state
        total = sum(a.nbytes for a in jax.tree.leaves(state))
        ideal = bytes_per_device(state)  # the state's shards on one device, as the layout splits it
        live = live_bytes().total - baseline
        peak = model.step_report().memory["peak"]
        print(
            f"  {name:28s} {total / 2**20:9.2f} MiB {ideal / 2**20:14.2f} MiB {live / 2**20:14.2f} MiB "
            f"({live / ideal:5.3f}) {peak / 2**20:14.2f} MiB"
        )
        del model, state


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="MLP layer widths")
    parser.add_argument("--memory", action="store_true", help="the memory table instead of throughput")
    parser.add_argument(
        "--meshes", default=";".join(MESHES), help=f"semicolon-separated, of {';'.join(MESHES)} (default: all)"
    )
    args = parse_args(
        parser, repeats=1, batch=16, steps=4, sizes="32,64,64,32,16", meshes="data=8;data=2 x fsdp=2 x tensor=2"
    )
    meshes = {name.strip(): MESHES.get(name.strip()) for name in args.meshes.split(";")}
    unknown = [name for name, mesh in meshes.items() if mesh is None]
    if unknown:
        parser.error(f"--meshes takes names of {list(MESHES)}. Received: {unknown}.")
    sizes = tuple(int(n) for n in args.sizes.split(","))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch * args.steps, sizes[0]), dtype=np.float32)
    y = rng.integers(0, sizes[-1], len(x)).astype(np.int32)
    print(
        f"jax {jax.__version__}, {len(jax.devices())} x {jax.devices()[0].device_kind}, {os.cpu_count()} cpus; "
        f"MLP {'-'.join(map(str, sizes))}, global batch {args.batch}, {args.steps} steps/run, "
        f"median of {args.repeats}"
    )
    if args.memory:
        memory_table(sizes, x, y, args.batch)
        return
    table = []
    for name, (axes, rules) in meshes.items():
        strategy = mf.strategies.MeshStrategy(axes=axes, rules=rules, min_shard_size=1024)
        with strategy.scope():
            model = mf.Model(MLP(sizes, rngs=nnx.Rngs(0)))
            model.compile(
                optimizer=optax.adam(1e-3, eps=1e-7), loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True)
            )

        def meshfit_go(model=model):
            model.fit(x, y, batch_size=args.batch, epochs=args.epochs, verbose=0)
            jax.block_until_ready(model.params)

        contenders = {"raw": raw_loop(sizes, strategy, x, y, args.batch, args.epochs), "meshfit": meshfit_go}
        for go in contenders.values():
            go()
        times = {k: [] for k in contenders}
        for _ in range(args.repeats):
            for k, go in contenders.items():
                t0 = time.perf_counter()
                go()
                times[k].append(time.perf_counter() - t0)
        sps = {k: args.steps * args.epochs / statistics.median(v) for k, v in times.items()}
        state = (model.session.state.params, model.session.state.opt_state)
        total = sum(a.nbytes for a in jax.tree.leaves(state))
        per_device = bytes_per_device(state)
        table.append((name, total, per_device))
        print(
            f"  {name:28s} raw {sps['raw']:6.1f} steps/s  meshfit {sps['meshfit']:6.1f} steps/s  "
            f"ratio {sps['meshfit'] / sps['raw']:.3f}  paired {paired_ratio(times, 'meshfit', 'raw'):.3f}"
        )
    print("\n  mesh                          params+opt total   per device   per device / (total/8)")
    for name, total, per_device in table:
        print(f"  {name:28s} {total / 2**20:12.2f} MiB {per_device / 2**20:9.2f} MiB   {per_device / (total / 8):6.3f}")


if __name__ == "__main__":
    main()
