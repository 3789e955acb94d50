"""Straggler benchmark: async against sync parameter-server training with one slow worker.

4 workers; every gradient is followed by a simulated device time (`--base`
seconds; the straggler takes 3x as long, i.e. runs at a third of the speed).
Both modes compute each gradient on the same number of rows: sync splits a
global batch of 4 x B over the workers, async gives each worker whole batches
of B. Prints samples/s of each, the ratio (target >= 2), and the staleness of
the gradients async applied.

    python benchmarks/bench_parameter_server.py [--base 0.01] [--steps 48] [--cluster ray|processes]

With `--cluster ray` the same runs use Ray actors (a local Ray cluster: 4
worker actors, 1 server actor), and a second part measures what each server
actor receives per applied gradient as the number of servers S grows (a
model of about 2 MB of parameters, 2 workers, async): about the parameter
bytes / S, so server 0's traffic falls as S grows.

With `--cluster processes` each mode runs as its own job of the process
transport, `meshfit launch --ps S --workers 4` (`--ps`, 1 by default; this
script on the server ranks, the worker processes with `MESHFIT_PS_WORKER_DELAYS` for the
straggler); the time is that of the second fit, as in-process.

With `--node-loss` (Ray), a local 3-node Ray cluster (`ray.cluster_utils`:
the servers on the head, one worker actor on each of two nodes) trains async,
then sync, and one worker node is removed mid-fit: prints the longest wait
between two applied gradients around the loss (the time from the node's loss
to the job going on) next to the usual interval.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from smoke import parse_args  # noqa: E402

import meshfit as mf  # noqa: E402


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(64, 128, rngs=rngs)
        self.out = nnx.Linear(128, 10, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


class Wide(nnx.Module):
    """About 2 MB of float32 parameters, nearly all in two kernels that split over the servers."""

    def __init__(self, rngs):
        self.hidden = nnx.Linear(64, 4096, rngs=rngs)
        self.out = nnx.Linear(4096, 64, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


def strategy_for(mode, cluster, delays, **kwargs):
    if cluster == "inside-launch":  # the server rank of `meshfit launch --ps`: the worker processes are the workers
        return mf.strategies.ParameterServerStrategy(mode=mode, **kwargs)
    if cluster == "ray":
        return mf.strategies.ParameterServerStrategy(
            mode=mode, cluster="ray", num_workers=len(delays), worker_delays=delays, **kwargs
        )
    return mf.strategies.ParameterServerStrategy(mode=mode, workers=jax.devices()[: len(delays)], worker_delays=delays)


def run(mode, x, y, batch, base, epochs, cluster=None):
    delays = {i: base for i in range(4)}
    delays[3] = 3 * base
    strategy = strategy_for(mode, cluster, delays)
    with strategy.scope():
        model = mf.Model(MLP(nnx.Rngs(0)))
        model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x[: batch * 4], y[: batch * 4], batch_size=batch, epochs=1, verbose=0)  # compile
    t0 = time.perf_counter()
    history = model.fit(x, y, batch_size=batch, epochs=epochs, verbose=0)
    return len(x) * epochs / (time.perf_counter() - t0), history


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=float, default=0.01, help="simulated seconds per gradient (fast workers)")
    parser.add_argument("--rows", type=int, default=32, help="rows per gradient")
    parser.add_argument("--steps", type=int, default=48, help="sync rounds per epoch")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument(
        "--cluster",
        choices=["ray", "processes"],
        default=None,
        help="run workers and servers as Ray actors, or as processes of `meshfit launch --ps S --workers 4`",
    )
    parser.add_argument("--ps", type=int, default=1, help="with --cluster processes: server processes (S)")
    parser.add_argument(
        "--node-loss", action="store_true", help="Ray: time from a worker node's loss to the job going on"
    )
    parser.add_argument("--inside", default=None, help=argparse.SUPPRESS)  # a mode, run under `meshfit launch --ps`
    args = parse_args(parser, base=0.001, rows=8, steps=4, epochs=1)
    rng = np.random.default_rng(0)
    n = args.rows * 4 * args.steps
    x = rng.standard_normal((n, 64), dtype=np.float32)
    y = rng.integers(0, 10, n).astype(np.int32)
    if args.inside:
        batch = args.rows * 4 if args.inside == "sync" else args.rows
        sps, history = run(args.inside, x, y, batch, args.base, args.epochs, "inside-launch")
        print(f"bench-result {args.inside} {sps:.3f} {json.dumps(history.history.get('staleness'))}", flush=True)
        return
    if args.cluster == "processes":
        processes(args)
        return
    if args.node_loss:
        node_loss(x, y, args.rows)
        return
    print(
        f"jax {jax.__version__}, 4 workers on {jax.devices()[0].device_kind}, {os.cpu_count()} cpus; "
        f"{args.rows} rows per gradient, simulated {args.base * 1e3:.0f} ms per gradient, straggler "
        f"{3 * args.base * 1e3:.0f} ms"
    )
    print(f"transport: {args.cluster or 'threads on this host'}")
    sync_sps, _ = run("sync", x, y, args.rows * 4, args.base, args.epochs, args.cluster)
    async_sps, history = run("async", x, y, args.rows, args.base, args.epochs, args.cluster)
    print(f"  sync : {sync_sps:9.1f} samples/s")
    print(f"  async: {async_sps:9.1f} samples/s   async/sync = {async_sps / sync_sps:.2f} (target >= 2)")
    print(f"  async staleness per epoch: mean {history.history['staleness']}, max {history.history['max_staleness']}")
    if args.cluster == "ray":
        server_traffic(x, y)


def processes(args):
    """The straggler comparison on the process transport: one `meshfit launch --ps S --workers 4` job a mode."""
    print(
        f"jax {jax.__version__}, 4 worker processes, {os.cpu_count()} cpus; {args.rows} rows per gradient, "
        f"simulated {args.base * 1e3:.0f} ms per gradient, straggler {3 * args.base * 1e3:.0f} ms"
    )
    print(f"transport: processes (meshfit launch --ps {args.ps} --workers 4)")
    delays = {str(i): args.base for i in range(4)} | {"3": 3 * args.base}
    env = dict(os.environ, MESHFIT_PS_WORKER_DELAYS=json.dumps(delays))
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # 5+ processes on one GPU: none may reserve 75 % of it
    sps = {}
    for mode in ("sync", "async"):
        options = ["--base", str(args.base), "--rows", str(args.rows), "--steps", str(args.steps)]
        command = [sys.executable, "-m", "meshfit.cli", "launch", "--ps", str(args.ps), "--workers", "4", __file__]
        out = subprocess.run(
            command + [*options, "--epochs", str(args.epochs), "--inside", mode],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        found = re.search(rf"bench-result {mode} ([\d.]+) (.*)", out.stdout)
        if out.returncode or not found:
            raise RuntimeError(f"the {mode} job failed ({out.returncode}):\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
        sps[mode] = float(found.group(1))
        if mode == "async":
            staleness = found.group(2)
    print(f"  sync : {sps['sync']:9.1f} samples/s")
    print(f"  async: {sps['async']:9.1f} samples/s   async/sync = {sps['async'] / sps['sync']:.2f} (target >= 2)")
    print(f"  async staleness per epoch: mean {staleness}")


def node_loss(x, y, rows, delay=0.04, lose_at=20):
    """Removes one of two worker nodes at batch `lose_at` of an async, then a sync fit; prints the gaps."""
    import threading

    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "resources": {"ps_server": 4}})
    nodes = [cluster.add_node(num_cpus=0, resources={"ps_worker": 1}) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    print(f"Ray {ray.__version__}, local cluster: head (servers) + 2 worker nodes; {os.cpu_count()} cpus")
    try:
        for mode in ("async", "sync"):
            ends, lost = [], {}

            def lose(node, lost=lost):
                lost["at"] = time.monotonic()
                cluster.remove_node(node)
                lost["removed"] = time.monotonic()

            def on_batch_end(batch, logs, node=nodes[1], ends=ends, lose=lose):
                ends.append(time.monotonic())
                if len(ends) == lose_at:
                    threading.Thread(target=lose, args=(node,)).start()

            strategy = mf.strategies.ParameterServerStrategy(
                mode=mode,
                cluster="ray",
                num_workers=2,
                worker_delays={0: delay, 1: delay},
                worker_options={"num_cpus": 0, "resources": {"ps_worker": 1}},
                server_options={"num_cpus": 0, "resources": {"ps_server": 1}},
                worker_timeout=30,
            )
            with strategy.scope():
                model = mf.Model(MLP(nnx.Rngs(0)))
                model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
            batch = rows * 2 if mode == "sync" else rows
            steps = lose_at + 40
            model.fit(
                x[: steps * batch],
                y[: steps * batch],
                batch_size=batch,
                epochs=1,
                verbose=0,
                callbacks=[mf.callbacks.LambdaCallback(on_train_batch_end=on_batch_end)],
            )
            gaps = np.diff(ends)
            before = float(np.median(gaps[: lose_at - 1]))
            after = [t for t in ends if t > lost["at"]]
            longest = max(b - a for a, b in zip(ends[lose_at - 1 :], ends[lose_at:], strict=False))
            print(
                f"  {mode:5s}: usual interval {before * 1e3:.0f} ms; node removed "
                f"(cluster_utils.remove_node took {lost['removed'] - lost['at']:.2f} s); first gradient applied "
                f"{after[0] - lost['at']:.2f} s after the loss; longest wait after the loss "
                f"{longest:.2f} s; {len(ends)} batches, all applied"
            )
            nodes[1] = cluster.add_node(num_cpus=0, resources={"ps_worker": 1})  # two worker nodes again
            cluster.wait_for_nodes()
    finally:
        ray.shutdown()
        cluster.shutdown()


def server_traffic(x, y, steps=16, rows=32):
    """Gradient bytes each server actor received per applied gradient, for S = 1, 2, 4."""
    x, y = x[: steps * rows], y[: steps * rows] % 64
    print(f"bytes each server receives per gradient ({steps} async steps, 2 workers):")
    for servers in (1, 2, 4):
        strategy = strategy_for("async", "ray", {0: 0.0, 1: 0.0}, num_servers=servers)
        with strategy.scope():
            model = mf.Model(Wide(nnx.Rngs(0)))
            model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=rows, epochs=1, verbose=0)
        param_bytes = sum(a.nbytes for a in jax.tree.leaves(model.params))
        traffic = strategy.server_traffic()
        per_gradient = [t["bytes"] / t["gradients"] for t in traffic]
        print(
            f"  S={servers}: parameters {param_bytes / 1e6:.2f} MB, per gradient "
            + ", ".join(f"server {k} {b / 1e6:.3f} MB" for k, b in enumerate(per_gradient))
            + f" (parameter bytes / S = {param_bytes / servers / 1e6:.3f} MB)"
        )


if __name__ == "__main__":
    main()
