"""ParameterServerStrategy with worker processes under `meshfit launch --ps S --workers N`."""

import os
import re
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from processes import LAUNCH, Job, run

from meshfit.runtime.handshake import HANDSHAKE_TIMEOUT

pytestmark = [pytest.mark.slow, pytest.mark.processes]  # starts real processes (the fast tier leaves these out)

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples", "parameter_server.py")
WORKER = os.path.join(os.path.dirname(__file__), "..", "..", "workers", "train_ps.py")
EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples")
CONNECTED = r"\[rank (\d)\] parameter-server worker pid (\d+) connected"


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """`train_ps.py` and the digits split it trains on, saved once for the module: its server processes load
    the arrays instead of each importing scikit-learn."""
    import numpy as np

    sys.path.insert(0, EXAMPLES)
    from digits import load_data

    data = tmp_path_factory.mktemp("digits") / "digits.npz"
    np.savez(data, *load_data())
    return [WORKER, "--data", str(data)]


@pytest.fixture(scope="module")
def mirrored_reference(worker):
    """The weights and step count of the sync jobs' equivalent on one process: MirroredStrategy over 3 devices,
    3 epochs of batches of 64 without dropout, the learning rate halved at each epoch (`train_ps.halved`)."""
    import jax
    import numpy as np
    from flax import nnx

    import meshfit as mf

    sys.path.insert(0, os.path.dirname(WORKER))
    from digits import MLP
    from train_ps import halved

    with np.load(worker[2]) as saved:
        x_train, y_train = saved["arr_0"], saved["arr_2"]
    with mf.strategies.MirroredStrategy(jax.devices()[:3]).scope():
        module = MLP(64, 128, 10, rngs=nnx.Rngs(0))
        module.dropout.rate = 0.0
        model = mf.Model(module)
        model.compile(
            optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"]
        )
    model.fit(
        x_train, y_train, batch_size=64, epochs=3, verbose=0, callbacks=[mf.callbacks.LearningRateScheduler(halved)]
    )
    return [np.asarray(w) for w in model.get_weights()], int(model.optimizer.iterations)


def worker_pids(job: Job, count: int) -> dict[int, int]:
    return {int(m.group(1)): int(m.group(2)) for m in job.wait_for(CONNECTED, count)}


def test_a_killed_worker_is_dropped_and_training_finishes_with_accuracy():
    with Job(LAUNCH + ["--ps", "1", "--workers", "3", EXAMPLE, "--epochs", "20"], timeout=300) as job:
        workers = worker_pids(job, 3)
        job.wait_for(r"\[rank 0\] Epoch 4/20")
        os.kill(workers[2], signal.SIGKILL)  # mid-epoch
        assert job.finish() == 0, job.stdout[-3000:] + job.stderr[-3000:]
    out = job.stdout
    assert "[launch] worker rank 2 exited with status -9 (killed by SIGKILL); the job goes on without it." in job.stderr
    assert "its batch is redone elsewhere" in out
    assert "[rank 0] Epoch 20/20" in out  # all epochs ran
    accuracy = float(re.search(r"\[rank 0\] test accuracy: ([\d.]+)", out).group(1))
    assert accuracy >= 0.95, out[-2000:]


def test_a_stopped_worker_is_dropped_after_worker_timeout_and_training_finishes(tmp_path, worker):
    """A worker that hangs holding a batch (SIGSTOP: alive, connected, silent) must not stall the job."""
    with Job(
        LAUNCH
        + ["--ps", "1", "--workers", "2", "--stop-grace", "1"]  # the stopped worker is killed 1 s after the end
        + [*worker, str(tmp_path / "backup"), "--epochs", "6", "--worker-timeout", "6"],
        timeout=300,
    ) as job:
        workers = worker_pids(job, 2)
        job.wait_for(r"\[rank 0\] Epoch 2/6")
        os.kill(workers[1], signal.SIGSTOP)  # the launcher SIGKILLs it when the job ends
        assert job.finish() == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert re.search(
        r"worker pid \d+ lost \(no answer within worker_timeout=6 s\); its batch is redone elsewhere", job.stdout
    ), job.stdout[-3000:]
    summary = re.search(r"\[rank 0\] epochs 6 last 5 test accuracy: ([\d.]+)", job.stdout)
    assert summary and float(summary.group(1)) >= 0.9, job.stdout[-2000:]


@pytest.mark.parametrize("servers,die_rank", [(1, 0), (2, 1)])
def test_a_dead_parameter_server_fails_the_job_and_restarts_resume_from_the_backup(tmp_path, worker, servers, die_rank):
    """With 2 server processes (a partitioned state), the one that dies is rank 1, which only replays rank 0."""
    job = run(
        LAUNCH
        + [
            "--ps",
            str(servers),
            "--workers",
            "2",
            "--max-restarts",
            "1",
            "--stop-grace",  # with 2 servers, rank 0 waits on its dead peer: killed 1 s after the SIGTERM
            "1",
            *worker,
            str(tmp_path / "backup"),
            "--die-at-step",
            "75",
            "--die-rank",
            str(die_rank),
            "--epochs",
            "6",
        ],
        timeout=400,
    )
    out, err = job.stdout, job.stderr
    assert job.returncode == 0, out[-3000:] + err[-3000:]
    assert f"[launch] the parameter server (rank {die_rank}) exited with status -9 (killed by SIGKILL)" in err
    assert "[launch] restarting the job (1/1), " in err
    # Backups every 10 steps, written asynchronously: the one at step 70 may still have been in flight.
    assert re.search(r"\[rank 0\] BackupAndRestore: resumed .* \(step (60|70)\)", out), out[-2000:]
    summary = re.search(r"\[rank 0\] epochs (\d+) last (\d+) test accuracy: ([\d.]+)", out)
    assert summary and int(summary.group(2)) == 5  # all 6 epochs done, counting those before the crash
    assert float(summary.group(3)) >= 0.92  # 6 epochs of digits reach about 0.945 (chance: 0.1)
    layout = "P(None, 'ps') on 2 server devices of 2" if servers > 1 else "whole on 1 server devices of 1"
    assert f"[rank 0] hidden1/kernel {layout} process(es)" in out


@pytest.mark.parametrize("ps,devices", [(1, 1), (1, 2), (2, 1)])
def test_sync_mode_across_processes_equals_mirrored_even_when_a_worker_dies(
    tmp_path, worker, mirrored_reference, ps, devices
):
    """Each batch is split in 3 fixed parts; the killed worker's parts are redone, so the updates do not change.

    The learning rate is halved at each epoch: a change every server must make to its part of the state.

    The server state is partitioned over rank 0's two devices with `devices=2`, and over two server
    processes with `ps=2` (each holds half of `hidden1/kernel`). Without dropout: NNX modules carry
    their RNG state, so each part would draw the same masks, unlike one global batch.
    """
    import numpy as np
    from flax import nnx

    import meshfit as mf

    sys.path.insert(0, EXAMPLES)
    from digits import MLP

    weights = tmp_path / "ps.npz"
    with Job(
        LAUNCH
        + [
            "--ps",
            str(ps),
            "--workers",
            "3",
            "--devices-per-proc",
            str(devices),
            *worker,
            "none",
            "--mode",
            "sync",
            "--epochs",
            "3",
            "--weights",
            str(weights),
            "--dropout",
            "0",
            "--servers",
            str(devices),
            "--halve-lr",
            "--save",
            str(tmp_path / "saved"),
        ],
        timeout=300,
    ) as job:
        workers = worker_pids(job, 3)
        job.wait_for(r"\[rank 0\] Epoch 2/3")
        os.kill(workers[ps + 2], signal.SIGKILL)
        assert job.finish() == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert "its batch is redone elsewhere" in job.stdout
    partitioned = max(ps, devices)
    if partitioned > 1:
        for rank in range(ps):
            assert (
                f"[rank {rank}] hidden1/kernel P(None, 'ps') on 2 server devices of {ps} process(es)" in job.stdout
            ), job.stdout[-2000:]

    reference, iterations = mirrored_reference
    saved = np.load(weights)
    for i, expected in enumerate(reference):
        np.testing.assert_allclose(saved[f"arr_{i}"], expected, rtol=1e-4, atol=1e-6)
    # What the servers saved (each its part, through Orbax) loads whole on one device.
    if ps > 1:
        assert "[rank 1] rank 1 saved; its hidden1/kernel shards [(64, 64)]" in job.stdout, job.stdout[-2000:]
    loaded = mf.load_model(tmp_path / "saved", MLP(64, 128, 10, rngs=nnx.Rngs(1)))
    for i, array in enumerate(loaded.get_weights()):
        np.testing.assert_array_equal(array, saved[f"arr_{i}"])
    assert loaded.optimizer.iterations == iterations


def test_a_stopped_parameter_server_ends_the_job_naming_it(tmp_path, worker):
    """SIGSTOP on the server: its pings stop, the workers give up after --server-timeout, the launcher ends the job."""
    with Job(
        LAUNCH
        + [
            "--ps",
            "1",
            "--workers",
            "2",
            "--server-timeout",
            "8",
            "--heartbeat-timeout",
            "120",
            "--stop-grace",  # the stopped server cannot act on SIGTERM: it is killed after this
            "1",
            *worker,
            str(tmp_path / "backup"),
            "--epochs",
            "50",
        ],
        timeout=300,
    ) as job:
        workers = worker_pids(job, 2)
        job.wait_for(r"\[rank 0\] Epoch 2/50")
        (server,) = set(job.children()) - set(workers.values())
        os.kill(server, signal.SIGSTOP)
        stopped_at = time.monotonic()
        status = job.finish(timeout=90)  # fails the test (and kills the job) if it hangs
    assert time.monotonic() - stopped_at < 8 + 30
    assert status == 3, job.stderr[-2000:]
    assert re.search(
        r"\[rank [12]\] parameter-server worker pid \d+: the parameter server \(rank 0, which "
        r"coordinates the job, at 127\.0\.0\.1:\d+\) sent nothing for 8 s",
        job.stdout,
    ), job.stdout[-3000:]
    assert re.search(r"\[launch\] worker rank [12] found the parameter server silent", job.stderr), job.stderr[-2000:]


def test_strangers_at_every_port_neither_stop_nor_slow_the_job(tmp_path, worker):
    """Silent, garbage and unauthenticated connections (tests/hostile.py) to every port the job's processes
    listen on, from start-up to the end: the job gives the undisturbed run's weights, bitwise, and loses less
    time than two handshake timeouts. A listener that waited on a silent stranger would lose a whole timeout for
    each of the at least three silent connections per port. Sync mode without dropout, so that both runs compute
    the same updates.

    Two servers, so that every kind of listener is attacked: rank 0's for workers and servers (it coordinates
    the job), rank 1's for workers, and the servers' `jax.distributed` job; workers listen on nothing."""
    import numpy as np
    from hostile import Strangers

    servers = 2
    names = ("undisturbed", "disturbed")

    def train(weights, hostile):
        argv = LAUNCH + ["--ps", str(servers), "--workers", "2", *worker, "none", "--mode", "sync", "--dropout", "0"]
        began = time.monotonic()
        with Job(argv + ["--epochs", "2", "--weights", str(weights)], timeout=300) as job:
            if hostile:
                with Strangers(job.proc.pid, every=1.0) as strangers:
                    status = job.finish()
            else:
                status = job.finish()
        assert status == 0, job.stdout[-3000:] + job.stderr[-3000:]
        return time.monotonic() - began, strangers if hostile else None, job.stdout

    # Side by side: both jobs share the machine's load, so their times compare, and the test takes one job's time.
    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(train, tmp_path / f"{name}.npz", hostile=name == "disturbed") for name in names]
        (undisturbed, _, _), (disturbed, strangers, out) = (run.result() for run in runs)
    # One word from each server's listener (rank 0's for workers and servers, rank 1's for workers).
    assert out.count("ParameterServerStrategy: closed a connection to 127.0.0.1:") == servers, out[-3000:]
    assert len(strangers.ports) == servers, strangers.ports  # the servers listen; the workers do not
    listening = set().union(*strangers.ports.values())
    assert listening and all(count >= 3 * len(listening) for count in strangers.injected.values()), strangers.injected
    expected, got = np.load(tmp_path / "undisturbed.npz"), np.load(tmp_path / "disturbed.npz")
    for key in expected.files:
        np.testing.assert_array_equal(got[key], expected[key])
    assert disturbed - undisturbed < 2 * HANDSHAKE_TIMEOUT, (disturbed, undisturbed, strangers.injected)
