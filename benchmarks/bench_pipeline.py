"""Pipeline schedules on 8 simulated devices: bubble by formula, activation memory gpipe vs 1f1b at M = 4P.

Compiles the gradient of a `Stages` stack (stage=4 x data=2) under each schedule and reads each
program's temporaries per device (`compiled.memory_analysis()`), and times the steps against the
same stack under FSDP alone (data=1 x fsdp=8). Run: `python benchmarks/bench_pipeline.py` (`--smoke`: tiny sizes).
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import meshfit as mf  # noqa: E402
from meshfit.pipeline import Stages  # noqa: E402

WIDTH, LAYERS, ROWS, STAGES = (16, 8, 32, 4) if "--smoke" in sys.argv[1:] else (256, 8, 256, 4)


class Block(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(WIDTH, 4 * WIDTH, rngs=rngs)
        self.down = nnx.Linear(4 * WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jnp.tanh(self.up(x)))


def measure(strategy):
    """(temporaries per device in MiB, seconds per gradient step) of the stack's loss gradient."""
    with strategy.scope():
        stack = Stages(Block, LAYERS, rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(stack)

        def loss(params, x):
            return jnp.mean(nnx.merge(graphdef, params)(x) ** 2)

        x = jax.device_put(jnp.ones((ROWS, WIDTH)), strategy.batch_sharding())
        specs = strategy.param_specs(nnx.to_pure_dict(params), nnx.to_pure_dict(nnx.get_partition_spec(params)))
        shardings = jax.tree.map(lambda s: jax.sharding.NamedSharding(strategy.mesh, s), specs)
        params = nnx.State(jax.device_put(nnx.to_pure_dict(params), shardings))
        step = strategy.compile(jax.grad(loss))
        compiled = jax.jit(jax.grad(loss)).lower(params, x).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
        jax.block_until_ready(step(params, x))
        start = time.perf_counter()
        for _ in range(5):
            jax.block_until_ready(step(params, x))
        return temp, (time.perf_counter() - start) / 5


def main():
    rows = []
    for name, pipeline in [
        ("gpipe M=16", mf.strategies.Pipeline(microbatches=16)),
        ("1f1b M=16", mf.strategies.Pipeline(microbatches=16, schedule="1f1b")),
        ("circular v=2 M=16", mf.strategies.Pipeline(microbatches=16, schedule="circular", repeats=2)),
    ]:
        strategy = mf.strategies.MeshStrategy(axes={"stage": STAGES, "data": 2}, pipeline=pipeline)
        temp, seconds = measure(strategy)
        rows.append((name, pipeline.bubble(STAGES), temp, seconds))
    fsdp = mf.strategies.MeshStrategy(axes={"data": 1, "fsdp": 8}, min_shard_size=1)
    temp, seconds = measure(fsdp)
    rows.append(("fsdp=8 alone", 0.0, temp, seconds))
    print("| layout | bubble (formula) | temporaries per device | s per gradient step |")
    print("| --- | --- | --- | --- |")
    for name, bubble, temp, seconds in rows:
        print(f"| {name} | {bubble:.3f} | {temp:.1f} MiB | {seconds * 1e3:.1f} ms |")


if __name__ == "__main__":
    main()
