"""`meshfit launch --ray`: the ranks as Ray actors on a real three-node Ray cluster on this machine, token auth on.

The head holds no CPUs; two nodes of one CPU each take one rank each (`--placement SPREAD`). The launcher is a
real process that joins the cluster by its address; the ranks are real processes of real actors.
"""

import os
import re
import signal
import sys
import time

import numpy as np
import pytest
from helpers import MLP, classification_data
from processes import Job, run
from ray_clusters import token_cluster

import meshfit as mf

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.slow, pytest.mark.processes]

WORKERS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "workers")


@pytest.fixture(scope="module")
def cluster():
    """A head without CPUs and two nodes of one CPU, with Ray token authentication on."""
    with token_cluster({"num_cpus": 0}, [{"num_cpus": 1}] * 2) as (cluster, _):
        yield cluster


@pytest.fixture
def address(cluster):
    return cluster.address


RESUMABLE = os.path.join(WORKERS, "train_resumable.py")
#: The memory-replica tests' job: 2 epochs, multi-worker, no disk backup within it.
RESUMABLE_ARGS = ["--strategy", "multi_worker", "--epochs", "2", "--save-freq", "1000", "--keep-backups"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The memory-replica tests' reference: their job run without a fault by `meshfit launch --nprocs 2` on
    this machine, started once for the module (in the background, beside the first test that asks) and
    awaited by each test that reads it. Returns a function giving the run's output directory."""
    base = tmp_path_factory.mktemp("uninterrupted")
    argv = [sys.executable, "-m", "meshfit.cli", "launch", "--nprocs", "2", RESUMABLE, str(base / "ref")]
    with Job(argv + [str(base / "refb"), *RESUMABLE_ARGS], timeout=300) as reference:

        def finished():
            assert reference.finish(timeout=240) == 0, reference.stderr[-3000:]
            return base / "ref"

        yield finished


def launch_ray(address, *args):
    return [sys.executable, "-m", "meshfit.cli", "launch", "--ray", address, "--placement", "SPREAD", *args]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone too
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def rank_pids(stderr: str) -> dict[int, int]:
    return {
        int(r): int(p)
        for r, p in re.findall(r"\[launch\] rank (\d) runs on node \S+ \(node id \w+\), pid (\d+)", stderr)
    }


def test_multi_worker_mirrored_on_ray_trains_as_one_device(address, tmp_path):
    result = run(
        launch_ray(
            address,
            "--nprocs",
            "2",
            "--devices-per-proc",
            "2",
            os.path.join(WORKERS, "train_data_parallel.py"),
            str(tmp_path),
        ),
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    nodes = re.findall(r"\[launch\] rank \d runs on node \S+ \(node id (\w+)\)", result.stderr)
    assert len(nodes) == 2 and nodes[0] != nodes[1], result.stderr  # SPREAD: a node each
    assert re.search(r"^\[rank 1\] pid \d+ rank 1 of 2 replicas 4", result.stdout, re.M), result.stdout
    assert re.search(r"^\[rank 0\] Epoch 2/2", result.stdout, re.M)

    x, y = classification_data(n=150)
    with mf.strategies.OneDeviceStrategy().scope():
        model = mf.Model(MLP(din=4, hidden=32, dout=3))
        model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=15, epochs=2, validation_split=0.2, verbose=0)
    saved = np.load(tmp_path / "params.npz")
    for i, weight in enumerate(model.get_weights()):
        np.testing.assert_allclose(saved[f"arr_{i}"], weight, rtol=1e-5, atol=1e-6)


def test_a_failed_rank_ends_the_job_naming_its_node_and_stops_the_others(address):
    start = time.monotonic()
    result = run(launch_ray(address, "--nprocs", "2", os.path.join(WORKERS, "exit_with.py"), "3"), timeout=120)
    assert result.returncode == 3, result.stderr[-3000:]
    assert time.monotonic() - start < 60  # rank 0 would sleep 120 s if not stopped
    assert re.search(
        r"\[launch\] rank 1 exited with status 3; stopping the other 1 process\(es\)\. "
        r"Rank 1 ran on node [\d.]+ \(node id \w+\), pid \d+\.",
        result.stderr,
    ), result.stderr
    assert re.search(r"^\[rank 0\] rank 0 of 2 at [\d.]+:\d+ ", result.stdout, re.M), result.stdout
    pids = rank_pids(result.stderr)
    assert len(pids) == 2 and not [pid for pid in pids.values() if alive(pid)], "a rank outlived the job"


def test_an_error_every_start_would_repeat_ends_a_ray_launch_at_once_naming_the_rank(address, tmp_path):
    """Ranks on Ray that raise before the first step (`memory_freq=0`): one start only whatever
    `--max-restarts`, and the launcher's last line names rank 0 and its error, as on one machine."""
    argv = [RESUMABLE, str(tmp_path / "out"), str(tmp_path / "backup"), "--strategy", "multi_worker"]
    result = run(launch_ray(address, "--nprocs", "2", "--max-restarts", "2", *argv, "--memory-freq", "0"), timeout=180)
    said = result.stdout[-2000:] + result.stderr[-3000:]
    assert result.returncode == 1, said
    assert "restarting the job" not in result.stderr, said
    last = result.stderr.strip().splitlines()[-1]
    assert re.match(r"\[launch\] job failed with status 1: rank [01] raised ValueError: `memory_freq` must", last), said


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # add_node forks the new node's processes
def test_a_rank_whose_node_is_lost_ends_the_job_naming_the_node(cluster):
    with Job(
        launch_ray(cluster.address, "--nprocs", "2", os.path.join(WORKERS, "exit_with.py"), "0"), timeout=120
    ) as job:
        job.wait_for(r"\[rank 0\] rank 0 of 2")
        placed = dict(re.findall(r"\[launch\] rank (\d) runs on node \S+ \(node id (\w+)\)", job.stderr))
        node = next(n for n in cluster.worker_nodes if n.node_id.startswith(placed["0"]))
        cluster.remove_node(node)
        lost_at = time.monotonic()
        assert job.finish(timeout=60) == 1, job.stderr[-3000:]
    took = time.monotonic() - lost_at
    cluster.add_node(num_cpus=1)  # two nodes again for the other tests
    cluster.wait_for_nodes()
    assert re.search(rf"\[launch\] rank 0's actor on node \S+ \(node id {placed['0']}\), pid \d+ died", job.stderr), (
        job.stderr
    )
    assert took < 30, took
    pids = rank_pids(job.stderr)
    assert len(pids) == 2 and not [pid for pid in pids.values() if alive(pid)], "a rank outlived the job"


def test_sigterm_to_the_launcher_reaches_every_rank_which_backs_up_and_exits_143(address, tmp_path):
    backup = tmp_path / "backup"
    with Job(
        launch_ray(
            address,
            "--nprocs",
            "2",
            "--grace-period",
            "60",
            os.path.join(WORKERS, "train_resumable.py"),
            str(tmp_path / "out"),
            str(backup),
            "--strategy",
            "multi_worker",
            "--slow",
            "0.03",
        ),
        timeout=240,
    ) as job:
        job.wait_for(r".*step 11$")
        job.proc.send_signal(signal.SIGTERM)
        assert job.finish(timeout=90) == 143, job.stderr[-3000:]
    assert "[launch] received SIGTERM: sending SIGTERM to every rank" in job.stderr
    for rank in (0, 1):
        assert re.search(rf"\[launch\] rank {rank} on node .* ended with status 143\.", job.stderr), job.stderr
    assert max(int(p) for p in os.listdir(backup) if p.isdigit()) >= 11  # the preemption backup
    pids = rank_pids(job.stderr)
    assert len(pids) == 2 and not [pid for pid in pids.values() if alive(pid)]


def test_without_ray_the_launcher_says_how_to_install_it():
    code = (
        "import sys; sys.modules['ray'] = None; from meshfit.cli import main; "
        f"sys.exit(main(['launch', '--ray', '--nprocs', '2', {os.path.join(WORKERS, 'exit_with.py')!r}, '0']))"
    )
    result = run([sys.executable, "-c", code], timeout=60)
    assert result.returncode == 2
    assert 'meshfit launch --ray needs Ray, which is not installed. Install it with `pip install "meshfit[ray]"`.' in (
        result.stderr
    ), result.stderr


def test_resources_per_proc_must_be_a_json_object_of_amounts():
    result = run(launch_ray("auto", "--nprocs", "2", "--resources-per-proc", "CPU=1", "x.py"), timeout=60)
    assert result.returncode == 2
    assert "--resources-per-proc expected a JSON object of Ray resources and amounts" in result.stderr
    assert "Received: 'CPU=1'." in result.stderr


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # add_node forks the new node's processes
def test_a_lost_node_resumes_from_the_memory_snapshots_replica_on_another_nodes_keeper(
    cluster, uninterrupted, tmp_path
):
    """Three nodes, a rank on each of two (the third free); memory_freq=5, no disk backup. Both ranks pause at
    step 12 (the snapshot of step 10 committed on both nodes' keepers); rank 0's node, its keeper with it, is
    removed. The restart agrees on step 10 from the surviving keeper, resumes from there and ends bitwise equal
    to an uninterrupted run of the same 2-process job."""
    go_on = tmp_path / "go_on"
    cluster.add_node(num_cpus=1)  # the free third node
    cluster.wait_for_nodes()
    with Job(
        launch_ray(cluster.address, "--nprocs", "2", "--max-restarts", "1", "--stop-grace", "1")
        + [RESUMABLE, str(tmp_path / "out"), str(tmp_path / "b"), *RESUMABLE_ARGS]
        + ["--memory-freq", "5", "--pause-at-step", "12", str(go_on)],
        timeout=300,
    ) as job:
        job.wait_for(r"\[rank \d\] paused at step 12", count=2)  # the step-10 snapshot committed
        placed = dict(re.findall(r"\[launch\] rank (\d) runs on node \S+ \(node id (\w+)\)", job.stderr))
        lost = next(n for n in cluster.worker_nodes if n.node_id.startswith(placed["0"]))
        cluster.remove_node(lost)
        go_on.touch()  # the restarted job passes step 12
        assert job.finish(timeout=240) == 0, job.stdout[-3000:] + job.stderr[-3000:]
    reference = uninterrupted()
    survivor = placed["1"]
    chosen = re.search(r"\[launch\] memory snapshots: \S+ resumes from step 10, .*\n", job.stderr)
    assert chosen and placed["0"] not in chosen[0] and chosen[0].count(f"node id {survivor}") == 2, job.stderr
    address = re.search(rf"rank 0's part on node id {survivor} \(([\d.]+:\d+)\)", chosen[0])[1]
    assert re.search(
        rf"\[rank 0\] BackupAndRestore: resumed from the launcher's memory snapshot held by the keeper at "
        rf"{re.escape(address)} \((this|another) node's\) at epoch 1, batch 10 \(step 10\)",
        job.stdout,
    ), job.stdout[-3000:]
    assert not [p for p in os.listdir(tmp_path / "b") if p.split(".")[0].isdigit()]  # no disk backup at all
    saved, expected = np.load(tmp_path / "out" / "weights.npz"), np.load(reference / "weights.npz")
    assert list(saved) == list(expected)
    for key in saved:
        np.testing.assert_array_equal(saved[key], expected[key])  # bitwise
    assert (tmp_path / "out" / "history.json").read_text() == (reference / "history.json").read_text()


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # add_node forks the new node's processes
def test_min_nprocs_restarts_on_the_nodes_left_with_fewer_ranks_from_the_memory_snapshots_replica(
    cluster, uninterrupted, tmp_path
):
    """--min-nprocs 1 on two nodes of one CPU; memory_freq=5, no disk backup. Both ranks pause at step 12 (the
    snapshot of step 10 committed on both keepers); rank 0's node is removed and none takes its place. The
    restart cannot place 2 ranks within --elastic-wait, names the node gone, runs 1 rank from the replica of
    the 2-process snapshot of step 10, and ends as the uninterrupted 2-process run does, to float tolerance:
    one process sums each batch's gradient in another order than two processes' all-reduce."""
    go_on = tmp_path / "go_on"
    try:
        with Job(
            launch_ray(cluster.address, "--nprocs", "2", "--min-nprocs", "1", "--elastic-wait", "2")
            + ["--max-restarts", "1", "--stop-grace", "1"]
            + [RESUMABLE, str(tmp_path / "out"), str(tmp_path / "b"), *RESUMABLE_ARGS]
            + ["--memory-freq", "5", "--pause-at-step", "12", str(go_on)],
            timeout=300,
        ) as job:
            job.wait_for(r"\[rank \d\] paused at step 12", count=2)  # the step-10 snapshot committed
            placed = re.findall(r"\[launch\] rank (\d) runs on node (\S+) \(node id (\w+)\)", job.stderr)
            ip, lost_id = next((ip, node) for rank, ip, node in placed if rank == "0")
            cluster.remove_node(next(n for n in cluster.worker_nodes if n.node_id.startswith(lost_id)))
            go_on.touch()  # the restarted job passes step 12
            assert job.finish(timeout=240) == 0, job.stdout[-3000:] + job.stderr[-3000:]
        reference = uninterrupted()
    finally:
        if len(cluster.worker_nodes) < 2:
            cluster.add_node(num_cpus=1)  # two nodes again for the other tests
            cluster.wait_for_nodes()
    assert (
        f"[launch] node {ip} (node id {lost_id}) is gone; restarting with 1 of 2 processes (--min-nprocs 1)."
        in job.stderr
    ), job.stderr[-3000:]
    assert re.search(r"\[launch\] memory snapshots: \S+ resumes from step 10, ", job.stderr), job.stderr[-3000:]
    assert re.search(
        r"^\[rank 0\] BackupAndRestore: resumed from the launcher's memory snapshot of a 2-process job "
        r"(held by the keeper at \S+ \(this node's\) )?at epoch 1, batch 10 \(step 10\)",
        job.stdout,
        re.M,
    ), job.stdout[-3000:]
    assert [rank for rank, _, _ in placed] == ["0", "1"] and [  # the restart ran one rank, on the node left
        rank for rank, _, node in re.findall(r"\[launch\] rank (\d) runs on node (\S+) \(node id (\w+)\)", job.stderr)
    ] == ["0", "1", "0"], job.stderr[-3000:]
    assert not [p for p in os.listdir(tmp_path / "b") if p.split(".")[0].isdigit()]  # no disk backup at all
    saved, expected = np.load(tmp_path / "out" / "weights.npz"), np.load(reference / "weights.npz")
    assert list(saved) == list(expected)
    for key in saved:
        np.testing.assert_allclose(saved[key], expected[key], rtol=1e-5, atol=1e-6)
