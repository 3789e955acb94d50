"""ParameterServerStrategy(cluster="ray") on a real three-node Ray cluster on this machine, token auth on.

The head node holds the server actors (resource `ps_server`); two nodes of
their own hold one worker actor each (resource `ps_worker`). Actors are real
processes: the tests kill them with SIGKILL and remove whole nodes.
"""

import os
import re
import secrets
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from helpers import MLP, assert_trees_close, classification_data
from ray_clusters import token_cluster

import meshfit as mf

ray = pytest.importorskip("ray")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples"))

pytestmark = [pytest.mark.slow, pytest.mark.processes]

WORKERS = {"num_cpus": 0, "resources": {"ps_worker": 1}}
SERVERS = {"num_cpus": 0, "resources": {"ps_server": 1}}


@pytest.fixture(scope="module")
def cluster():
    """Head (no CPUs, the servers' resource) and two worker nodes, with Ray token authentication on."""
    head = {"num_cpus": 0, "resources": {"ps_server": 4}}
    with token_cluster(head, [{"num_cpus": 0, "resources": {"ps_worker": 1}}] * 2) as (cluster, nodes):
        ray.init(address=cluster.address)
        try:
            yield cluster, nodes
        finally:
            ray.shutdown()


def ray_strategy(mode, servers=1, workers=2, **kwargs):
    return mf.strategies.ParameterServerStrategy(
        mode=mode,
        cluster="ray",
        num_workers=workers,
        num_servers=servers,
        worker_options=WORKERS,
        server_options=SERVERS,
        min_shard_size=16,
        **kwargs,
    )


def compiled(strategy, module):
    with strategy.scope():
        model = mf.Model(module)
        model.compile(
            optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"]
        )
    return model


class AtBatch(mf.callbacks.Callback):
    """Calls `action()` once, at batch `batch` of epoch `epoch`."""

    def __init__(self, epoch, batch, action):
        super().__init__()
        self.at, self.action, self.done = (epoch, batch), action, False
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if not self.done and (self.epoch, batch) == self.at:
            self.done = True
            self.action()


def logged_pids(text, kind):
    """{index: pid} of the actors of `kind` ("server", "worker") as the strategy logged their placement."""
    return {int(i): int(pid) for i, pid in re.findall(rf"{kind} (\d+) [^\n]*?pid (\d+)", text)}


# -- learning on two worker nodes, and losing one -----------------------------------------------


def digits_accuracy(strategy, callbacks=(), epochs=8):
    from digits import MLP as DigitsMLP
    from digits import load_data
    from flax import nnx

    x_train, x_test, y_train, y_test = load_data()
    model = compiled(strategy, DigitsMLP(64, 128, 10, rngs=nnx.Rngs(0)))
    history = model.fit(x_train, y_train, batch_size=64, epochs=epochs, verbose=0, callbacks=list(callbacks))
    return model.evaluate(x_test, y_test, verbose=0, return_dict=True)["accuracy"], history, model


def node_ids(text, kind):
    return re.findall(rf"{kind} \d+ \(node \S+ \((\w+)\)", text)


def test_async_on_two_worker_nodes_survives_losing_one_and_learns_as_the_thread_ps(cluster, capfd):
    """A worker node is removed mid-fit, a new one joins a few batches later, and the restarted worker
    takes batches there: every epoch completes, every batch is applied once, and the accuracy is the
    thread PS's (uninterrupted, two workers) within 0.03."""
    cluster_, nodes = cluster
    threads = mf.strategies.ParameterServerStrategy(workers=jax.devices()[:2], max_staleness=2)
    reference, _, _ = digits_accuracy(threads)
    joined = []

    def remove():
        cluster_.remove_node(nodes[1])

    def add():
        joined.append(cluster_.add_node(num_cpus=0, resources={"ps_worker": 1}))

    capfd.readouterr()
    started = time.monotonic()
    accuracy, history, model = digits_accuracy(
        # Workers a little slower than they are here (40 ms a batch), so that the fit outlasts Ray's restart.
        ray_strategy("async", servers=2, max_staleness=2, worker_timeout=30, worker_delays={0: 0.04, 1: 0.04}),
        callbacks=[AtBatch(1, 5, remove), AtBatch(1, 6, add)],
    )
    elapsed = time.monotonic() - started
    out = capfd.readouterr().err
    first_nodes = {n.node_id[:12] for n in nodes}
    nodes[1] = joined[0]  # the module's cluster has two worker nodes again
    placed = node_ids(out, "worker")
    assert set(placed[:2]) == first_nodes, out[-3000:]  # one worker on each non-head node, none on the head
    assert len(history.history["loss"]) == 8
    assert int(model.session.state.step) == 8 * 23
    losses = re.findall(r"worker \d+ \(node [^\n]*\) lost", out)
    assert len(losses) == 1, out[-3000:]
    assert joined[0].node_id[:12] in placed[2:], out[-3000:]  # the replacement joined, on the new node
    assert accuracy >= reference - 0.03, (accuracy, reference)
    print(f"fit with a node lost and one joined: {elapsed:.1f} s")


# -- sync mode: MirroredStrategy's updates, whatever happens to a worker ---------------------------


def sync_run(strategy, epochs=2, callbacks=()):
    x, y = classification_data(n=320)
    model = compiled(strategy, MLP(din=4, hidden=32, dout=3))
    history = model.fit(x, y, batch_size=16, epochs=epochs, verbose=0, callbacks=list(callbacks))
    return model, history


@pytest.fixture(scope="module")
def mirrored():
    return sync_run(mf.strategies.MirroredStrategy(jax.devices()[:2]))


UNINTERRUPTED = {}  # the sync run over two servers, for the resume test to compare with


class Kill(AtBatch):
    """SIGKILLs the process of actor `kind` `index` (its pid as the strategy logged it) at a batch."""

    def __init__(self, epoch, batch, capfd, kind, index):
        super().__init__(epoch, batch, self.kill)
        self.capfd, self.kind, self.index, self.out, self.killed_at = capfd, kind, index, "", None

    def kill(self):
        self.out += self.capfd.readouterr().err
        os.kill(logged_pids(self.out, self.kind)[self.index], signal.SIGKILL)
        self.killed_at = time.monotonic()


@pytest.mark.parametrize("servers", [1, 2])
def test_sync_equals_mirrored_even_when_a_worker_is_killed(cluster, mirrored, servers, capfd):
    mir_model, mir_history = mirrored
    kill = Kill(0, 4, capfd, "worker", 1)
    model, history = sync_run(ray_strategy("sync", servers=servers), callbacks=[kill] if servers == 2 else [])
    assert int(model.session.state.step) == int(mir_model.session.state.step) == 40
    assert_trees_close(mir_model.params, model.params, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(mir_history.history["loss"], history.history["loss"], rtol=1e-5)
    if servers == 2:
        out = kill.out + capfd.readouterr().err
        assert len(re.findall(r"worker 1 \(node [^\n]*\) lost", out)) == 1, out[-3000:]
        UNINTERRUPTED["params"] = model.params


# -- a lost server ---------------------------------------------------------------------------------


def test_a_lost_server_ends_fit_naming_it_and_a_rerun_resumes_bitwise(cluster, tmp_path, capfd):
    backup = str(tmp_path / "backup")
    kill = Kill(1, 3, capfd, "server", 1)
    with pytest.raises(RuntimeError, match=r"parameter server 1 \(node \S+ \(\w+\), pid \d+\) was lost") as error:
        sync_run(
            ray_strategy("sync", servers=2, server_timeout=20),
            callbacks=[kill, mf.callbacks.BackupAndRestore(backup, save_freq=5)],
        )
    assert time.monotonic() - kill.killed_at < 20, error.value
    assert "resume from BackupAndRestore" in str(error.value)
    assert os.listdir(backup)  # every backup kept

    model, history = sync_run(
        ray_strategy("sync", servers=2), callbacks=[mf.callbacks.BackupAndRestore(backup, save_freq=5)]
    )
    assert int(model.session.state.step) == 40
    uninterrupted = UNINTERRUPTED.get("params") or sync_run(ray_strategy("sync", servers=2))[0].params
    for resumed, expected in zip(jax.tree.leaves(model.params), jax.tree.leaves(uninterrupted), strict=True):
        np.testing.assert_array_equal(np.asarray(resumed), np.asarray(expected))


# -- the embedded default, and authentication ------------------------------------------------------

EMBEDDED = """
import time
started = time.monotonic()
import ray
import meshfit as mf
from helpers import MLP, classification_data

assert not ray.is_initialized()
strategy = mf.strategies.ParameterServerStrategy(mode="sync", cluster="ray", num_workers=2)
assert ray.is_initialized()
x, y = classification_data(n=64)
with strategy.scope():
    model = mf.Model(MLP(din=4, hidden=32, dout=3))
    model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
print("steps", int(model.session.state.step), "loss", history.history["loss"][-1])
print("trained in", round(time.monotonic() - started, 1), "s")
"""


def clean_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.dirname(__file__))), os.getcwd()])
    env["PYTHONPATH"] += os.pathsep + os.environ.get("PYTHONPATH", "")
    return env


def test_the_embedded_default_starts_ray_and_exits_cleanly(tmp_path):
    script = tmp_path / "embedded.py"
    script.write_text(EMBEDDED)
    env = {**clean_env(), "RAY_ADDRESS": "local"}  # a new local cluster, not the one this module runs
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stderr[-3000:]
    assert "steps 8" in result.stdout
    assert "Started a local Ray instance" in result.stderr
    assert elapsed < 120, elapsed  # it exits: nothing of Ray's keeps it waiting


def test_a_client_without_the_cluster_token_is_refused(cluster):
    cluster_, _ = cluster
    code = f"import ray; ray.init(address={cluster_.address!r}); print('connected')"
    env = {**clean_env(), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    env["RAY_gcs_rpc_server_connect_timeout_s"] = "3"
    env["RAY_gcs_server_port_wait_time_s"] = "2"  # the driver retries a refused connection for 20 s otherwise
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode != 0 and "connected" not in result.stdout
    assert "AuthenticationError" in result.stderr and "InvalidAuthToken" in result.stderr, result.stderr[-2000:]


def test_the_strategy_says_which_cluster_it_joined_and_warns_of_one_found_unnamed(cluster, caplog):
    from meshfit.strategies.parameter_server import ray_cluster

    cluster_, _ = cluster
    with caplog.at_level("INFO", logger="meshfit"):
        assert ray_cluster.connect(3) is False  # this process initialized Ray (the fixture): kept
    said = [r.getMessage() for r in caplog.records if r.name == "meshfit"]
    assert said == [
        f'ParameterServerStrategy(cluster="ray") runs on the Ray cluster at {cluster_.address} (3 nodes): '
        "initialized by this process before the strategy."
    ]
    # A process that did not initialize Ray, with no RAY_ADDRESS: ray.init() joins the cluster running here.
    code = "from meshfit.strategies.parameter_server import ray_cluster; print(ray_cluster.connect(3))"
    env = {**clean_env(), **{name: os.environ[name] for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0 and result.stdout.strip() == "True", result.stderr[-2000:]
    assert f"runs on the Ray cluster at {cluster_.address} (3 nodes): already running on this machine" in (
        result.stderr
    ), result.stderr[-2000:]
