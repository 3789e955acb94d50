"""Injects the faults a training job meets and counts what happened: exact resumes, data lost, hangs.

Every fault is real: processes are killed with SIGKILL or SIGTERM, files Orbax
wrote are altered, a different model loads the backups, a second job writes into
the same directory, a backup directory is made read-only, a parameter server is
stopped with SIGSTOP, a callback hangs and SIGTERM must still end the process
(or, sent to `meshfit launch`, every rank of a job one of whose ranks hangs)
within its bound, symlinks to files outside are planted at the names meshfit
writes in a model, checkpoint or backup directory (with the pid of the process
 about to write there), a saved model's compile settings are garbled, a rerun's labels are out of
 range, another user (uid 65534, as root) owns or opens the backup directory, plants compiled
 programs or a FIFO in its compilation cache, or replaces Goodput's record, a rank is SIGKILLed with the
 memory tier on or while it sends a snapshot, a Ray node holding a rank and its snapshot keeper is removed
 (the replica on another node's keeper must be used), strangers connect to the launcher's keeper, a keeper is
 stopped (SIGSTOP), another user floods every keeper socket and port during a restart, a restart compiled with
 another learning rate meets the first job's snapshot, one rank's keeper is unreachable at a restart, malformed
 snapshot parts are fed to the restore, a read-only backup directory sits beside a newer memory snapshot, and
 another user owns the backup directory's parent (and plants a link in its place). Most trials
run the resumable worker of the test suite (`tests/workers/train_resumable.py`: an MLP with dropout, EarlyStopping,
ReduceLROnPlateau and BackupAndRestore) and compares the final weights and History
bitwise with an uninterrupted run.

    python benchmarks/fault_injection.py [--kills 20] [--seed 0] [--only "hostile directory"]

Columns: injected (trials), exact (resumed run bitwise equal to the
uninterrupted one, where the fault allows a resume), outside written (a file
outside the directory written, or anything written by a load: must be 0, where
the fault could cause it), data lost (a complete backup deleted or altered, or a
directory changed by a refused load: must be 0), hangs (a process that did not
end within its bound: must be 0). The script exits with an error when any of
those is not as it must be (`--smoke`, one SIGKILL trial, runs in the test suite).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(HERE, "..", "tests")
sys.path.insert(0, TESTS)

import numpy as np  # noqa: E402
from helpers import meshfit_names, plant_symlinks, read_all  # noqa: E402
from processes import LAUNCH, Job  # noqa: E402
from smoke import parse_args  # noqa: E402

from meshfit.checkpointing.checkpoint import MARKER  # noqa: E402

WORKER = os.path.join(TESTS, "workers", "train_resumable.py")
PS_WORKER = os.path.join(TESTS, "workers", "train_ps.py")
STEPS = 40  # the worker's run: 4 epochs of 10 batches, a backup every 3 steps
BOUND = 180.0  # seconds any one process may take before it counts as a hang
#: Writes into (or reads) one directory as `kind` says: `model.save`, `save_weights`, a fit with
#: ModelCheckpoint or BackupAndRestore, or `load_model` ("load").
FILES = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[3])
    import meshfit as mf
    from helpers import MLP, classification_data
    kind, path = sys.argv[1:3]
    if kind == "load":
        mf.load_model(path, MLP())
        sys.exit(0)
    x, y = classification_data(n=64)
    model = mf.Model(MLP(), seed=7)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    savers = {"checkpoint": mf.callbacks.ModelCheckpoint(path), "backup": mf.callbacks.BackupAndRestore(path)}
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[savers[kind]] if kind in savers else [])
    if kind == "model":
        model.save(path)
    elif kind == "weights":
        model.save_weights(path)
""")


class Hang(Exception):
    pass


def worker(out, backup, *args, stop_at=None, sig=signal.SIGKILL, repeat_signal=False):
    """Runs the worker; with `stop_at`, sends `sig` when it prints that step. Returns (status, output)."""
    with Job([sys.executable, WORKER, str(out), str(backup), *args], timeout=BOUND) as job:
        try:
            if stop_at is not None:
                job.wait_for(rf"step {stop_at}$")
                job.proc.send_signal(sig)
                while repeat_signal and job.proc.poll() is None:
                    time.sleep(0.05)
                    try:
                        job.proc.send_signal(sig)
                    except ProcessLookupError:
                        break
            status = job.finish()
        except AssertionError as error:
            raise Hang(str(error)[:300]) from None
    return status, job.stdout + job.stderr


def result(out):
    weights = np.load(os.path.join(out, "weights.npz"))
    with open(os.path.join(out, "history.json")) as f:
        return [weights[k] for k in sorted(weights.files, key=lambda k: int(k.split("_")[1]))], f.read()


def same(a, b) -> bool:
    (wa, ha), (wb, hb) = result(a), result(b)
    return ha == hb and len(wa) == len(wb) and all(np.array_equal(x, y) for x, y in zip(wa, wb, strict=True))


def snapshot(directory) -> dict[str, str]:
    found = {}
    for root, _, files in os.walk(directory):
        for name in files:
            if name != ".meshfit.lock":
                with open(os.path.join(root, name), "rb") as f:
                    found[os.path.relpath(os.path.join(root, name), directory)] = hashlib.sha256(f.read()).hexdigest()
    return found


def steps_in(backup) -> list[int]:
    return sorted(int(p) for p in os.listdir(backup) if p.isdigit()) if os.path.isdir(backup) else []


LAUNCH_FAULT = "SIGTERM to `meshfit launch` (2 ranks)"
MEMORY_FAULT = "SIGKILL of a rank, memory tier on (2 ranks)"


def memory_sigkill(base, reference_two, step):
    """Rank 1 SIGKILLs itself at `step` with snapshots every 5 steps and no disk backup: the restart must resume
    from the newest committed snapshot (the newest multiple of 5 below `step`, or the one before when the kill
    came while that one was in flight) and end as the uninterrupted job."""
    out, backup = base / "out", base / "backup"
    argv = LAUNCH + ["--nprocs", "2", "--devices-per-proc", "2", "--max-restarts", "1", "--stop-grace", "1"]
    argv += [WORKER, str(out), str(backup), "--strategy", "multi_worker", "--save-freq", "1000"]
    argv += ["--memory-freq", "5", "--die-at-step", str(step)]
    with Job(argv, timeout=2 * BOUND) as job:
        try:
            status = job.finish()
        except AssertionError as error:
            raise Hang(str(error)[:300]) from None
    said = re.search(r"BackupAndRestore: resumed from the launcher's memory snapshot at .*? \(step (\d+)\)", job.stdout)
    # The newest snapshot taken before the kill (the rank dies before its callback at `step` runs), or the one
    # before it when the kill came while the newest was still in flight: none (a start from scratch) when that
    # was the first.
    newest = (step - 1) // 5 * 5
    resumed = (int(said.group(1)) if said else 0) in (newest, newest - 5)
    exact = status == 0 and resumed and same(out, reference_two)
    if not exact:  # what went wrong, for the record: the exit status, the resume, the job's last words
        print(f"  killed at step {step}: exit {status}, {said.group(0) if said else 'no memory resume'}", flush=True)
        print(textwrap.indent((job.stdout + job.stderr)[-3000:], "    | "), flush=True)
    return exact, status != 0 or not resumed


RAY_FAULT = "lost Ray node holding a keeper, memory tier on (2 ranks)"
KEEPER_STOPPED = "keeper stopped (SIGSTOP) mid-fit, memory tier on"
FLOODED_RESTART = "SIGKILL of a rank, another user at the keeper and strangers at every port (2 ranks)"
ANOTHER_JOB = "restart compiled with another learning rate, memory tier on (2 ranks)"
READ_ONLY_NEWER = "backup directory read-only, a newer memory snapshot held"
FETCH_FAILS = "one rank's keeper unreachable at the restart, the other's not (2 ranks)"


def ray_node_lost(base, reference_two):
    """A Ray cluster of three nodes (token auth), a rank on each of two; both pause at step 12 (the snapshot of
    step 10 committed on both keepers) and rank 0's node, its keeper with it, is removed: the restart must
    resume at step 10 from the replica on the node left and end as the uninterrupted job."""
    from ray_clusters import token_cluster

    out, backup, go_on = base / "out", base / "backup", base / "go_on"
    with token_cluster({"num_cpus": 0}, [{"num_cpus": 1}] * 3) as (cluster, _):
        argv = LAUNCH + ["--ray", cluster.address, "--placement", "SPREAD", "--nprocs", "2", "--devices-per-proc", "2"]
        argv += ["--max-restarts", "1", "--stop-grace", "1", WORKER, str(out), str(backup), "--strategy"]
        argv += ["multi_worker", "--save-freq", "1000", "--memory-freq", "5", "--pause-at-step", "12", str(go_on)]
        with Job(argv, timeout=2 * BOUND) as job:
            try:
                job.wait_for(r"\[rank \d\] paused at step 12", count=2)
                time.sleep(2)  # the snapshot of step 10, sent behind steps 11 and 12, is committed
                placed = dict(re.findall(r"\[launch\] rank (\d) runs on node \S+ \(node id (\w+)\)", job.stderr))
                cluster.remove_node(next(n for n in cluster.worker_nodes if n.node_id.startswith(placed["0"])))
                go_on.touch()
                status = job.finish()
            except AssertionError as error:
                raise Hang(str(error)[:300]) from None
    held = r"memory snapshot held by the keeper at \S+ \((?:this|another) node's\) at .*? \(step (\d+)\)"
    said = re.search(held, job.stdout)
    resumed = said is not None and int(said.group(1)) == 10
    exact = status == 0 and resumed and same(out, reference_two)
    if not exact:
        print(f"  node lost: exit {status}, {said.group(0) if said else 'no memory resume'}", flush=True)
        print(textwrap.indent((job.stdout + job.stderr)[-3000:], "    | "), flush=True)
    return exact, status != 0 or not resumed


KILLED_MID_SNAPSHOT = textwrap.dedent("""
    import os, signal, sys
    from meshfit.runtime import keeper_protocol as protocol
    conn = protocol.connect(sys.argv[1], bytes.fromhex(sys.argv[2]))
    payload = os.urandom(1 << 20)
    protocol.send_json(conn, {"op": "put", "fit": "f", "rank": 1, "world": 2, "step": 10, "start": 0,
                              "size": len(payload), "digest": protocol.digest(payload)})
    assert protocol.recv_json(conn)["ok"]
    protocol.send_payload(conn, payload[: len(payload) // 2])
    os.kill(os.getpid(), signal.SIGKILL)
""")


def killed_mid_snapshot(base):
    """A launcher's keeper holds step 5 of 2 ranks; rank 0 sends step 10 and rank 1 is SIGKILLed half-way
    through its part: both ranks must be handed step 5, whole."""
    import io

    from meshfit.launch.keeper import Keeper
    from meshfit.runtime import keeper_protocol as protocol

    keeper = Keeper(io.StringIO())
    try:
        ranks = [protocol.connect(keeper.address, keeper.key) for _ in range(2)]

        def put(rank, step, payload):
            header = {"fit": "f", "rank": rank, "world": 2, "step": step, "start": 0, "size": len(payload)}
            protocol.send_json(ranks[rank], {"op": "put", **header, "digest": protocol.digest(payload)})
            protocol.recv_json(ranks[rank])
            protocol.send_payload(ranks[rank], payload)
            protocol.recv_json(ranks[rank])

        put(0, 5, b"0" * 4096)
        put(1, 5, b"1" * 4096)
        put(0, 10, b"0" * 4096)
        env = dict(os.environ, PYTHONPATH=os.path.join(HERE, ".."))
        child = subprocess.run(
            [sys.executable, "-c", KILLED_MID_SNAPSHOT, keeper.address, keeper.key.hex()], env=env, timeout=BOUND
        )
        time.sleep(0.2)
        got = []
        for rank in (0, 1):
            protocol.send_json(ranks[rank], {"op": "latest", "fit": "f", "rank": rank, "world": 2, "step": 1 << 62})
            reply = protocol.recv_json(ranks[rank])
            got.append((reply["step"], protocol.recv_payload(ranks[rank], reply["size"]) if reply["step"] else b""))
        exact = child.returncode == -signal.SIGKILL and got == [(5, b"0" * 4096), (5, b"1" * 4096)]
        if not exact:
            handed = [step for step, _ in got]
            print(f"  killed mid-snapshot: child exit {child.returncode}, handed steps {handed}", flush=True)
        return exact, got[0][0] != 5
    finally:
        keeper.close()


class Tally:
    def __init__(self, only: str = ""):
        self.rows: dict[str, list[int]] = {}
        self.only = only  # runs only the faults whose name holds this

    def add(self, fault: str, exact: bool | None, lost: bool, hung: bool, outside: bool | None = None) -> None:
        # injected, exact, exact-applicable, lost, hangs, outside written, outside-applicable
        row = self.rows.setdefault(fault, [0, 0, 0, 0, 0, 0, 0])
        row[0] += 1
        if exact is not None:
            row[2] += 1
            row[1] += int(exact)
        row[3] += int(lost)
        row[4] += int(hung)
        if outside is not None:
            row[6] += 1
            row[5] += int(outside)
        print(f"  {fault}: exact={exact} outside={outside} lost={lost} hung={hung}", flush=True)

    def table(self) -> str:
        lines = [
            "| fault | injected | runs exact | outside written | data lost | hangs |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for fault, (n, exact, applicable, lost, hung, outside, checked) in self.rows.items():
            exact_cell = f"{exact} of {applicable}" if applicable else "n/a"
            outside_cell = f"{outside} of {checked}" if checked else "n/a"
            lines.append(f"| {fault} | {n} | {exact_cell} | {outside_cell} | {lost} | {hung} |")
        total = [sum(r[i] for r in self.rows.values()) for i in range(7)]
        lines.append(
            f"| **all** | {total[0]} | {total[1]} of {total[2]} | {total[5]} of {total[6]} | {total[3]} | {total[4]} |"
        )
        return "\n".join(lines)


def trial(tally: Tally, fault: str, body) -> None:
    """Runs `body`, which returns (exact, lost) or (exact, lost, outside written), and counts its outcome."""
    if tally.only not in fault:
        return
    try:
        exact, lost, *outside = body()
        tally.add(fault, exact, lost, False, *outside)
    except Hang as error:
        print(f"  hang: {error}", flush=True)
        tally.add(fault, None, False, True)


def sigkill(base, reference, step):
    out, backup = base / "out", base / "backup"
    status, _ = worker(out, backup, "--slow", "0.02", stop_at=step)
    before = steps_in(backup)
    status, output = worker(out, backup)
    lost = status != 0 or (before and "BackupAndRestore: resumed" not in output)
    return status == 0 and same(out, reference), bool(lost)


def corrupt(base, reference, how):
    """Damages the newest backup after a SIGKILL; the resume must use the one before and keep the damaged one."""
    out, backup = base / "out", base / "backup"
    worker(out, backup, "--slow", "0.02", stop_at=20)
    steps = steps_in(backup)
    newest = backup / str(steps[-1])
    data = [
        os.path.join(r, f)
        for r, _, fs in os.walk(newest / "state")
        for f in fs
        if os.sep + "d" + os.sep in os.path.join(r, f)
    ]
    if how == "flip 8 bytes in every data file":
        for path in data:
            size = os.path.getsize(path)
            with open(path, "r+b") as f:
                f.seek(size // 2)
                chunk = f.read(8)
                f.seek(size // 2)
                f.write(bytes(b ^ 0xFF for b in chunk))
    elif how == "truncate the data files":
        for path in data:
            with open(path, "r+b") as f:
                f.truncate(3)
    elif how == "delete the array metadata":
        os.remove(newest / "state" / "_METADATA")
    elif how == "garble the JSON part":
        meta = [os.path.join(r, f) for r, _, fs in os.walk(newest / "meta") for f in fs if f == "metadata"][0]
        with open(meta, "wb") as f:
            f.write(b"\xff\x00{not json")
    previous = snapshot(backup / str(steps[-2])) if len(steps) > 1 else {}
    status, output = worker(out, backup)
    kept_aside = os.path.isdir(f"{newest}.unreadable")
    previous_intact = not previous or status == 0  # it was restored, so it was read whole
    return status == 0 and same(out, reference), not (kept_aside and previous_intact)


def mismatch(base, reference):
    out, backup = base / "out", base / "backup"
    worker(out, backup, "--slow", "0.02", stop_at=14)
    before = snapshot(backup)
    status, output = worker(base / "other", backup, "--hidden", "48")
    lost = snapshot(backup) != before or status == 0
    status, _ = worker(out, backup)  # the right model still resumes from them
    return status == 0 and same(out, reference), lost


def bad_labels(base, reference):
    """A run with backups is killed; its rerun with a label out of range must fail before any step or restore,
    naming the sample, and leave the backups as they were; the run with the right labels then resumes exactly."""
    out, backup = base / "out", base / "backup"
    worker(out, backup, "--slow", "0.02", stop_at=14)
    before = snapshot(backup)
    status, output = worker(out, backup, "--bad-label", "5")
    clear = status != 0 and "class ids in [0, 3)" in output and "Received: 7 at sample 5 of y" in output
    lost = not clear or "\nstep " in output or snapshot(backup) != before or not before
    status, _ = worker(out, backup)
    return status == 0 and same(out, reference), lost


def sigterm(base, reference, repeat):
    out, backup = base / "out", base / "backup"
    status, _ = worker(out, backup, "--slow", "0.02", stop_at=13, sig=signal.SIGTERM, repeat_signal=repeat)
    lost = status != 143 or not steps_in(backup)
    status, _ = worker(out, backup)
    return status == 0 and same(out, reference), lost


def sigterm_in_setup(base, reference):
    out, backup = base / "out", base / "backup"
    status, _ = worker(out, backup, "--sigterm-in-setup")
    lost = status != 143 or steps_in(backup) != [1]
    status, _ = worker(out, backup)
    return status == 0 and same(out, reference), lost


HANG_TIMEOUT = 3.0  # the preemption_timeout of the hung worker


def sigterm_in_hang(base, reference):
    """A callback that never returns (it opens a FIFO no one writes) at step 13, then SIGTERM: the process
    must end with 143 within its preemption_timeout (no step boundary comes, so nothing is saved), and the
    backup before the hang must resume exactly."""
    out, backup, fifo = base / "out", base / "backup", base / "fifo"
    os.mkfifo(fifo)
    argv = [sys.executable, WORKER, str(out), str(backup), "--slow", "0.02"]
    with Job(
        argv + ["--hang-at-step", "13", str(fifo), "--preemption-timeout", str(HANG_TIMEOUT)], timeout=BOUND
    ) as job:
        try:
            job.wait_for(r"hanging at step 13$")
            time.sleep(0.5)
            sent = time.monotonic()
            job.proc.send_signal(signal.SIGTERM)
            status = job.finish()
        except AssertionError as error:
            raise Hang(str(error)[:300]) from None
    took = time.monotonic() - sent
    print(f"    ended {took:.1f} s after the SIGTERM (bound {HANG_TIMEOUT:g} s), status {status}", flush=True)
    if took > HANG_TIMEOUT + 10:
        raise Hang(f"the process ended {took:.1f} s after the SIGTERM, past its {HANG_TIMEOUT:g} s bound")
    lost = status != 143 or "no step boundary came" not in job.stderr or not steps_in(backup)
    status, _ = worker(out, backup)
    return status == 0 and same(out, reference), lost


def two_writers(base, reference):
    out, backup = base / "out", base / "backup"
    with Job([sys.executable, WORKER, str(out), str(backup), "--slow", "0.25"], timeout=BOUND) as first:
        try:
            first.wait_for(r"step 7$")
            status, output = worker(base / "second", backup)
            refused = status != 0 and "is being written by another process" in output
            first_status = first.finish()
        except AssertionError as error:
            raise Hang(str(error)[:300]) from None
    return first_status == 0 and same(out, reference), not refused


def read_only(base, reference):
    backup = base / "backup"
    backup.mkdir()
    if subprocess.run(["mount", "--bind", str(backup), str(backup)], capture_output=True).returncode:
        return None, False  # not root here: skipped
    try:
        worker(base / "out", backup, "--slow", "0.02", stop_at=8)
        before = snapshot(backup)
        subprocess.run(["mount", "-o", "remount,bind,ro", str(backup)], check=True)
        start = time.monotonic()
        status, output = worker(base / "out", backup)
        if time.monotonic() - start > 60:
            raise Hang("the read-only case took over 60 s")
        return None, status == 0 or snapshot(backup) != before
    finally:
        subprocess.run(["umount", "-l", str(backup)], capture_output=True)


def launcher_sigterm(base, reference_two):
    out, backup = base / "out", base / "backup"
    argv = LAUNCH + [
        "--nprocs",
        "2",
        "--devices-per-proc",
        "2",
        WORKER,
        str(out),
        str(backup),
        "--strategy",
        "multi_worker",
    ]
    with Job(argv[:4] + ["--grace-period", "60"] + argv[4:] + ["--slow", "0.03"], timeout=BOUND) as job:
        try:
            job.wait_for(r".*step 11$")
            ranks = job.children()
            job.proc.send_signal(signal.SIGTERM)
            status = job.finish(timeout=90)
        except AssertionError as error:
            raise Hang(str(error)[:300]) from None
    orphans = [pid for pid in ranks if os.path.exists(f"/proc/{pid}")]
    if orphans:
        raise Hang(f"ranks {orphans} outlived the launcher")
    lost = status != 143 or not steps_in(backup)
    with Job(argv, timeout=BOUND) as job:
        try:
            resumed = job.finish()
        except AssertionError as error:
            raise Hang(str(error)[:300]) from None
    return resumed == 0 and same(out, reference_two), lost


HANG_LAUNCH_FAULT = "SIGTERM to `meshfit launch` while a rank hangs (2 ranks)"


def launcher_sigterm_in_hang(base, reference_two):
    """Rank 1 of a 2-rank job never returns from a callback at step 13 (rank 0 then waits for it in a
    collective), then SIGTERM to the launcher: every rank must end within its preemption_timeout (no step
    boundary comes, so nothing is saved), the launcher with 143, no rank outlive it, and a new job must resume
    exactly from the newest complete backup."""
    out, backup, fifo = base / "out", base / "backup", base / "fifo"
    os.mkfifo(fifo)
    argv = LAUNCH + ["--nprocs", "2", "--devices-per-proc", "2", WORKER, str(out), str(backup)]
    argv += ["--strategy", "multi_worker"]
    hang = ["--hang-at-step", "13", str(fifo), "--hang-rank", "1", "--preemption-timeout", str(HANG_TIMEOUT)]
    with Job(argv + ["--slow", "0.02"] + hang, timeout=BOUND) as job:
        try:
            job.wait_for(r"\[rank 1\] hanging at step 13$")
            ranks = job.children()
            time.sleep(0.5)
            sent = time.monotonic()
            job.proc.send_signal(signal.SIGTERM)
            status = job.finish(timeout=90)
        except AssertionError as error:
            raise Hang(str(error)[:300]) from None
    took = time.monotonic() - sent
    print(f"    launcher ended {took:.1f} s after the SIGTERM (bound {HANG_TIMEOUT:g} s), status {status}", flush=True)
    orphans = [pid for pid in ranks if os.path.exists(f"/proc/{pid}")]
    if orphans:
        raise Hang(f"ranks {orphans} outlived the launcher")
    if took > HANG_TIMEOUT + 10:
        raise Hang(f"the job ended {took:.1f} s after the SIGTERM, past its {HANG_TIMEOUT:g} s bound")
    ended = re.findall(r"\[launch\] rank \d ended with status (-?\d+)", job.stderr)
    lost = status != 143 or ended != ["143", "143"] or not steps_in(backup)
    with Job(argv, timeout=BOUND) as job:
        try:
            resumed = job.finish()
        except AssertionError as error:
            raise Hang(str(error)[:300]) from None
    return resumed == 0 and same(out, reference_two), lost


def stopped_server(base):
    argv = LAUNCH + [
        "--ps",
        "1",
        "--workers",
        "2",
        "--server-timeout",
        "8",
        PS_WORKER,
        str(base / "backup"),
        "--epochs",
        "50",
    ]
    with Job(argv, timeout=BOUND) as job:
        try:
            pids = {int(m.group(2)) for m in job.wait_for(r"\[rank (\d)\] parameter-server worker pid (\d+)", 2)}
            job.wait_for(r"\[rank 0\] Epoch 2/50")
            (server,) = set(job.children()) - pids
            os.kill(server, signal.SIGSTOP)
            stopped = time.monotonic()
            job.finish(timeout=90)
        except AssertionError as error:
            raise Hang(str(error)[:300]) from None
    if time.monotonic() - stopped > 60:
        raise Hang("the job ran on for over 60 s after its server stopped")
    return None, False


def files_job(kind: str, directory, plant_outside=None):
    """Runs `FILES` on `directory`; with `plant_outside`, plants symlinks to files there at every meshfit name
    in `directory`, with the new process's pid, before it imports meshfit. Returns (status, output, victims)."""
    with Job([sys.executable, "-c", FILES, kind, str(directory), TESTS], timeout=BOUND) as job:
        victims = plant_symlinks(directory, plant_outside, pid=job.proc.pid) if plant_outside else None
        try:
            status = job.finish()
        except AssertionError as error:
            raise Hang(str(error)[:300]) from None
    return status, job.stdout + job.stderr, victims


def said(status: int, output: str) -> str:
    """How a process ended, for the log: 0, or the last line of its error."""
    return "exit 0" if status == 0 else f"exit {status}: {output.strip().splitlines()[-1][:160]}"


def planted_symlinks(base, kind):
    """Symlinks at the meshfit names of a fresh `kind` directory: refused or not followed, nothing outside written."""
    directory, outside = base / kind, base / "outside"
    status, output, victims = files_job(kind, directory, plant_outside=outside)
    refused = status != 0 and "Received: symlinks" in output
    print(f"    {kind}: {'refused, naming the symlinks' if refused else said(status, output)}", flush=True)
    return None, False, read_all(outside) != victims


def planted_among_backups(base, reference):
    """Symlinks at the meshfit names of a directory holding a killed run's backups: the resume is refused with
    the backups unchanged; once the links are gone it resumes exactly."""
    out, backup, outside = base / "out", base / "backup", base / "outside"
    worker(out, backup, "--slow", "0.02", stop_at=20)
    marker = (backup / MARKER).read_bytes()
    with Job([sys.executable, WORKER, str(out), str(backup)], timeout=BOUND) as job:
        victims = plant_symlinks(backup, outside, pid=job.proc.pid)
        before = snapshot(backup)
        try:
            status = job.finish()
        except AssertionError as error:
            raise Hang(str(error)[:300]) from None
    refused = status != 0 and "Received: symlinks" in job.stderr
    print(f"    backup in use: {'refused, naming the symlinks' if refused else f'exit {status}'}", flush=True)
    lost, written = snapshot(backup) != before, read_all(outside) != victims
    for name in meshfit_names(job.proc.pid):
        os.unlink(backup / name)
    (backup / MARKER).write_bytes(marker)
    status, _ = worker(out, backup)
    return status == 0 and same(out, reference), lost, written


def garbled_config(base, name, garble):
    """A saved model's compile record with a wrong-typed argument: `load_model` raises or not (logged);
    nothing may be written anywhere, nor the saved model changed."""
    model = base / "model"
    status, output, _ = files_job("model", model)
    assert status == 0, output[-2000:]
    (record,) = [os.path.join(r, f) for r, _, fs in os.walk(model / "0" / "meta") for f in fs if f == "metadata"]
    with open(record) as f:
        meta = json.load(f)
    garble(meta["compile"])
    with open(record, "w") as f:
        json.dump(meta, f)
    before, saved = snapshot(base), snapshot(model)
    status, output, _ = files_job("load", model)
    print(f"    load_model with {name}: {said(status, output) if status else 'loaded without complaint'}", flush=True)
    return None, snapshot(model) != saved, snapshot(base) != before


#: Wrong-typed compile arguments written into a saved model's record, as the JSON `model.save` writes.
GARBLES = {
    "Huber(delta=Mean())": lambda c: c.update(
        loss={
            "__class__": "meshfit.losses.Huber",
            "config": {"delta": {"__class__": "meshfit.metrics.Mean", "config": {}}},
        }
    ),
    "steps_per_execution=10**12": lambda c: c.update(steps_per_execution=10**12),
}


# -- untrusted directories: another local user ("nobody") got there first or planted files inside ------------

NOBODY = 65534
CACHE = ".compilation_cache"


def untrusted_backup_dir(base, reference, how):
    """A backup directory another user made first (mode 0777), or one of the job's own that others can write to:
    refused before any step, nothing written there; once it is the user's alone, the job runs exactly."""
    out, backup = base / "out", base / "backup"
    backup.mkdir()
    os.chmod(backup, 0o777)
    if how == "another user's (mode 0777)":
        os.chown(backup, NOBODY, NOBODY)
    status, output = worker(out, backup)
    refused = status != 0 and "UntrustedDirectory" in output and not re.search(r"^step \d+$", output, re.M)
    print(f"    {how}: {'refused before any step' if refused else said(status, output)}", flush=True)
    written = os.listdir(backup) != []
    shutil.rmtree(backup)
    status, _ = worker(out, backup)
    return status == 0 and same(out, reference), not refused, written


def cache_entries(backup) -> dict[str, str]:
    """The backup's cached programs by function name (`jit_<name>`): file name."""
    cache = backup / CACHE
    return {name.rsplit("-", 2)[0]: name for name in os.listdir(cache) if name.endswith("-cache")}


def planted_cache_entry(base, reference, how):
    """After a SIGKILL, another user's files at the names of the programs the resumed job looks up: programs
    compiled for another job (steps_per_execution=2), or a FIFO at the train step's name. They are moved aside
    unread: the resume is exact and ends within its bound."""
    out, backup = base / "out", base / "backup"
    worker(out, backup, "--slow", "0.02", stop_at=20)
    victims = cache_entries(backup)
    if how == "another job's programs":
        other = base / "other-backup"
        worker(base / "other", other, "--spe", "2", "--slow", "0.02", stop_at=20)
        for function, name in cache_entries(other).items():
            if function in victims:
                shutil.copyfile(other / CACHE / name, backup / CACHE / victims[function])
                os.chown(backup / CACHE / victims[function], NOBODY, NOBODY)
    else:
        (step,) = [name for function, name in victims.items() if "train_step" in function]
        os.remove(backup / CACHE / step)
        os.mkfifo(backup / CACHE / step)
    status, output = worker(out, backup)
    moved = "JAX must not" in output
    print(f"    {how}: {'moved aside, ' if moved else ''}{said(status, output)}", flush=True)
    return status == 0 and same(out, reference), not moved


def plant_record(path, how) -> None:
    if how == "symlink":
        os.symlink(path.parent.parent / "outside.txt", path)
    elif how == "FIFO":
        os.mkfifo(path)
    elif how == "garbage":
        path.write_bytes(b"\xff{not json")
    else:  # another user's, with a forged ledger
        path.write_text(json.dumps({"steps": 1e9, "step": 20, "job": "forged"}))
        os.chown(path, NOBODY, NOBODY)


def planted_goodput_record(base, reference, how):
    """After a SIGKILL of a job with Goodput, its record inside the backup directory replaced: the resume
    completes exactly (the record is ignored with a warning), and nothing outside is written."""
    out, backup, ledger = base / "out", base / "backup", base / "ledger.json"
    (base / "outside.txt").write_text("precious")
    worker(out, backup, "--goodput", str(ledger), "--slow", "0.02", stop_at=20)
    record = backup / ".goodput.json"
    if os.path.lexists(record):
        os.remove(record)
    plant_record(record, how)
    status, output = worker(out, backup, "--goodput", str(ledger))
    print(f"    {how}: {said(status, output)}", flush=True)
    outside = (base / "outside.txt").read_text() != "precious"
    (mine, _), (theirs, _) = result(out), result(reference)  # History holds Goodput's times: the weights alone
    exact = len(mine) == len(theirs) and all(np.array_equal(x, y) for x, y in zip(mine, theirs, strict=True))
    return status == 0 and exact, status != 0, outside


# -- backups under faults and other users: the memory tier's failure paths and a parent another user owns -----

ATTACKER = 1234  # a second local user (setpriv), as on a shared machine
KEEPER_PROCESS = os.path.join(TESTS, "workers", "keeper_process.py")
STRANGER_AT_SOCKETS = textwrap.dedent("""
    import glob, socket, sys, time
    # Another user tries every keeper socket it can name (the directories are listed in the temporary
    # directory; their insides are the job's user's alone), 64 held at a time, for as long as it is told.
    held, refused, connected = [], 0, 0
    deadline = time.monotonic() + float(sys.argv[1])
    while time.monotonic() < deadline:
        for directory in glob.glob("/tmp/meshfit-keeper-*"):
            s = socket.socket(socket.AF_UNIX)
            try:
                s.connect(directory + "/keeper.sock")
                connected += 1
                held = (held + [s])[-64:]
            except OSError:
                refused += 1
                s.close()
        print(f"refused {refused} connected {connected}", flush=True)
        time.sleep(0.05)
""")


def as_attacker(*argv, timeout=BOUND):
    return subprocess.run(
        ["setpriv", "--reuid", str(ATTACKER), "--regid", str(ATTACKER), "--clear-groups", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def parent_swap(base):
    """The backup directory is `parent/run1`, `parent` another user's (mode 1777, as /tmp is, but theirs): they
    could rename `run1` away mid-fit and put a link to a directory of the job's user in its place, whose
    checkpoints the end of `fit` would delete. Refused before any step, and refused again once the link is
    planted: nothing is written in `parent`, and the linked directory's checkpoints stay as they were."""
    parent, victim = base / "parent", base / "victim"
    parent.mkdir()
    os.chown(parent, ATTACKER, ATTACKER)
    os.chmod(parent, 0o1777)
    for step in ("100", "200"):
        (victim / step).mkdir(parents=True)
        (victim / step / "x").write_text(step)
    before = snapshot(victim)
    status, output = worker(base / "out", parent / "run1")
    refused = status != 0 and "UntrustedDirectory" in output and not re.search(r"^step \d+$", output, re.M)
    written = os.listdir(parent) != []
    as_attacker("ln", "-s", str(victim), str(parent / "run1"))
    status, output = worker(base / "out", parent / "run1")
    refused = refused and status != 0 and "UntrustedDirectory" in output
    print(f"    {'refused before any step, twice' if refused else said(status, output)}", flush=True)
    return None, snapshot(victim) != before or not refused, written


def keeper_stopped(base, reference):
    """A keeper in its own process (as a Ray node's keeper actor is) is stopped (SIGSTOP) at step 10 of a fit
    with snapshots every 2 steps: the tier must turn off with a warning and the fit finish exactly from disk
    within its bound, not freeze at its next snapshot."""
    with Job([sys.executable, KEEPER_PROCESS], timeout=BOUND) as keeper:
        try:
            (found,) = keeper.wait_for(r"(\{.*\})")
            env = {k: v for k, v in json.loads(found.group(1)).items() if k.startswith("MESHFIT_")}
            argv = [sys.executable, WORKER, str(base / "out"), str(base / "backup"), "--memory-freq", "2"]
            with Job(argv + ["--slow", "0.02"], timeout=BOUND, env={**os.environ, **env}) as job:
                job.wait_for(r"step 10$")
                os.kill(keeper.proc.pid, signal.SIGSTOP)
                status = job.finish()
        except AssertionError as error:
            raise Hang(str(error)[:300]) from None
        finally:
            if keeper.proc.poll() is None:
                os.kill(keeper.proc.pid, signal.SIGCONT)
    warned = "memory snapshots are off for this fit" in job.stdout + job.stderr
    exact = status == 0 and warned and same(base / "out", reference)
    if not exact:
        print(f"  keeper stopped: exit {status}, warned {warned}", flush=True)
        print(textwrap.indent((job.stdout + job.stderr)[-3000:], "    | "), flush=True)
    return exact, status != 0


def launched(argv, strangers: bool = False):
    """Runs a launch job to its end (with another user at every keeper socket and strangers at every TCP port
    of its processes when `strangers`): (status, stdout + stderr, what the other user's connections got)."""
    from hostile import Strangers

    attacker, said = None, tempfile.TemporaryFile("w+")
    with Job(argv, timeout=2 * BOUND) as job:
        try:
            if strangers:
                attacker = subprocess.Popen(
                    ["setpriv", "--reuid", str(ATTACKER), "--regid", str(ATTACKER), "--clear-groups"]
                    + [sys.executable, "-c", STRANGER_AT_SOCKETS, str(BOUND)],
                    stdout=said,
                )
                with Strangers(job.proc.pid, every=1.0):
                    status = job.finish()
            else:
                status = job.finish()
        except AssertionError as error:
            raise Hang(str(error)[:300]) from None
        finally:
            if attacker is not None:
                attacker.kill()
                attacker.wait()
    said.seek(0)
    return status, job.stdout + job.stderr, said.read()


def two_ranks_resumable(out, backup, *args) -> list[str]:
    return (
        LAUNCH
        + ["--nprocs", "2", "--devices-per-proc", "2", "--max-restarts", "1", "--stop-grace", "1"]
        + [WORKER, str(out), str(backup), "--strategy", "multi_worker", *args]
    )


def flooded_memory_restart(base, reference_two):
    """Rank 1 SIGKILLed at step 23 with snapshots every 5 steps, while another user connects to every keeper
    socket it can name (64 held) and strangers hit every TCP port of the job: the restart must still resume from
    the memory snapshot (step 20, or 15 when 20 was in flight), exit 0 and end as the uninterrupted job."""
    out = base / "out"
    argv = two_ranks_resumable(out, base / "backup", "--save-freq", "1000", "--memory-freq", "5", "--die-at-step", "23")
    status, output, seen = launched(argv, strangers=True)
    resumed = re.search(r"resumed from the launcher's memory snapshot at .*? \(step (15|20)\)", output)
    tries = re.findall(r"refused (\d+) connected (\d+)", seen)
    kept_out = bool(tries) and int(tries[-1][0]) > 0 and tries[-1][1] == "0"
    exact = status == 0 and resumed is not None and kept_out and same(out, reference_two)
    print(f"    another user's connections to the keeper: {tries[-1] if tries else 'none tried'}", flush=True)
    if not exact:
        print(textwrap.indent(output[-3000:], "    | "), flush=True)
    return exact, status != 0 or resumed is None


def another_jobs_snapshot(base):
    """A 2-rank job compiled with lr 0.5 dies at step 23 with memory snapshots every 5 steps; its restart is
    compiled with lr 0.001 (another job on the same backup_dir): the restart must refuse the snapshot, naming
    the learning rates, and never train on with lr 0.5."""
    argv = two_ranks_resumable(base / "out", base / "backup", "--save-freq", "1000", "--memory-freq", "5")
    argv += ["--die-at-step", "23", "--learning-rate", "0.5", "--restart-learning-rate", "0.001"]
    status, output, _ = launched(argv)
    refused = status != 0 and re.search(r"compiled differently: optimizer: saved .*0\.5.*now .*0\.001", output)
    silently = "BackupAndRestore: resumed" in output
    print(f"    {'refused, naming the learning rates' if refused else said(status, output)}", flush=True)
    return None, silently or not refused


def one_rank_fetch_fails(base, reference_two):
    """Rank 1 SIGKILLed at step 23 (disk backups every 6 steps, snapshots every 2); in the restart rank 1's
    keeper cannot be reached while rank 0's can: the ranks must resume together from disk and end as the
    uninterrupted job, not deadlock on different steps."""
    out = base / "out"
    argv = two_ranks_resumable(out, base / "backup", "--save-freq", "6", "--memory-freq", "2", "--die-at-step", "23")
    status, output, _ = launched(argv + ["--rank1-loses-its-keeper"])
    together = "every process resumes from disk" in output
    exact = status == 0 and together and same(out, reference_two)
    if not exact:
        print(textwrap.indent(output[-3000:], "    | "), flush=True)
    return exact, status != 0


def read_only_with_newer_snapshot(base, reference):
    """A fit with disk backups every 4 steps and snapshots every step in a keeper of its own process is
    SIGKILLed at step 10; its backup directory is then remounted read-only. The restart must resume from the
    newer memory snapshot, finish exactly, and leave the disk as it was."""
    backup = base / "backup"
    backup.mkdir()
    if subprocess.run(["mount", "--bind", str(backup), str(backup)], capture_output=True).returncode:
        return None, False  # not root here: skipped
    try:
        with Job([sys.executable, KEEPER_PROCESS], timeout=4 * BOUND) as keeper:
            (found,) = keeper.wait_for(r"(\{.*\})")
            env = {k: v for k, v in json.loads(found.group(1)).items() if k.startswith("MESHFIT_")}
            argv = [sys.executable, WORKER, str(base / "out"), str(backup), "--save-freq", "4", "--memory-freq", "1"]
            with Job(argv + ["--slow", "0.02"], timeout=BOUND, env={**os.environ, **env}) as job:
                job.wait_for(r"step 10$")
                job.proc.send_signal(signal.SIGKILL)
                job.finish()
            before = snapshot(backup)
            subprocess.run(["mount", "-o", "remount,bind,ro", str(backup)], check=True)
            with Job(argv, timeout=BOUND, env={**os.environ, **env}) as job:
                status = job.finish()
    except AssertionError as error:
        raise Hang(str(error)[:300]) from None
    finally:
        subprocess.run(["umount", "-l", str(backup)], capture_output=True)
    output = job.stdout + job.stderr
    from_memory = "resumed from the launcher's memory snapshot" in output
    exact = status == 0 and from_memory and same(base / "out", reference)
    if not exact:
        print(textwrap.indent(output[-3000:], "    | "), flush=True)
    return exact, snapshot(backup) != before or not from_memory


def malformed_parts(base):
    """The test suite's corpus of malformed snapshot parts (tests/checkpointing/test_snapshot_parts.py: crafted
    by a holder of the job's key), each fed to `MemoryTier.restore`: every one must be refused with the warning,
    none raise. Counted as one trial whose outcome is the corpus's."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-k", "malformed"]
        + [os.path.join(TESTS, "checkpointing", "test_snapshot_parts.py")],
        capture_output=True,
        text=True,
        timeout=2 * BOUND,
        cwd=os.path.join(HERE, ".."),
    )
    counts = dict((k, int(n)) for n, k in re.findall(r"(\d+) (passed|failed|error)", done.stdout))
    print(f"    malformed parts: {counts.get('passed', 0)} refused, {counts.get('failed', 0)} not", flush=True)
    return None, done.returncode != 0 or not counts.get("passed")


# -- hostile peers: strangers at every port a job listens on (tests/hostile.py) ----------------------------

DATA_PARALLEL_WORKER = os.path.join(TESTS, "workers", "train_data_parallel.py")


def ps_job(servers: int):
    """`meshfit launch --ps servers --workers 2`, sync, given the directory its weights go to."""
    return lambda out: (
        LAUNCH
        + ["--ps", str(servers), "--workers", "2", PS_WORKER, "none", "--mode", "sync", "--dropout", "0"]
        + ["--epochs", "2", "--weights", str(out / "weights.npz")]
    )


HOSTILE_JOBS = {
    # name -> (the `meshfit launch` job, given the file its result goes to; that file)
    "multi-worker-mirrored launch job (2 ranks)": (
        lambda out: LAUNCH + ["--nprocs", "2", "--devices-per-proc", "2", DATA_PARALLEL_WORKER, str(out)],
        "params.npz",
    ),
    "multi-worker-mirrored launch job with the memory tier (its keeper attacked too)": (
        lambda out: (
            LAUNCH
            + ["--nprocs", "2", "--devices-per-proc", "2", WORKER, str(out), str(out) + "-backup"]
            + ["--strategy", "multi_worker", "--memory-freq", "5"]
        ),
        "weights.npz",
    ),
    "parameter-server launch job (--ps 1 --workers 2, sync)": (ps_job(1), "weights.npz"),
    "parameter-server launch job (--ps 2 --workers 2, sync)": (ps_job(2), "weights.npz"),
}


def hostile_run(argv, hostile: bool):
    """Runs a launch job, with strangers at every port of its processes if `hostile`: (status, seconds, strangers)."""
    from hostile import Strangers

    began = time.monotonic()
    with Job(argv, timeout=BOUND) as job:
        try:
            if hostile:
                with Strangers(job.proc.pid, every=1.0) as strangers:
                    status = job.finish()
            else:
                strangers, status = None, job.finish()
        except AssertionError as error:
            raise Hang(str(error)[:300]) from None
    return status, time.monotonic() - began, strangers


def same_arrays(a, b) -> bool:
    x, y = np.load(a), np.load(b)
    return sorted(x.files) == sorted(y.files) and all(np.array_equal(x[k], y[k]) for k in x.files)


def hostile_peers(tally: Tally, fresh, repeats: int = 2) -> None:
    """Each job of HOSTILE_JOBS, undisturbed then attacked, `repeats` times: the attacked run must give the
    undisturbed result bitwise, end, and take under twice as long. Counted in `tally` under "hostile peers";
    the connections, ports and slowest ratio are printed as a table of their own."""
    rows = []
    for name, (argv, result) in HOSTILE_JOBS.items():
        if tally.only not in f"hostile peers: {name}":
            continue
        ratios, injected, ports, right, hung = [], dict.fromkeys(("silent", "garbage", "unauthenticated"), 0), 0, 0, 0
        for _ in range(repeats):
            quiet, noisy = fresh(), fresh()
            status, undisturbed, _ = hostile_run(argv(quiet), hostile=False)
            assert status == 0, f"{name}: the undisturbed run failed"
            try:
                status, disturbed, strangers = hostile_run(argv(noisy), hostile=True)
            except Hang as error:
                print(f"  hang: {error}", flush=True)
                tally.add(f"hostile peers: {name}", None, False, True)
                hung += 1
                continue
            for kind, count in strangers.injected.items():
                injected[kind] += count
            ports = max(ports, sum(len(p) for p in strangers.ports.values()))
            exact = status == 0 and same_arrays(quiet / result, noisy / result)
            right += exact
            ratios.append(disturbed / undisturbed)
            print(f"  {name}: {undisturbed:.1f} s undisturbed, {disturbed:.1f} s attacked", flush=True)
            tally.add(f"hostile peers: {name}", exact, False, False)
        slowest = f"{max(ratios):.2f}" if ratios else "n/a"
        rows.append(
            f"| {name} | {ports} | {injected['silent']} / {injected['garbage']} / "
            f"{injected['unauthenticated']} | {right} of {repeats} | {hung} | {slowest} |"
        )
    if not rows:
        return
    print()
    print(
        "| hostile peers: job | ports attacked | connections (silent / garbage / unauthenticated) "
        "| completed with the undisturbed result | hangs | slowest time ratio (attacked / undisturbed) |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    print(flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=20, help="random SIGKILL trials")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default="", help="run only the faults whose name holds this text")
    args = parse_args(parser, kills=1, only="SIGKILL at a random step")
    rng = random.Random(args.seed)
    root = tempfile.mkdtemp(prefix="meshfit-faults-")
    from pathlib import Path

    base = Path(root)
    tally = Tally(args.only)
    print("reference runs (uninterrupted)", flush=True)
    status, output = worker(base / "ref", base / "ref-backup")
    assert status == 0, output[-2000:]
    two_ranks = (LAUNCH_FAULT, HANG_LAUNCH_FAULT, MEMORY_FAULT, RAY_FAULT, FLOODED_RESTART, FETCH_FAILS)
    if any(tally.only in fault for fault in two_ranks):
        with Job(
            LAUNCH
            + [
                "--nprocs",
                "2",
                "--devices-per-proc",
                "2",
                WORKER,
                str(base / "ref2"),
                str(base / "ref2-backup"),
                "--strategy",
                "multi_worker",
            ],
            timeout=BOUND,
        ) as job:
            assert job.finish() == 0, job.stderr[-2000:]
    case = iter(range(10**6))

    def fresh():
        path = base / f"t{next(case)}"
        path.mkdir()
        return path

    for _ in range(args.kills):
        step = rng.randint(2, STEPS - 2)
        trial(tally, "SIGKILL at a random step", lambda step=step: sigkill(fresh(), base / "ref", step))
    for how in (
        "flip 8 bytes in every data file",
        "truncate the data files",
        "delete the array metadata",
        "garble the JSON part",
    ):
        trial(tally, f"newest backup damaged: {how}", lambda how=how: corrupt(fresh(), base / "ref", how))
    trial(tally, "resume with a different model", lambda: mismatch(fresh(), base / "ref"))
    trial(tally, "out-of-range labels", lambda: bad_labels(fresh(), base / "ref"))
    trial(tally, "SIGTERM (preemption)", lambda: sigterm(fresh(), base / "ref", repeat=False))
    trial(tally, "SIGTERM repeated every 50 ms", lambda: sigterm(fresh(), base / "ref", repeat=True))
    trial(tally, "SIGTERM while fit sets up", lambda: sigterm_in_setup(fresh(), base / "ref"))
    trial(tally, "SIGTERM during a hang", lambda: sigterm_in_hang(fresh(), base / "ref"))
    trial(tally, "second job on the same backup directory", lambda: two_writers(fresh(), base / "ref"))
    trial(tally, "backup directory read-only", lambda: read_only(fresh(), base / "ref"))
    trial(tally, LAUNCH_FAULT, lambda: launcher_sigterm(fresh(), base / "ref2"))
    trial(tally, HANG_LAUNCH_FAULT, lambda: launcher_sigterm_in_hang(fresh(), base / "ref2"))
    for _ in range(2):
        step = rng.randint(6, STEPS - 2)
        trial(tally, MEMORY_FAULT, lambda step=step: memory_sigkill(fresh(), base / "ref2", step))
    trial(tally, "SIGKILL during a memory snapshot (the previous one used)", lambda: killed_mid_snapshot(fresh()))
    trial(tally, RAY_FAULT, lambda: ray_node_lost(fresh(), base / "ref2"))
    trial(tally, KEEPER_STOPPED, lambda: keeper_stopped(fresh(), base / "ref"))
    trial(tally, FLOODED_RESTART, lambda: flooded_memory_restart(fresh(), base / "ref2"))
    trial(tally, ANOTHER_JOB, lambda: another_jobs_snapshot(fresh()))
    trial(tally, FETCH_FAILS, lambda: one_rank_fetch_fails(fresh(), base / "ref2"))
    trial(tally, "malformed snapshot parts (the test corpus)", lambda: malformed_parts(fresh()))
    trial(
        tally,
        "read-only backup directory, newer memory snapshot",
        lambda: read_only_with_newer_snapshot(fresh(), base / "ref"),
    )
    trial(tally, "parameter server stopped (SIGSTOP)", lambda: stopped_server(fresh()))
    for kind in ("model", "weights", "checkpoint", "backup"):
        trial(tally, "hostile directory: symlinks at meshfit names", lambda kind=kind: planted_symlinks(fresh(), kind))
    trial(tally, "hostile directory: symlinks among backups", lambda: planted_among_backups(fresh(), base / "ref"))
    for name, garble in GARBLES.items():
        trial(tally, "hostile directory: garbled saved config", lambda n=name, g=garble: garbled_config(fresh(), n, g))

    if os.geteuid() == 0:  # another user's files need chown
        trial(tally, "backup directory in another user's parent (swap for a link)", lambda: parent_swap(fresh()))
        for how in ("another user's (mode 0777)", "yours, mode 0777"):
            trial(tally, "untrusted backup directory", lambda h=how: untrusted_backup_dir(fresh(), base / "ref", h))
        for how in ("another job's programs", "FIFO at the train step's name"):
            trial(tally, "planted cache entry", lambda h=how: planted_cache_entry(fresh(), base / "ref", h))
        for how in ("symlink", "FIFO", "garbage", "another user's"):
            trial(tally, "planted Goodput record", lambda h=how: planted_goodput_record(fresh(), base / "ref", h))
    hostile_peers(tally, fresh)
    shutil.rmtree(root, ignore_errors=True)
    print()
    print(tally.table())
    failed = [fault for fault, row in tally.rows.items() if row[1] < row[2] or row[3] or row[4] or row[5]]
    if failed:
        sys.exit(f"faults with a resume not exact, data lost, a hang or a file outside written: {failed}")


if __name__ == "__main__":
    main()
