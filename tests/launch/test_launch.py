"""`meshfit launch`: real processes, output prefixes, failure propagation, a SIGKILLed worker."""

import os
import re
import signal
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from processes import Job, alive, run, without_suite_cache

from meshfit.launch import local as launch
from meshfit.runtime.job_layout import DistributedJob

pytestmark = [pytest.mark.slow, pytest.mark.processes]  # starts real processes (the fast tier leaves these out)

WORKERS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "workers")


def launch_cmd(*args):
    return [sys.executable, "-m", "meshfit.cli", "launch", *args]


def test_failure_of_one_process_stops_the_others_and_sets_the_status():
    start = time.monotonic()
    result = run(
        launch_cmd("--nprocs", "3", "--devices-per-proc", "2", os.path.join(WORKERS, "exit_with.py"), "3"), timeout=60
    )
    elapsed = time.monotonic() - start
    assert result.returncode == 3
    assert elapsed < 30  # rank 0 and 2 would sleep 120 s if not stopped
    assert "[launch] rank 1 exited with status 3; stopping the other 2 process(es)." in result.stderr
    for rank in range(3):
        assert re.search(
            rf"^\[rank {rank}\] rank {rank} of 3 at 127\.0\.0\.1:\d+ xla=.*device_count=2", result.stdout, re.M
        ), result.stdout


def kill_rank_one_while_training(out_dir, *launch_args):
    """Runs a 2-process job, SIGKILLs rank 1 once training is under way; returns (job, pids, seconds to the end,
    whether rank 0 was still alive when the launcher had ended)."""
    with Job(
        launch_cmd(
            "--nprocs",
            "2",
            "--devices-per-proc",
            "2",
            *launch_args,
            os.path.join(WORKERS, "train_data_parallel.py"),
            str(out_dir),
            "--hang",
        ),
        timeout=180,
    ) as job:
        pids = {int(m.group(1)): int(m.group(2)) for m in job.wait_for(r"\[rank (\d)\] pid (\d+) rank", count=2)}
        job.wait_for(r"\[rank 0\] epoch ", count=2)  # training is under way
        os.kill(pids[1], signal.SIGKILL)
        killed_at = time.monotonic()
        job.finish(timeout=60)
    took = time.monotonic() - killed_at
    try:
        os.kill(pids[0], 0)
        alive = True
    except ProcessLookupError:
        alive = False
    return job, pids, took, alive


@pytest.fixture(scope="module")
def rank_one_killed(tmp_path_factory):
    """Three 2-process jobs whose rank 1 is SIGKILLed mid-training: the two tests below check every one of them
    (each job takes ~12 s to start, train and end, so they share the runs rather than start their own).

    Rank 0, left waiting on its peer with JAX's preemption handler owning SIGTERM, does not end on the
    launcher's SIGTERM and is killed after the stop grace: the first job has the default 5 s, the others 1 s.
    """
    base = tmp_path_factory.mktemp("killed")
    with ThreadPoolExecutor(3) as pool:  # independent jobs, mostly waiting: side by side
        runs = [
            pool.submit(kill_rank_one_while_training, base / str(attempt), *(["--stop-grace", "1"] if attempt else []))
            for attempt in range(3)
        ]
        return [run.result() for run in runs]


def test_killed_worker_ends_the_job_with_a_clear_error_in_bounded_time(rank_one_killed):
    for job, _, took, rank_zero_alive in rank_one_killed:
        proc, err = job.proc, job.stderr
        assert took < 30
        assert proc.returncode == 128 + signal.SIGKILL
        assert "[launch] rank 1 exited with status -9 (killed by SIGKILL); stopping the other 1 process(es)." in err
        assert not rank_zero_alive, "rank 0 was left running"
        # Rank 0's broken collective is the peer's doing: one line at most, no traceback.
        assert "Traceback" not in job.stdout + err, err[-3000:]


def test_launch_requires_a_script():
    result = run(launch_cmd("--nprocs", "2"), timeout=60)
    assert result.returncode == 2
    assert "launch needs a script" in result.stderr


def test_parameter_server_job_gives_each_rank_its_role():
    from meshfit.launch.local import LaunchConfig, process_command, process_env
    from meshfit.runtime import cluster
    from meshfit.runtime.job_layout import JobStart
    from meshfit.strategies.parameter_server import launcher as ps

    start = JobStart(coordinator_port=1111, control_port=2222, heartbeat_timeout=10, authkey="ab")
    config = LaunchConfig(command=["train.py"], layout=ps.ParameterServerJob(servers=2, workers=3))
    envs = [process_env(config, rank, start, attempt=0, gpus=0) for rank in range(5)]
    assert [env[ps.ENV_PS_ROLE] for env in envs] == ["coordinator", "server", "worker", "worker", "worker"]
    assert all(
        env[ps.ENV_PS_ADDRESS] == "127.0.0.1:2222"
        and env[ps.ENV_PS_AUTHKEY] == "ab"
        and env[ps.ENV_PS_WORKERS] == "3"
        and env[ps.ENV_PS_SERVERS] == "2"
        for env in envs
    )
    # The servers form a jax.distributed job of their own; workers stay out of it.
    assert [
        (env[cluster.ENV_PROCESS_ID], env[cluster.ENV_NUM_PROCESSES], env[cluster.ENV_COORDINATOR]) for env in envs[:2]
    ] == [("0", "2", "127.0.0.1:1111"), ("1", "2", "127.0.0.1:1111")]
    assert [env[ps.ENV_PS_SERVER_RANK] for env in envs[:2]] == ["0", "1"]
    assert not any(cluster.ENV_COORDINATOR in env or ps.ENV_PS_SERVER_RANK in env for env in envs[2:])
    # Servers run the script; workers run the worker process, which needs nothing of it.
    commands = [process_command(config, rank)[1:] for rank in range(5)]
    assert commands == [["-u", "train.py"]] * 2 + [["-u", "-m", "meshfit.strategies.parameter_server.worker"]] * 3

    one_server = LaunchConfig(command=["train.py"], layout=ps.ParameterServerJob(servers=1, workers=2))
    envs = [process_env(one_server, rank, start, attempt=0, gpus=0) for rank in range(3)]
    assert not any(cluster.ENV_COORDINATOR in env for env in envs)  # one server: no jax.distributed at all
    assert [env[ps.ENV_PS_ROLE] for env in envs] == ["coordinator", "worker", "worker"]


def test_launch_rejects_a_parameter_server_job_without_servers_or_workers():
    for args in (["--ps", "2"], ["--ps", "0", "--workers", "2"], ["--ps", "1", "--workers", "2", "--nprocs", "3"]):
        result = run(launch_cmd(*args, "train.py"), timeout=60)
        assert result.returncode == 2, args
        assert "a parameter-server job takes --ps S --workers N (S, N >= 1) and no --nprocs" in result.stderr


def test_the_rank_that_died_first_is_blamed_not_the_one_that_aborted_after_it(rank_one_killed):
    """rank 1 is SIGKILLed; rank 0 then fails on losing its peer. The launcher names rank 1, three times of three."""
    assert len(rank_one_killed) == 3
    for job, _, _, _ in rank_one_killed:
        assert "[launch] rank 1 exited with status -9 (killed by SIGKILL); stopping the other 1" in job.stderr, (
            job.stderr[-2000:]
        )
        assert "[launch] rank 0 exited with status" not in job.stderr


def test_a_stopped_rank_ends_the_job_within_the_heartbeat_timeout():
    with Job(
        launch_cmd(
            "--nprocs",
            "2",
            "--heartbeat-timeout",
            "3",
            "--stop-grace",  # the stopped rank cannot act on SIGTERM: it is killed after this
            "1",
            os.path.join(WORKERS, "exit_with.py"),
            "0",
        ),
        timeout=120,
    ) as job:
        job.wait_for(r"\[rank 0\] rank 0 of 2")
        ranks = job.children()
        os.kill(ranks[0], signal.SIGSTOP)
        stopped_at = time.monotonic()
        status = job.finish(timeout=60)
    assert time.monotonic() - stopped_at < 20
    assert status == 1
    assert re.search(r"\[launch\] rank \d \(pid \d+\) is stopped \(SIGSTOP\?\) and has not run for 3 s", job.stderr)
    assert re.search(r"\[launch\] rank\(s\) \[\d\] did not end within the grace period and were killed", job.stderr)


def _gpu_machine_env(tmp_path, gpus: int, jax_platforms: str | None) -> dict:
    """The environment of a machine whose `nvidia-smi` lists `gpus` GPUs (a script first on PATH)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    listing = "".join(f"GPU {i}: NVIDIA H200 (UUID: GPU-{i})\\n" for i in range(gpus))
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\nprintf '{listing}'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    if jax_platforms is not None:
        env["JAX_PLATFORMS"] = jax_platforms
    return env


def test_devices_per_proc_splits_the_gpus_unless_jax_is_told_to_run_on_the_cpu(tmp_path):
    argv = launch_cmd("--nprocs", "2", "--devices-per-proc", "2", os.path.join(WORKERS, "exit_with.py"), "3")
    on_gpus = run(argv, timeout=60, env=_gpu_machine_env(tmp_path, 4, None))
    assert on_gpus.returncode == 3
    assert re.search(r"^\[rank 0\] rank 0 of 2 .* gpus=0,1$", on_gpus.stdout, re.M), on_gpus.stdout
    assert re.search(r"^\[rank 1\] rank 1 of 2 .* gpus=2,3$", on_gpus.stdout, re.M), on_gpus.stdout

    on_cpu = run(argv, timeout=60, env=_gpu_machine_env(tmp_path, 4, "cpu"))
    assert on_cpu.returncode == 3
    for rank in range(2):  # JAX_PLATFORMS=cpu: simulated host devices, the GPUs left alone
        assert re.search(rf"^\[rank {rank}\] .*device_count=2 gpus=-$", on_cpu.stdout, re.M), on_cpu.stdout


def test_more_gpus_asked_for_than_the_machine_has_is_refused_before_anything_starts(tmp_path):
    argv = launch_cmd("--nprocs", "3", "--devices-per-proc", "2", os.path.join(WORKERS, "exit_with.py"), "0")
    result = run(argv, timeout=60, env=_gpu_machine_env(tmp_path, 1, "cuda"))
    assert result.returncode == 2
    assert "--nprocs 3 x --devices-per-proc 2 needs 6 GPUs; nvidia-smi lists 1" in result.stderr
    assert "JAX_PLATFORMS=cpu" in result.stderr and "[rank" not in result.stdout


def test_gloo_connection_lines_are_dropped_unless_verbose():
    job = ("--nprocs", "2", "--devices-per-proc", "1", os.path.join(WORKERS, "allgather.py"))
    quiet, verbose = run(launch_cmd(*job), timeout=120), run(launch_cmd("--verbose", *job), timeout=120)
    for result in (quiet, verbose):
        assert result.returncode == 0, result.stderr[-2000:]
        assert sorted(re.findall(r"^\[rank (\d)\] gathered \[0, 1\]$", result.stdout, re.M)) == ["0", "1"]
    assert "Gloo" not in quiet.stdout + quiet.stderr
    connected = re.findall(r"^\[rank (\d)\] \[Gloo\] Rank \d is connected to 1 peer ranks", verbose.stdout, re.M)
    assert sorted(connected) == ["0", "1"], verbose.stdout


def test_launch_help_shows_the_defaults():
    result = run(launch_cmd("--help"), timeout=60)
    assert "(default: 60.0)" in result.stdout and "--grace-period" in result.stdout


def test_version():
    import meshfit

    result = run([sys.executable, "-m", "meshfit.cli", "--version"], timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == f"meshfit {meshfit.__version__}"


def test_the_coordinator_port_is_free_and_outside_the_range_outgoing_connections_take_ports_from():
    """A port from `bind(0)` can be taken by any outgoing connection before process 0 binds it."""
    low, high = launch._ephemeral_range()
    ports = {launch.free_port() for _ in range(20)}
    assert all(1024 <= port < low for port in ports), (sorted(ports), low, high)
    assert len(ports) > 1  # picked at random: two jobs started together do not race for one port
    for port in ports:
        with socket.create_server(("", port)):
            pass


@pytest.mark.parametrize("ctrl_c", [False, True], ids=["sigint-to-the-launcher", "ctrl-c-to-the-process-group"])
def test_sigint_to_the_launcher_ends_a_training_job_with_130(tmp_path, ctrl_c):
    """`kill -INT` of the launcher: each rank gets SIGTERM, the ranks agree on a step, save it and exit 143; the
    launcher exits 130. Ctrl-C at a terminal signals the whole process group: each rank also gets the SIGINT
    itself and ends unsaved (KeyboardInterrupt, or 130 from its bound if its exit waits for a peer). A rank whose
    exit blocks in C holding the GIL (seen under load, after the KeyboardInterrupt) cannot run its bound: the
    launcher's grace period ends it, so the job still ends within a bound."""
    backup = tmp_path / "backup"
    argv = launch_cmd("--nprocs", "2", "--devices-per-proc", "2", *(["--grace-period", "8"] if ctrl_c else []))
    argv += [os.path.join(WORKERS, "train_resumable.py"), str(tmp_path / "out"), str(backup)]
    argv += ["--strategy", "multi_worker", "--slow", "0.05"] + (["--preemption-timeout", "3"] if ctrl_c else [])
    with Job(argv, timeout=120) as job:
        pids = {int(m[1]): int(m[2]) for m in job.wait_for(r"\[rank (\d)\] pid (\d+) fitting", count=2)}
        job.wait_for(r"\[rank 0\] step 5$")
        sent = time.monotonic()
        if ctrl_c:
            os.killpg(job.proc.pid, signal.SIGINT)
        else:
            job.proc.send_signal(signal.SIGINT)
        status = job.finish(timeout=90)
        took = time.monotonic() - sent
    assert status == 130, job.stderr[-3000:]
    err = job.stderr
    assert "[launch] received SIGINT: sending SIGTERM to every rank" in err and "[launch] stopped by SIGINT." in err
    assert ctrl_c or "did not end within the grace period" not in err, err
    assert not [pid for pid in pids.values() if alive(pid)], "a rank outlived the launcher"
    steps = sorted(int(p) for p in os.listdir(backup) if p.isdigit())
    if ctrl_c:
        assert took < 8 + 5, took  # each rank's bound (3 s), at worst the launcher's grace period (8 s)
        for rank in range(2):
            ended = (
                rf"^\[launch\] rank {rank} ended with status (-2 \(killed by SIGINT\)|130|-9 \(killed by SIGKILL\))\.$"
            )
            assert re.search(ended, err, re.M), err
        assert steps and steps[-1] % 3 == 0  # the periodic backups only
    else:
        for rank in range(2):
            assert f"[launch] rank {rank} ended with status 143." in err, err
        synced = {int(s) for s in re.findall(r"Reached preemption sync point, step=(\d+)", job.stdout)}
        assert len(synced) == 1 and steps[-1] == synced.pop(), (steps, job.stdout[-3000:])  # the preemption backup


def elastic(tmp_path, nprocs: int, min_nprocs: int, *bad: str):
    """A job of `nprocs` processes of 2 (listed) GPUs each whose processes on the GPU sets `bad` fail."""
    argv = launch_cmd("--nprocs", str(nprocs), "--devices-per-proc", "2", "--min-nprocs", str(min_nprocs))
    argv += ["--max-restarts", "3", os.path.join(WORKERS, "bad_slot.py"), *bad]
    return run(argv, timeout=60, env=_gpu_machine_env(tmp_path, 2 * nprocs, None))


def test_min_nprocs_restarts_without_a_rank_that_fails_at_once_in_a_restart_on_the_devices_left(tmp_path):
    """3 processes; the one on GPUs 2,3 fails in the first start (a restart as usual) and at once in the
    restart: the job restarts on 2 processes, on GPUs 0,1 and 4,5, and succeeds."""
    result = elastic(tmp_path, 3, 2, "2,3")
    assert result.returncode == 0, result.stderr
    assert re.search(r"rank 1 \(slot 1\) failed \d+\.\d s after it was restarted \(within 20 s\)", result.stderr)
    assert "it cannot be restarted; restarting the job with 2 process(es) (--min-nprocs 2)" in result.stderr
    assert result.stderr.count("restarting the job (") == 2  # after the first failure, then after the one at start
    assert "[rank 0] start 2: rank 0 of 2 gpus=0,1" in result.stdout
    assert "[rank 1] start 2: rank 1 of 2 gpus=4,5" in result.stdout


def test_min_nprocs_is_a_floor_the_job_does_not_shrink_below(tmp_path):
    result = elastic(tmp_path, 3, 2, "2,3", "4,5")
    assert result.returncode == 3
    assert result.stderr.count("it cannot be restarted; restarting the job with 2 process(es)") == 1
    assert "the job cannot shrink below --min-nprocs 2: restarting it with 2 process(es)" in result.stderr


@pytest.mark.parametrize(
    "args, expected",
    [
        (("--nprocs", "2", "--min-nprocs", "3"), "--min-nprocs must be between 1 and --nprocs (2). Received: 3."),
        (("--nprocs", "2", "--min-nprocs", "0"), "--min-nprocs must be between 1 and --nprocs (2). Received: 0."),
        (("--ps", "1", "--workers", "2", "--min-nprocs", "2"), "--min-nprocs needs a `meshfit launch --nprocs N` job"),
        (("--ray", "auto", "--nprocs", "2", "--min-nprocs", "3"), "--min-nprocs must be between 1 and --nprocs (2)."),
        (("--ray", "auto", "--nprocs", "2", "--min-nprocs", "1", "--elastic-wait", "0"), "--elastic-wait expected a"),
    ],
)
def test_min_nprocs_that_cannot_apply_is_refused_before_anything_starts(args, expected):
    result = run(launch_cmd(*args, os.path.join(WORKERS, "exit_with.py"), "0"), timeout=60)
    assert result.returncode == 2 and expected in result.stderr and "[rank" not in result.stdout


@pytest.mark.parametrize("restarts", ["-1", "-5"])
def test_a_negative_max_restarts_is_refused_before_anything_starts(restarts):
    argv = launch_cmd("--nprocs", "2", "--max-restarts", restarts, os.path.join(WORKERS, "exit_with.py"), "0")
    result = run(argv, timeout=60)
    expected = (
        f"--max-restarts expected a whole number of restarts, 0 or more (0: never restart). Received: {restarts}."
    )
    assert result.returncode == 2 and expected in result.stderr and "[rank" not in result.stdout


@pytest.mark.parametrize("restarts", [-1, True, 1.5])
def test_launch_refuses_max_restarts_that_is_not_a_whole_number_of_0_or_more(restarts):
    config = launch.LaunchConfig(["-c", "pass"], DistributedJob(1), max_restarts=restarts)
    with pytest.raises(ValueError, match=rf"--max-restarts expected .* Received: {restarts!r}\."):
        launch.launch(config)


RESUMABLE = os.path.join(WORKERS, "train_resumable.py")


@pytest.mark.slow
@pytest.mark.parametrize(
    "backup, args, error",
    [
        ("/proc/not-writable", [], "CheckpointWriteError"),
        (None, ["--memory-freq", "0"], "ValueError: `memory_freq` must be a positive int"),
        (None, ["--memory-freq", "5", "--memory-replicas", "5"], "ValueError: `memory_replicas=5` needs a keeper"),
    ],
    ids=["unwritable backup directory", "memory_freq=0", "memory_replicas=5 on one node"],
)
def test_an_error_every_start_would_repeat_ends_the_launch_at_once_naming_the_rank(tmp_path, backup, args, error):
    """Ranks that raise before the job's first step (a configuration mistake): one start only, whatever
    `--max-restarts`, a non-zero exit within 30 s, and the launcher's last lines naming rank 0 and its error
    (not the rank that died waiting for it)."""
    began = time.monotonic()
    argv = [RESUMABLE, str(tmp_path / "out"), backup or str(tmp_path / "backup"), "--strategy", "multi_worker"]
    result = run(launch_cmd("--nprocs", "2", "--max-restarts", "2", *argv, *args), timeout=120)
    took = time.monotonic() - began
    said = result.stdout[-2000:] + result.stderr[-3000:]
    assert result.returncode != 0 and took < 30, (took, said)
    assert "restarting the job" not in result.stderr, said
    last = result.stderr.strip().splitlines()[-1]
    assert re.match(rf"\[launch\] job failed with status 1: rank 0 raised {re.escape(error)}", last), said


@pytest.mark.slow
def test_an_exception_after_the_first_step_still_restarts_forked_from_the_fork_server(tmp_path):
    """An error once training ran is not one every start would repeat: the launcher restarts as asked, each
    rank forked from the launch's fork server with the libraries imported, and the restart (which does not
    raise) finishes the job."""
    # One epoch (10 steps): the restart resumes from the backup of step 3 and trains to the end of it.
    argv = [RESUMABLE, str(tmp_path / "out"), str(tmp_path / "backup"), "--strategy", "multi_worker", "--epochs", "1"]
    launch_args = ("--nprocs", "2", "--max-restarts", "1", "--verbose")
    result = run(launch_cmd(*launch_args, *argv, "--raise-at-step", "5"), timeout=180)
    restarted = re.search(r"restarting the job \(1/1\), [\d.]+ s after rank [01] ended\.", result.stderr)
    assert restarted, result.stderr[-3000:]
    assert result.returncode == 0, result.stderr[-3000:]
    # Under --verbose each rank of each start says where its start's seconds went, up to its first step: the
    # imports were the fork server's, before the fork (0.00 s).
    phases = r"reached its first step [\d.]+ s after it was forked from the launch's fork server: "
    phases += r"interpreter and imports 0.00 s, "
    phases += r"JAX and jax.distributed [\d.]+ s, the script until fit [\d.]+ s, fit's setup and the restore [\d.]+ s, "
    phases += r"compile [\d.]+ s, first step [\d.]+ s\."
    for start in (0, 1):
        said = re.findall(rf"^\[rank (\d)\] meshfit: start {start} {phases}$", result.stdout + result.stderr, re.M)
        assert sorted(said) == ["0", "1"], result.stderr[-3000:]
    assert "starts as a new process" not in result.stderr


def test_the_ranks_share_a_private_compilation_cache_for_the_launch(tmp_path):
    """Every rank of a launch caches its programs in one 0700 directory of the launcher's (what a start compiles
    before its fit loads in the next), which JAX turns on at import and which is gone when the launch ends."""
    script = tmp_path / "cache.py"
    script.write_text(
        "import os, stat, jax\n"
        "path = jax.config.jax_compilation_cache_dir\n"
        "mode = stat.S_IMODE(os.stat(path).st_mode)\n"
        "jax.jit(lambda a: a * 3.5)(jax.numpy.ones(3)).block_until_ready()\n"
        "print('cache', path, oct(mode), len(os.listdir(path)) > 0, flush=True)\n"
    )
    result = run(launch_cmd("--nprocs", "2", str(script)), timeout=120, env=without_suite_cache(dict(os.environ)))
    assert result.returncode == 0, result.stderr[-3000:]
    said = re.findall(r"^\[rank \d\] cache (\S+) 0o700 True$", result.stdout, re.M)
    assert len(said) == 2 and said[0] == said[1], result.stdout
    assert not os.path.exists(said[0])
