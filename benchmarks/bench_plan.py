"""`meshfit.plan`'s predictions against measurements: peak memory per device and step time, per candidate.

The model is `examples/transformer_lm.py`'s transformer (its default size,
its Megatron rules) on 8 devices, planned for every layout and remat choice
at one batch size. Then each candidate that compiled is built for real under
its strategy and trained for a few steps, and the benchmark prints per
candidate the predicted peak memory of one device against the measured one
and the predicted step time against the measured one, and whether the plan's
pick is the fastest measured.

Measured memory: where the platform reports it (`memory_stats()`, GPU/TPU),
each candidate runs in a process of its own and its `peak_bytes_in_use` is
read. The parent has compiled the plan on the device first: unless the user
set it, `XLA_PYTHON_CLIENT_PREALLOCATE=false` is set before JAX starts, so the
parent does not reserve 75 % of the GPU's memory and starve its children
(which inherit the setting; each child prints the value it ran with); on the CPU, what device 0 holds after the steps
(`meshfit.cost.memory.live_bytes`: state, staged batches, accumulators) plus the
compiled step's temporaries. On the CPU the devices are simulated (8 on the
host's cores): the measured step times are those of simulated devices, and
the roofline's are of the nominal `meshfit.cost.roofline.HOST_CPU`; only the
order of the candidates can be compared there, not the seconds.

    python benchmarks/bench_plan.py              # transformer, 8 (simulated) devices, batch 32
    python benchmarks/bench_plan.py --smoke      # a tiny MLP on 2 devices, a few seconds
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# Before JAX starts: a parent that reserved 75 % of the GPU would leave its measuring children too little.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import meshfit as mf  # noqa: E402
from meshfit.cost.memory import live_bytes  # noqa: E402
from meshfit.planning.planner import MESH_AXES, Layout  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import transformer_lm  # noqa: E402

COMPILE = dict(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))


class TinyMLP(nnx.Module):
    def __init__(self, remat: bool = False):
        rngs = nnx.Rngs(0)
        self.hidden = nnx.Linear(16, 64, rngs=rngs)
        self.out = nnx.Linear(64, 8, rngs=rngs)
        self.remat = remat

    def __call__(self, x):
        layer = lambda m, h: nnx.relu(m(h))  # noqa: E731
        return self.out(nnx.remat(layer)(self.hidden, x) if self.remat else layer(self.hidden, x))


def setup(smoke: bool, batch_size: int):
    """(factory, x, y, rules, devices) of the benchmark's model."""
    if smoke:
        rng = np.random.default_rng(0)
        x = rng.standard_normal((batch_size, 16)).astype(np.float32)
        return TinyMLP, x, rng.integers(0, 8, batch_size).astype(np.int32), (), jax.devices()[:2]
    text = transformer_lm.load_corpus(200_000)
    (x, y), _ = transformer_lm.make_datasets(text, 64)
    return transformer_lm.plan_factory, x[: 8 * batch_size], y[: 8 * batch_size], transformer_lm.PLAN_RULES, None


def measure(strategy, remat, batch: int, factory, x, y, steps: int) -> dict:
    """Trains the model under `strategy` for real: seconds per step and the peak bytes of its first device."""
    device = strategy.mesh.devices.flat[0]
    with strategy.scope():
        model = mf.Model(lambda: factory(remat=remat) if remat is not None else factory())
        model.compile(**COMPILE)
    x, y = np.resize(x, (batch * steps, *x.shape[1:])), np.resize(y, (batch * steps, *y.shape[1:]))
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)  # compiles, warms the input pipeline
    start = time.perf_counter()
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
    seconds = (time.perf_counter() - start) / steps
    stats = device.memory_stats()
    if stats and "peak_bytes_in_use" in stats:
        peak = stats["peak_bytes_in_use"]
    else:
        peak = live_bytes(device).total + model.step_report().memory["temporaries"]
    return {"seconds": seconds, "peak": peak}


def measure_alone(candidate, args) -> dict:
    """`measure` of `candidate` in a process of its own (a fresh `peak_bytes_in_use`)."""
    layout = "mirrored" if candidate.layout.axes is None else ",".join(str(n) for _, n in candidate.layout.axes)
    command = [sys.executable, __file__, "--one", f"{layout}:{candidate.remat}", "--batch-size", str(args.batch_size)]
    command += ["--steps", str(args.steps)] + (["--smoke"] if args.smoke else [])
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:  # out of memory, for one: the row says so
        return {"seconds": float("nan"), "peak": float("nan"), "error": done.stderr.strip().splitlines()[-1][:200]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_one(spec: str, args, factory, x, y, rules, devices) -> dict:
    """The child of `measure_alone`: `spec` is "mirrored:REMAT" or "DATA,FSDP,TENSOR:REMAT"."""
    layout, remat = spec.split(":")
    axes = None if layout == "mirrored" else tuple(zip(MESH_AXES, map(int, layout.split(",")), strict=True))
    strategy = Layout(axes).strategy(devices or jax.devices(), rules)
    remat = {"None": None, "True": True, "False": False}[remat]
    return measure(strategy, remat, args.batch_size, factory, x, y, args.steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny MLP on 2 devices, one remat choice")
    parser.add_argument("--batch-size", type=int, default=None, help="global batch (default 32; smoke 16)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per candidate (default 20; smoke 10)")
    parser.add_argument("--isolate", action="store_true", help="measure each candidate in a process of its own")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child: measure one candidate
    args = parser.parse_args()
    args.batch_size = args.batch_size or (16 if args.smoke else 32)
    args.steps = args.steps or (10 if args.smoke else 20)
    factory, x, y, rules, devices = setup(args.smoke, args.batch_size)
    if args.one is not None:
        got = measure_one(args.one, args, factory, x, y, rules, devices)
        print(json.dumps(got | {"preallocate": os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE")}))
        return
    remat = [False] if args.smoke else None
    planned = mf.plan(
        factory, x, y, compile=COMPILE, devices=devices, batch_sizes=[args.batch_size], remat=remat, rules=rules
    )
    compiled = [c for c in planned.candidates if c.report is not None]
    print(planned)
    print()
    alone = args.isolate or bool(jax.devices()[0].memory_stats())  # GPU/TPU: a fresh peak per candidate
    cpu = jax.devices()[0].platform == "cpu"
    time_label = "measured (simulated devices)" if cpu else "measured"
    print(f"{'layout':<22} {'remat':<5} {'peak predicted':>14} {'measured':>10} {'ratio':>6}   ", end="")
    print(f"{'step predicted':>14} {time_label:>28} {'ratio':>7}")
    measured = {}
    for i, candidate in enumerate(compiled):
        if alone:
            got = measure_alone(candidate, args)
        else:
            got = measure(candidate.strategy(), candidate.remat, candidate.batch_size, factory, x, y, args.steps)
        measured[i] = got
        predicted_ms, measured_ms = candidate.step_seconds * 1e3, got["seconds"] * 1e3
        print(
            f"{candidate.layout.name:<22} {str(candidate.remat):<5} {candidate.peak_bytes / 2**20:>10.2f} MiB "
            f"{got['peak'] / 2**20:>6.2f} MiB {got['peak'] / candidate.peak_bytes:>6.2f}   "
            f"{predicted_ms:>11.3f} ms {measured_ms:>25.2f} ms {measured_ms / predicted_ms:>7.1f}"
        )
    if alone:
        seen = sorted({str(got.get("preallocate")) for got in measured.values() if "error" not in got})
        print(f"each candidate measured in a process of its own, XLA_PYTHON_CLIENT_PREALLOCATE={','.join(seen)}")
    failed = [i for i in measured if "error" in measured[i]]
    for i in failed:
        print(f"{compiled[i].layout.name} remat={compiled[i].remat} failed: {measured[i]['error']}")
    print(f"candidates marked fitting that failed to train: {sum(compiled[i].fits for i in failed)}")
    fitting = [i for i, c in enumerate(compiled) if c.fits and i not in failed]
    pick = compiled.index(planned.best)
    fastest = min(fitting, key=lambda i: measured[i]["seconds"])
    pick_s, fastest_s = measured[pick]["seconds"], measured[fastest]["seconds"]
    print(
        f"\nplan's pick: {planned.best.layout.name} remat={planned.best.remat} ({pick_s * 1e3:.2f} ms measured); "
        f"fastest measured: {compiled[fastest].layout.name} remat={compiled[fastest].remat} "
        f"({fastest_s * 1e3:.2f} ms): the pick is {'the fastest' if pick == fastest else 'not the fastest'}, "
        f"{pick_s / fastest_s:.2f}x its time" + (" (simulated devices: the CPU's order, not a GPU's)" if cpu else "")
    )
    ranks = np.argsort(np.argsort([compiled[i].step_seconds for i in fitting]))
    measured_ranks = np.argsort(np.argsort([measured[i]["seconds"] for i in fitting]))
    spearman = np.corrcoef(ranks, measured_ranks)[0, 1] if len(fitting) > 1 else float("nan")
    peaks = [measured[i]["peak"] / compiled[i].peak_bytes for i in range(len(compiled)) if i not in failed]
    print(
        f"peak measured / predicted: {min(peaks):.2f} to {max(peaks):.2f} (median {np.median(peaks):.2f}); "
        f"rank correlation of predicted and measured step times: {spearman:.2f} over {len(fitting)} candidates"
    )


if __name__ == "__main__":
    main()
