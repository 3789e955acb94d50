"""Pipeline schedules on 8 simulated devices: the bubble and the activation memory measured from the programs.

A `Stages` stack's loss gradient, compiled under `stage=4 x data=2` for each schedule at M = 4P and under
FSDP alone (`fsdp=8`, the baseline of every ratio). Measures that do not depend on wall time (the 2 cores
that run 8 simulated devices make every tick cost the same, busy or idle):

  * bubble: the matmul FLOPs per device of the pipelined gradient's jaxpr (loops times their trip counts,
    idle ticks included) against the useful FLOPs (the FSDP gradient's, over 8 devices):
    measured = 1 - useful / pipelined, printed against the schedule's formula;
  * activation memory per device: the residuals `jax.vjp` keeps from the forward to the backward pass (for 1f1b,
    whose one loop runs both, those of the loss: the input's cotangent) and the largest loop carry
    (the row-proportional part: bytes at 2x the rows minus bytes at 1x), against the
    formula in units measured on one stage: R = one microbatch's residuals through a stage's layers,
    I = one microbatch's stage input;
  * temporaries per device (`compiled.memory_analysis()`) and seconds per step (indicative only);
  * what each schedule reports of itself while the gradient is traced (`meshfit.cost.pipeline_cost.recorded`,
    the figures `model.step_report().pipeline` shows): its point-to-point bytes against the `ppermute`
    operands of the jaxpr times their loops' trip counts, and its kept activations (depth x one pass's
    residuals) against the measured ones less the stage inputs the formulas above count beside them.

Run: `python benchmarks/bench_pipeline.py` (`--smoke`: tiny sizes, one timed step).
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import meshfit as mf  # noqa: E402
from meshfit.cost import pipeline_cost  # noqa: E402
from meshfit.pipeline import Stages, one_f_one_b  # noqa: E402
from meshfit.strategies.mesh import MeshStrategy  # noqa: E402

_parser = argparse.ArgumentParser(description="Pipeline schedules on 8 simulated CPU devices, against the formulas.")
_parser.add_argument("--smoke", action="store_true", help="tiny sizes, one timed step (the benchmarks' tests)")
SMOKE = _parser.parse_args().smoke
WIDTH, LAYERS, ROWS, STAGES, DATA = (16, 8, 32, 4, 2) if SMOKE else (256, 8, 256, 4, 2)
MICRO = 4 * STAGES
REPEATS = 1 if SMOKE else 5
MIB = 2**20


class Block(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(WIDTH, 4 * WIDTH, rngs=rngs)
        self.down = nnx.Linear(4 * WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jnp.tanh(self.up(x)))


def matmul_flops(jaxpr, devices: int) -> float:
    """Matmul FLOPs per device of `jaxpr`: loops counted times their trip counts, shard_map bodies per shard."""
    return _walk(jaxpr, 1.0 / devices, _dot_flops)


def largest_loop_carry(jaxpr, devices: int) -> float:
    """Bytes per device of the largest `scan` carry in `jaxpr` (e.g. the 1f1b stash, the received buffers)."""
    return _walk(jaxpr, 1.0 / devices, _carry_bytes, combine=max)


def sent_bytes(jaxpr, devices: int) -> float:
    """Bytes per device of the `ppermute` operands of `jaxpr`, loops counted times their trip counts."""
    return _walk(jaxpr, 1.0 / devices, _ppermute_bytes)


def _ppermute_bytes(eqn) -> float:
    if eqn.primitive.name != "ppermute":
        return 0.0
    return float(sum(v.aval.size * v.aval.dtype.itemsize for v in eqn.invars))


def _dot_flops(eqn) -> float:
    if eqn.primitive.name != "dot_general":
        return 0.0
    (contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    return 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contract)


def _carry_bytes(eqn) -> float:
    if eqn.primitive.name != "scan":
        return 0.0
    start = eqn.params["num_consts"]
    carry = eqn.invars[start : start + eqn.params["num_carry"]]
    return float(sum(v.aval.size * v.aval.dtype.itemsize for v in carry))


def _walk(jaxpr, scale: float, measure, combine=sum) -> float:
    """`measure` of every equation, times `scale` (1 / the devices an array's global shape spans), combined."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    found = []
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        found.append(measure(eqn) * scale)
        if name == "while":
            raise ValueError("A while loop has no static trip count: count its work by hand.")
        if name == "scan":
            inner = _walk(eqn.params["jaxpr"], scale, measure, combine)
            found.append(inner * eqn.params["length"] if combine is sum else inner)
        elif name == "cond":
            found.append(max(_walk(b, scale, measure, combine) for b in eqn.params["branches"]))
        elif name == "shard_map":
            mesh = eqn.params["mesh"]
            manual = math.prod(mesh.shape[a] for a in eqn.params["newly_manual_axes"])
            found.append(_walk(eqn.params["jaxpr"], scale * manual, measure, combine))
        else:
            for value in eqn.params.values():
                for sub in value if isinstance(value, tuple) else (value,):
                    if isinstance(sub, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr)):
                        found.append(_walk(sub, scale, measure, combine))
    return float(combine(found)) if found else 0.0


def kept_bytes(fn, *args) -> float:
    """Bytes per device of the residuals `jax.vjp(fn, *args)` keeps for the backward pass."""
    residuals = jax.jit(lambda *a: jax.tree.leaves(jax.vjp(fn, *a)[1])).lower(*args).compile()
    shapes = jax.eval_shape(lambda *a: jax.tree.leaves(jax.vjp(fn, *a)[1]), *args)
    return float(
        sum(
            math.prod(sharding.shard_shape(s.shape)) * s.dtype.itemsize
            for s, sharding in zip(shapes, residuals.output_shardings, strict=True)
        )
    )


def build(strategy, rows):
    """(forward, loss, params, x) of the stack under `strategy`, parameters and batch laid out as it says."""
    with strategy.scope():
        stack = Stages(Block, LAYERS, rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(stack)
        specs = strategy.param_specs(nnx.to_pure_dict(params), nnx.to_pure_dict(nnx.get_partition_spec(params)))
        shardings = jax.tree.map(lambda s: jax.sharding.NamedSharding(strategy.mesh, s), specs)
        params = nnx.State(jax.device_put(nnx.to_pure_dict(params), shardings))
        x = jax.device_put(jnp.ones((rows, WIDTH)), strategy.batch_sharding())

    def forward(params, x):
        return nnx.merge(graphdef, params)(x)

    def loss(params, x):
        return jnp.mean(forward(params, x) ** 2)

    pipeline = getattr(strategy, "pipeline", None)
    if (
        pipeline is not None and pipeline.schedule == "1f1b"
    ):  # the loss inside the last stage, as the train step runs it
        size = rows * WIDTH

        def parts(tree, x, consts):
            return jnp.sum(forward(tree["stack"], x) ** 2) / size, ()

        def loss(params, x):  # noqa: F811
            return one_f_one_b.objective(parts, {"stack": params}, x, (), ("stack",), strategy.stage_layout)[0]

        params = nnx.to_pure_dict(params)
    return forward, loss, params, x


def measure(strategy):
    """The figures of one layout: FLOPs, kept activations, largest loop carry, temporaries, seconds per step."""
    with strategy.scope():
        return _measure(strategy)


def _measure(strategy):
    figures = {}
    for scale in (1, 2):
        forward, loss, params, x = build(strategy, scale * ROWS)
        grad = jax.grad(loss, argnums=(0, 1))
        jaxpr = jax.make_jaxpr(grad)(params, x)
        fused = getattr(strategy.pipeline, "schedule", None) == "1f1b"  # its forward and backward are one loop
        figures[scale] = (kept_bytes(loss if fused else forward, params, x), largest_loop_carry(jaxpr, 8))
    kept = figures[2][0] - figures[1][0]
    carry = figures[2][1] - figures[1][1]
    forward, loss, params, x = build(strategy, ROWS)
    grad = jax.grad(loss, argnums=(0, 1))
    jaxpr, schedules = pipeline_cost.recorded(lambda: jax.make_jaxpr(grad)(params, x))  # what each loop reports
    flops, sent = matmul_flops(jaxpr, 8), sent_bytes(jaxpr, 8)
    step = strategy.compile(grad)
    temp = step.lower(params, x).compile().memory_analysis().temp_size_in_bytes
    jax.block_until_ready(step(params, x))
    start = time.perf_counter()
    for _ in range(REPEATS):
        jax.block_until_ready(step(params, x))
    seconds = (time.perf_counter() - start) / REPEATS
    return {
        "flops": flops,
        "kept": kept,
        "carry": carry,
        "temp": temp,
        "s": seconds,
        "sent": sent,
        "reported": schedules,
    }


def stage_units():
    """(R, I): one microbatch's residuals through a stage's layers, and its stage input, in bytes per device."""
    rows = ROWS // (MICRO * DATA)
    stack = Stages(Block, LAYERS // STAGES, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(stack)
    run = lambda params, x: nnx.merge(graphdef, params)(x)  # noqa: E731
    one, two = (kept_bytes(run, params, jnp.ones((n * rows, WIDTH))) for n in (1, 2))
    return two - one, rows * WIDTH * 4


def kib(n: float) -> str:
    return f"{n / 1024:,.1f} KiB"


def main():
    layouts = [
        ("gpipe", mf.strategies.Pipeline(microbatches=MICRO)),
        ("1f1b", mf.strategies.Pipeline(microbatches=MICRO, schedule="1f1b")),
        ("circular v=2", mf.strategies.Pipeline(microbatches=MICRO, schedule="circular", repeats=2)),
    ]
    base = measure(mf.strategies.MeshStrategy(axes={"data": 1, "fsdp": 8}, min_shard_size=1))
    rows = []
    for name, pipeline in layouts:
        rows.append((name, pipeline, measure(MeshStrategy(axes={"stage": STAGES, "data": DATA}, pipeline=pipeline))))
    r, i = stage_units()
    m, p = MICRO, STAGES
    # The work each program runs per stage, in F (one microbatch's forward through a stage; its backward is 2F):
    # gpipe and circular run M + P - 1 (v M + P - 1) ticks of F forward and 2F backward; 1f1b runs P - 1 ticks
    # of F, M of F + 2F, P - 1 of 2F (its backward reads the forward's stashed residuals). Useful: 3 M F.
    work = {"gpipe": None, "circular v=2": None, "1f1b": 1 - 3 * m / ((p - 1) + 3 * m + 2 * (p - 1))}
    print(f"stage={STAGES} x data={DATA}, M={m}, {LAYERS} blocks of width {WIDTH}, {ROWS} rows; baseline fsdp=8 alone")
    print(f"units per device: R = {kib(r)} (a microbatch's residuals through a stage), I = {kib(i)} (its input)")
    print()
    print(
        "| layout | matmul GFLOP per device | bubble measured | formula (P-1)/(vM+P-1) | measured / formula "
        "| work model | measured / model |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print(f"| fsdp=8 alone (useful work) | {base['flops'] / 1e9:.4f} | - | - | - | - | - |")
    for name, pipeline, got in rows:
        measured = 1 - base["flops"] / got["flops"]
        formula = pipeline.bubble(p)
        model = work[name] if work[name] is not None else formula
        print(
            f"| {name} | {got['flops'] / 1e9:.4f} | {measured:.3f} | {formula:.3f} | {measured / formula:.2f} "
            f"| {model:.3f} | {measured / model:.2f} |"
        )
    print()
    formulas = {
        "gpipe": (m * r, "M R", m * i, "M I"),
        "circular v=2": (m * r, "M R", m * i, "M I"),
        "1f1b": (m * i, "M I", min(2 * p - 1, m) * r + (m + 2) * i, "min(2P-1,M) R + (M+2) I"),
    }
    print(
        "| layout | kept fwd->bwd | formula | measured / formula | largest loop carry | formula | measured / formula "
        "| temporaries | vs fsdp | ms per step | vs fsdp |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print(
        f"| fsdp=8 alone | {kib(base['kept'])} | - | - | {kib(base['carry'])} | - | - | {kib(base['temp'])} | 1.00 "
        f"| {base['s'] * 1e3:.1f} | 1.00 |"
    )
    for name, _, got in rows:
        kept, kept_name, carry, carry_name = formulas[name]
        print(
            f"| {name} | {kib(got['kept'])} | {kept_name} = {kib(kept)} | {got['kept'] / kept:.2f} "
            f"| {kib(got['carry'])} | {carry_name} = {kib(carry)} | {got['carry'] / carry:.2f} "
            f"| {kib(got['temp'])} | {got['temp'] / base['temp']:.1f} | {got['s'] * 1e3:.1f} "
            f"| {got['s'] / base['s']:.1f} |"
        )
    print()
    # The stage inputs the measured activations hold beside the passes' residuals (the formulas above): the
    # batch's M I kept for the backward (gpipe, circular), the stash's ring beside M + 2 I (1f1b's loop carry).
    beside = {"gpipe": ("kept", m * i), "circular v=2": ("kept", m * i), "1f1b": ("carry", (m + 2) * i)}
    print(
        "| layout | p2p reported | p2p measured (ppermutes x trips) | measured / reported | depth (passes) "
        "| kept reported (depth x pass) | measured less stage inputs | measured / reported |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, _, got in rows:
        cost = pipeline_cost.pipeline_cost(got["reported"], {})
        which, inputs = beside[name]
        measured = got[which] - inputs
        print(
            f"| {name} | {kib(cost.p2p_bytes)} | {kib(got['sent'])} | {got['sent'] / cost.p2p_bytes:.2f} "
            f"| {cost.kept_passes} | {cost.kept_passes} x {kib(cost.pass_residual_bytes)} = "
            f"{kib(cost.activation_bytes)} | {kib(measured)} | {measured / cost.activation_bytes:.2f} |"
        )


if __name__ == "__main__":
    main()
