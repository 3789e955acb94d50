"""The memory tier: BackupAndRestore's snapshots in a keeper, restored exactly; refused without a launcher.

In one process: a real keeper (`meshfit.launch.keeper.Keeper`, real sockets) stands
in the launcher's place, its address in the environment as `meshfit launch` sets it.
The multi-process restart with a real SIGKILL is in tests/callbacks/test_backup_and_restore.py.
"""

import contextlib
import io
import json
import os
import re
import signal
import stat
import struct
import subprocess
import sys
import threading
import time
import warnings
from multiprocessing.connection import Listener

import jax
import jax.numpy as jnp
import numpy as np
import optax
import processes
import pytest
from helpers import MLP, classification_data, mounted, remount_read_only

import meshfit as mf
from meshfit.checkpointing import memory_tier, snapshot_parts
from meshfit.launch.keeper import Keeper
from meshfit.runtime import keeper_protocol
from meshfit.runtime.handshake import handshake

WORKERS = os.path.join(os.path.dirname(__file__), "..", "workers")


@pytest.fixture
def keeper(monkeypatch):
    k = Keeper(io.StringIO())
    for name, value in k.env().items():
        monkeypatch.setenv(name, value)
    yield k
    k.close()


def fit(backup_dir, epochs, module=None, after_restore=(), **backup_kwargs):
    x, y = classification_data(n=96)
    model = mf.Model(MLP() if module is None else module, seed=3)
    model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    callbacks = [mf.callbacks.BackupAndRestore(backup_dir, **backup_kwargs)] if backup_dir else []
    history = model.fit(x, y, batch_size=16, epochs=epochs, callbacks=[*callbacks, *after_restore], verbose=0)
    return model, history


class RestoredLayout(mf.callbacks.Callback):
    """Records, before the first step (after BackupAndRestore's restore), the state's leaves that are not device
    arrays placed on the model's devices (a restore that left host arrays would make the first step compile a
    program of its own)."""

    def __init__(self):
        super().__init__()
        self.astray = None

    def on_train_batch_begin(self, batch, logs=None):
        if self.astray is not None:
            return
        self.astray = [
            type(leaf).__name__
            for leaf in jax.tree.leaves(self.model.fit_context.latest)
            if not isinstance(leaf, jax.Array) or not leaf.committed
        ]


def test_memory_freq_without_a_launcher_is_refused_naming_the_launcher(tmp_path, monkeypatch):
    monkeypatch.delenv(keeper_protocol.ENV_KEEPER_ADDRESS, raising=False)
    with pytest.raises(ValueError, match=r"memory_freq=5.*meshfit launch --nprocs N"):
        mf.callbacks.BackupAndRestore(tmp_path / "b", memory_freq=5)
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "5"])
def test_a_bad_memory_freq_is_refused(tmp_path, bad):
    with pytest.raises(ValueError, match="`memory_freq` must be a positive int or None"):
        mf.callbacks.BackupAndRestore(tmp_path / "b", memory_freq=bad)


def test_more_memory_replicas_than_nodes_with_keepers_are_refused(tmp_path, keeper):
    with pytest.raises(ValueError, match=r"`memory_replicas=2` needs a keeper on as many nodes; .* run on 1 node"):
        mf.callbacks.BackupAndRestore(tmp_path / "b", memory_freq=2, memory_replicas=2)
    with pytest.raises(ValueError, match="`memory_replicas` must be a positive int or None"):
        mf.callbacks.BackupAndRestore(tmp_path / "b", memory_freq=2, memory_replicas=0)
    assert not (tmp_path / "b").exists()


def test_a_restart_on_fewer_nodes_than_memory_replicas_keeps_the_snapshots_on_the_nodes_it_has(
    tmp_path, keeper, monkeypatch
):
    """The same script restarted by `--ray` on one node (its other node lost; an elastic restart) warns and
    trains on with each snapshot on the one keeper, instead of failing the restart. On one machine, where the
    nodes never change, a restart refuses it as the first start does."""
    monkeypatch.setenv("MESHFIT_RESTART_COUNT", "1")
    with pytest.raises(ValueError, match=r"`memory_replicas=2` needs a keeper on as many nodes"):
        mf.callbacks.BackupAndRestore(tmp_path / "b", memory_freq=2, memory_replicas=2)
    monkeypatch.setenv(keeper_protocol.ENV_KEEPER_HOMES, "0")  # as `meshfit launch --ray` sets it
    with pytest.warns(UserWarning, match=r"`memory_replicas=2`, and this restarted job's ranks run on 1 node"):
        fit(tmp_path / "b", 1, memory_freq=2, memory_replicas=2)
    assert "committed the memory snapshot of step 2 (parts of 1 of 1 process(es)" in keeper.log.getvalue()


@pytest.mark.filterwarnings("ignore:BackupAndRestore. memory snapshots are off")  # its own keeper stays gone
@pytest.mark.filterwarnings("ignore:BackupAndRestore. could not ask the keeper")
def test_a_part_whose_own_keeper_is_gone_is_restored_from_its_replica(tmp_path, monkeypatch, capsys):
    """Two nodes' keepers (as under `meshfit launch --ray`), this rank's own on node 1: the rank writes each
    snapshot into its own keeper's shared memory, and that keeper sends it on to the other (memory_replicas
    defaults to 2). Node 1's keeper is lost; the launcher agrees on the step from the survivor's inventory and
    the fit resumes from the replica, exactly."""
    from meshfit.launch.keeper import agreed_steps

    full, full_history = fit(None, 2)
    key = os.urandom(32)
    other, own = Keeper(io.StringIO(), key=key), Keeper(io.StringIO(), key=key)
    try:
        for keeper in (other, own):
            keeper.set_peers([other.address, own.address])  # as `ray_keepers` tells them before each start
        monkeypatch.setenv(keeper_protocol.ENV_KEEPER_ADDRESS, f"{other.address},{own.address}")
        monkeypatch.setenv(keeper_protocol.ENV_KEEPER_LOCAL, f",{own.local_address}")
        monkeypatch.setenv(keeper_protocol.ENV_KEEPER_AUTHKEY, key.hex())
        monkeypatch.setenv(keeper_protocol.ENV_KEEPER_HOMES, "1")
        fit(tmp_path / "b", 1, save_freq=1000, memory_freq=2, delete_checkpoint=False)
        fit_key = os.path.abspath(tmp_path / "b")
        assert own.settle(30)  # the replica on its way (the fit returned once its own keeper held each part)
        assert own.committed_steps(fit_key) == [4, 6] and other.committed_steps(fit_key)[-1] == 6
        assert own.replica_counts[1] == 0  # (a replica not sent yet gives way to a newer one: 2 or 3 sent)
        assert f"holds replicas that the keeper at {own.address} sends on" in other.log.getvalue()
        own.close()  # gone with its node
        chosen = agreed_steps([other.inventory()])
        assert chosen[fit_key]["step"] == 6
        monkeypatch.setenv(keeper_protocol.ENV_KEEPER_RESUME, json.dumps({fit_key: [6, chosen[fit_key]["start"]]}))
        resumed, resumed_history = fit(tmp_path / "b", 2, save_freq=1000, memory_freq=2)
        out = capsys.readouterr().out
        assert (
            f"resumed from the launcher's memory snapshot held by the keeper at {other.address} (another node's) "
            "at epoch 1, batch 6 (step 6)"
        ) in out, out
        assert resumed_history.history == full_history.history
        for a, b in zip(full.get_weights(), resumed.get_weights(), strict=True):
            np.testing.assert_array_equal(a, b)
    finally:
        other.close()
        own.close()


def test_a_fit_resumes_from_the_newest_memory_snapshot_exactly(tmp_path, keeper, capsys):
    """Snapshots every 2 steps and no disk backup: the next fit resumes at step 6 from memory, bitwise."""
    full, full_history = fit(None, 2)
    fit(tmp_path / "b", 1, save_freq=1000, memory_freq=2, delete_checkpoint=False)  # 6 steps; snapshots at 2, 4, 6
    assert keeper.committed_steps(os.path.abspath(tmp_path / "b")) == [4, 6]  # the newest two
    assert not [p for p in os.listdir(tmp_path / "b") if p.isdigit()]  # nothing on disk
    resumed, resumed_history = fit(tmp_path / "b", 2, save_freq=1000, memory_freq=2)
    assert "resumed from the launcher's memory snapshot at epoch 1, batch 6 (step 6)" in capsys.readouterr().out
    assert resumed_history.history == full_history.history
    for a, b in zip(full.get_weights(), resumed.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert keeper.committed_steps(os.path.abspath(tmp_path / "b")) == []  # a finished fit's snapshots are dropped


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_a_model_built_by_a_factory_resumes_without_creating_what_it_restores(tmp_path, keeper, capsys, tier):
    """A factory's model holds only its template until its arrays are read: a fit that resumes reads them from
    the backup straight into its layout, and never runs the factory to create parameters it would overwrite
    (seconds at real sizes). It ends bitwise where an uninterrupted fit ends."""
    created = []

    def factory():
        created.append(1)
        return MLP(dropout=0.1)

    full, full_history = fit(None, 2, factory)
    settings = {"save_freq": 1000, "memory_freq": 2} if tier == "memory" else {"save_freq": 2}
    fit(tmp_path / "b", 1, factory, delete_checkpoint=False, **settings)  # 6 steps
    created.clear()
    layout = RestoredLayout()
    resumed, resumed_history = fit(tmp_path / "b", 2, factory, [layout], **settings)
    assert "resumed from " in capsys.readouterr().out
    assert len(created) == 1  # `nnx.eval_shape`'s call for the template; none to create the state
    assert layout.astray == []  # restored onto the devices, in the step's layout
    assert resumed_history.history == full_history.history
    for a, b in zip(full.get_weights(), resumed.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_disk_backup_newer_than_the_memory_snapshot_wins(tmp_path, keeper, capsys):
    fit(tmp_path / "b", 1, save_freq=5, memory_freq=4, delete_checkpoint=False)  # 6 steps
    steps = keeper.committed_steps(os.path.abspath(tmp_path / "b"))
    disk = sorted(int(p) for p in os.listdir(tmp_path / "b") if p.isdigit())
    assert disk == [5] and steps == [4], (disk, steps)  # at 6 no multiple of 4 was passed since the backup at 5
    fit(tmp_path / "b", 2, save_freq=5, memory_freq=4)
    assert f"resumed from {tmp_path / 'b'} at epoch 1, batch 5 (step 5)." in capsys.readouterr().out


def test_a_part_whose_bytes_changed_in_the_keeper_is_not_restored(tmp_path, keeper, monkeypatch):
    """The keeper's host flips one bit of a weight in a part it holds: the rank fetching it finds the bytes do
    not match the digest they were sent with, and restores nothing (the fit resumes from disk)."""
    fit(tmp_path / "b", 1, save_freq=1000, memory_freq=3, delete_checkpoint=False)
    fit_key = os.path.abspath(tmp_path / "b")
    tier = memory_tier.MemoryTier(fit_key)
    step, part = tier.newest()
    tier.close()
    header, data = snapshot_parts.unpack_header(part)
    kernel = next(leaf for leaf in header["leaves"] if leaf["path"].endswith("kernel"))
    at = len(part) - len(data) + kernel["shards"][0]["offset"]
    damaged = part[:at] + bytes([part[at] ^ 0x01]) + part[at + 1 :]  # one bit of one weight
    key, listener = os.urandom(32), Listener(("127.0.0.1", 0))

    def flipped_keeper() -> None:  # the keeper's protocol, serving the damaged bytes with the part's digest
        with listener.accept() as conn:
            handshake(conn, key, accepting=True)
            keeper_protocol.recv_json(conn)
            reply = {"step": step, "size": len(part), "digest": keeper_protocol.digest(part), "world": 1}
            keeper_protocol.send_json(conn, reply)
            keeper_protocol.send_payload(conn, damaged)

    serving = threading.Thread(target=flipped_keeper, daemon=True)
    serving.start()
    monkeypatch.setenv(keeper_protocol.ENV_KEEPER_ADDRESS, "{}:{}".format(*listener.address))
    monkeypatch.setenv(keeper_protocol.ENV_KEEPER_AUTHKEY, key.hex())
    tier = memory_tier.MemoryTier(fit_key)
    with pytest.warns(UserWarning, match=f"the memory snapshot of step {step} arrived damaged; not restored"):
        assert tier.newest() is None
    tier.close()
    serving.join(timeout=30)
    listener.close()


def test_a_host_that_cannot_hold_the_snapshots_falls_back_to_disk_with_one_warning(tmp_path, monkeypatch):
    k = Keeper(io.StringIO(), max_bytes=1000)
    for name, value in k.env().items():
        monkeypatch.setenv(name, value)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, history = fit(tmp_path / "b", 2, save_freq=4, memory_freq=2)
        said = [w for w in caught if "memory snapshots are off" in str(w.message)]
        assert len(said) == 1 and "may hold 1000 B" in str(said[0].message)
        assert len(history.history["loss"]) == 2 and k.held_bytes() == 0
    finally:
        k.close()


def put(fit_key: str, step: int, rank: int, world: int, part: bytes) -> dict:
    """Sends one process's part of a snapshot to the keeper, as `MemoryTier` does for rank `rank` of `world`."""
    conn = keeper_protocol.connect()
    try:
        request = {"op": "put", "fit": fit_key, "rank": rank, "world": world, "step": step, "start": 0}
        keeper_protocol.send_json(conn, {**request, "size": len(part), "digest": keeper_protocol.digest(part)})
        assert keeper_protocol.recv_json(conn)["ok"]
        keeper_protocol.send_payload(conn, part)
        return keeper_protocol.recv_json(conn)
    finally:
        conn.close()


def test_a_smaller_world_resumes_from_a_larger_jobs_snapshot_whose_parts_hold_the_arrays_whole(
    tmp_path, keeper, capsys
):
    """A snapshot of a 2-process data-parallel job (each part: the whole replicated state) restores onto 1
    process, exactly: what an elastic restart onto fewer processes does."""
    full, full_history = fit(None, 2)
    fit(tmp_path / "b", 1, save_freq=1000, memory_freq=2, delete_checkpoint=False)
    fit_key = os.path.abspath(tmp_path / "b")
    tier = memory_tier.MemoryTier(fit_key)
    step, part = tier.newest()
    tier.drop()
    assert put(fit_key, step, 0, 2, part)["committed"] is False  # one part of two: not yet a snapshot
    assert put(fit_key, step, 1, 2, part)["committed"] is True
    tier.close()
    resumed, resumed_history = fit(tmp_path / "b", 2, save_freq=1000, memory_freq=2)
    out = capsys.readouterr().out
    assert "resumed from the launcher's memory snapshot of a 2-process job at epoch 1, batch 6 (step 6)" in out
    assert resumed_history.history == full_history.history
    for a, b in zip(full.get_weights(), resumed.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_an_array_split_across_the_larger_jobs_processes_is_not_assembled_from_one_part():
    """A part that holds only a slice of an array (sharded across processes) cannot fill this process's
    whole array: refused naming the array and the shard, so the restart resumes from disk."""
    part = snapshot_parts.pack(4, {"w": jnp.arange(8.0).reshape(4, 2)}, {})
    header, data = snapshot_parts.unpack_header(part)
    rows = {"index": "0:2,0:2", "offset": 0, "nbytes": 16}
    header["leaves"][0]["shards"] = [rows]  # rows 0-1 only
    raw = json.dumps(header).encode()
    half = snapshot_parts.MAGIC + struct.pack(">Q", len(raw)) + raw + bytes(data[:16])
    with pytest.raises(ValueError, match=r"w: this process's part holds no shard \[0:4,0:2\] nor the whole array"):
        snapshot_parts.unpack(half, {"w": jnp.zeros((4, 2))})
    np.testing.assert_array_equal(
        snapshot_parts.unpack(part, {"w": jnp.zeros((4, 2))})["w"], np.arange(8.0).reshape(4, 2)
    )


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_snapshots_the_keeper_cannot_take_every_memory_freq_steps_say_so_once_naming_a_freq_that_can(tmp_path, keeper):
    """A 50-MiB state (a 1,024 x 4,096 layer and Adam's moments) snapshotted after every step of a few ms: each
    snapshot waits for the one before it, which the warning says once, with a `memory_freq` that keeps up."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16 * 8, 1024)).astype(np.float32), rng.integers(0, 3, 16 * 8)
    model = mf.Model(MLP(din=1024, hidden=4096), seed=3)
    model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    backup = mf.callbacks.BackupAndRestore(tmp_path / "b", save_freq=1000, memory_freq=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=16, epochs=1, callbacks=[backup], verbose=0)
    said = [str(w.message) for w in caught if "memory snapshots hold training" in str(w.message)]
    assert len(said) == 1, said
    suggested = int(re.search(r"Pass memory_freq=(\d+) or more", said[0]).group(1))
    assert suggested > 1 and "MiB a process" in said[0] and "memory_freq=1 steps train in" in said[0]
    assert keeper.committed_steps(os.path.abspath(tmp_path / "b")) == []  # the fit ended: its snapshots dropped


@pytest.fixture
def keeper_process(monkeypatch):
    """A keeper in a process of its own (as a Ray node's keeper actor is), its variables in the environment."""
    with processes.Job([sys.executable, os.path.join(WORKERS, "keeper_process.py")], timeout=300) as job:
        (found,) = job.wait_for(r"(\{.*\})\n?")
        env = json.loads(found.group(1))
        for name in (keeper_protocol.ENV_KEEPER_ADDRESS, keeper_protocol.ENV_KEEPER_AUTHKEY):
            monkeypatch.setenv(name, env[name])
        job.env = env
        try:
            yield job
        finally:
            if job.proc.poll() is None:
                os.kill(job.proc.pid, signal.SIGCONT)


class _At(mf.callbacks.Callback):
    """Calls `then()` after the batch that ends global step `step`."""

    def __init__(self, step, then):
        super().__init__()
        self.step, self.then, self.seen = step, then, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.step:
            self.then()


def fit_with(backup_dir, epochs, extra, **backup_kwargs):
    x, y = classification_data(n=96)
    model = mf.Model(MLP(), seed=3)
    model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    backup = mf.callbacks.BackupAndRestore(backup_dir, **backup_kwargs)
    return model, model.fit(x, y, batch_size=16, epochs=epochs, callbacks=[backup, *extra], verbose=0)


@pytest.mark.slow
@pytest.mark.processes
def test_a_stopped_keeper_turns_the_tier_off_with_one_warning_and_the_fit_finishes_from_disk(
    tmp_path, keeper_process, monkeypatch
):
    """SIGSTOP to the keeper's process after its snapshot of step 2: the next snapshot's send waits at most
    `ANSWER_TIMEOUT` without progress, the tier turns off with one warning naming the keeper, the fit trains
    to its end with disk backups, and ending it (asking the stopped keeper to forget the fit) neither hangs
    nor raises."""
    monkeypatch.setattr(keeper_protocol, "ANSWER_TIMEOUT", 2.0)
    full, full_history = fit(None, 2)
    stop = _At(3, lambda: os.kill(keeper_process.proc.pid, signal.SIGSTOP))
    began = time.monotonic()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model, history = fit_with(tmp_path / "b", 2, [stop], save_freq=5, memory_freq=2)
    took = time.monotonic() - began
    off = [w for w in said if "memory snapshots are off" in str(w.message)]
    assert len(off) == 1, [str(w.message) for w in said]
    assert re.search(
        r"the keeper at unix:.* did not take the snapshot of step \d+ \(.*no answer within 2 s", str(off[0].message)
    ), off[0].message
    assert any("could not ask" in str(w.message) for w in said), [str(w.message) for w in said]
    assert took < 120, took  # two bounds of 2 s and the training, not a hang
    assert history.history == full_history.history
    for a, b in zip(full.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert not (tmp_path / "b").exists()  # the finished fit's backups are deleted as without the tier


@pytest.mark.slow
@pytest.mark.processes
def test_a_keeper_gone_after_the_last_snapshot_does_not_fail_the_finished_fit(tmp_path, keeper_process):
    """The keeper SIGKILLed after the fit's last snapshot: the fit ends as it would without the tier (its
    backups deleted), with a warning that the keeper could not be asked to forget the snapshots."""

    def kill():
        backup.wait_until_finished()  # the snapshot of step 10 committed
        os.kill(keeper_process.proc.pid, signal.SIGKILL)
        keeper_process.proc.wait()

    backup = mf.callbacks.BackupAndRestore(tmp_path / "b", save_freq=1000, memory_freq=5)  # snapshots at 5 and 10
    x, y = classification_data(n=96)
    model = mf.Model(MLP(), seed=3)
    model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=16, epochs=2, callbacks=[backup, _At(12, kill)], verbose=0)
    said = [str(w.message) for w in said]
    assert len(said) == 1 and re.search("could not ask the keeper at .* to forget", said[0]), "\n".join(said)
    assert not (tmp_path / "b").exists()


@contextlib.contextmanager
def keeper_node(*args):
    """A keeper in a process of its own (`workers/keeper_process.py ARGS`, as a Ray node's keeper actor is):
    yields the job and its JSON line (its variables and TCP address); continued if stopped, then ended."""
    with processes.Job([sys.executable, os.path.join(WORKERS, "keeper_process.py"), *args], timeout=300) as job:
        (found,) = job.wait_for(r"(\{.*\})\n?")
        try:
            yield job, json.loads(found.group(1))
        finally:
            if job.proc.poll() is None:
                os.kill(job.proc.pid, signal.SIGCONT)


def two_nodes(monkeypatch, key: bytes, replica: str, own: str, own_local: str) -> None:
    """Points this rank at two nodes' keepers as `meshfit launch --ray` does: its own (the second: `HOMES` 1,
    reached through its Unix socket) and another node's, which holds its replica."""
    monkeypatch.setenv(keeper_protocol.ENV_KEEPER_ADDRESS, f"{replica},{own}")
    monkeypatch.setenv(keeper_protocol.ENV_KEEPER_LOCAL, f",{own_local}")
    monkeypatch.setenv(keeper_protocol.ENV_KEEPER_AUTHKEY, key.hex())
    monkeypatch.setenv(keeper_protocol.ENV_KEEPER_HOMES, "1")


def tcp_peer_ports() -> set[int]:
    """The remote ports of this process's TCP connections (its socket descriptors found in /proc/net/tcp*)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    ports = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[9] in inodes:
                    ports.add(int(fields[2].rsplit(":", 1)[1], 16))
    return ports


class TcpPeers(mf.callbacks.Callback):
    """Records, after every batch and at the end of the fit, the ports this process's TCP connections reach."""

    def __init__(self):
        super().__init__()
        self.ports: set[int] = set()

    def on_train_batch_end(self, batch, logs=None):
        self.ports |= tcp_peer_ports()

    on_train_end = on_train_batch_end


def newest_part(address: str, key: bytes, fit_key: str) -> tuple[int, bytes] | None:
    """The newest committed snapshot's step and rank 0's part (of a 1-process job) held by the keeper at
    `address`, asked over the protocol as a restarted rank would."""
    with keeper_protocol.connect(address, key) as conn:
        request = {"op": "latest", "fit": fit_key, "rank": 0, "world": 1, "step": memory_tier.NEWEST}
        keeper_protocol.send_json(conn, request)
        reply = keeper_protocol.recv_json(conn)
        if reply["step"] is None:
            return None
        return reply["step"], bytes(keeper_protocol.recv_payload(conn, reply["size"]))


@pytest.mark.slow
@pytest.mark.processes
def test_the_ranks_own_keeper_sends_its_replica_on_and_the_rank_sends_its_part_once(tmp_path, monkeypatch):
    """Two nodes' keepers in processes of their own. The rank writes each snapshot into its own keeper's shared
    memory (its Unix socket) and opens no TCP connection at all, to the replica's keeper least; its own keeper
    sends each part on, and the replica's keeper holds the same bytes, saying whose keeper sent them."""
    key = os.urandom(32)
    with keeper_node(key.hex()) as (replica_job, replica), keeper_node(key.hex(), replica["tcp"]) as (_, own):
        own_local = own[keeper_protocol.ENV_KEEPER_ADDRESS]
        two_nodes(monkeypatch, key, replica["tcp"], own["tcp"], own_local)
        probe = TcpPeers()
        fit(tmp_path / "b", 1, after_restore=[probe], save_freq=1000, memory_freq=2, delete_checkpoint=False)
        fit_key = os.path.abspath(tmp_path / "b")
        with keeper_protocol.connect(own_local, key) as conn:  # the replicas on their way have arrived
            keeper_protocol.send_json(conn, {"op": "settle", "fit": fit_key, "rank": 0, "world": 1, "step": 0})
            assert keeper_protocol.recv_json(conn) == {"ok": True, "settled": True}
        held = newest_part(replica["tcp"], key, fit_key)
        assert held is not None and held[0] == 6
        assert held == newest_part(own_local, key, fit_key)  # the same bytes on both nodes
        ports = {int(address.rsplit(":", 1)[1]) for address in (replica["tcp"], own["tcp"])}
        assert not probe.ports & ports, probe.ports  # the rank sent its part once, through its Unix socket
        said = f"keeper: holds replicas that the keeper at {own['tcp']} sends on"
        deadline = time.monotonic() + 30  # (it says so right after answering the first one)
        while said not in replica_job.stderr and time.monotonic() < deadline:
            time.sleep(0.05)
        assert said in replica_job.stderr, replica_job.stderr


class ReplicaTried(mf.callbacks.Callback):
    """Holds the step after each snapshot until the keeper has tried (sent or failed) that snapshot's replica, so
    every snapshot is tried whatever the machine's speed (a newer part replaces one still queued); records the
    seconds each wait took."""

    def __init__(self, keeper):
        super().__init__()
        self.keeper, self.waits = keeper, []

    def on_train_batch_begin(self, batch, logs=None):
        if batch in (2, 4):  # steps 2 and 4 were snapshots (memory_freq=2)
            start = time.monotonic()
            while sum(self.keeper.replica_counts) < batch // 2 and time.monotonic() - start < 30:
                time.sleep(0.01)
            self.waits.append(time.monotonic() - start)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["stopped", "gone"])
@pytest.mark.processes
def test_a_replica_keeper_stopped_or_gone_never_holds_the_rank_and_is_said_once(tmp_path, monkeypatch, fault):
    """The replica's keeper SIGSTOPped (or SIGKILLed) before the fit: every snapshot still commits on the rank's
    own keeper with no warning (the tier stays on, nothing waits for the replica), each replica the own
    keeper tries ends within its bounds, and its log says so once however many failed."""
    monkeypatch.setattr(keeper_protocol, "ANSWER_TIMEOUT", 2.0)
    key = os.urandom(32)
    own = Keeper(io.StringIO(), key=key)
    try:
        with keeper_node(key.hex()) as (replica_job, replica):
            own.set_peers([replica["tcp"], own.address])
            two_nodes(monkeypatch, key, replica["tcp"], own.address, own.local_address)
            os.kill(replica_job.proc.pid, signal.SIGSTOP if fault == "stopped" else signal.SIGKILL)
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                tried = ReplicaTried(own)
                fit(tmp_path / "b", 1, after_restore=[tried], save_freq=1000, memory_freq=2, delete_checkpoint=False)
            assert not [str(w.message) for w in said if "BackupAndRestore" in str(w.message)]
            assert own.committed_steps(os.path.abspath(tmp_path / "b")) == [4, 6]
            assert tried.waits and max(tried.waits) < 30  # each replica try ended (failed) within its bounds
            assert own.settle(60)  # every try ended within its bounds
            sent, failed = own.replica_counts
            assert sent == 0 and failed >= 2, (sent, failed)
            lines = [ln for ln in own.log.getvalue().splitlines() if "could not send the replica" in ln]
            assert len(lines) == 1 and replica["tcp"] in lines[0], own.log.getvalue()
    finally:
        own.close()


@pytest.mark.processes
def test_another_user_cannot_connect_to_the_keeper_of_this_node(tmp_path, keeper):
    """The ranks reach their node's keeper through a Unix socket in a directory of mode 0700: another local
    user (uid 1234) cannot even connect, so cannot crowd the job's connections out."""
    path = keeper.local_address[len(keeper_protocol.UNIX_PREFIX) :]
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    probe = (
        "import socket, sys\n"
        "try:\n    socket.socket(socket.AF_UNIX).connect(sys.argv[1])\n"
        "except OSError as e:\n    print(type(e).__name__)\nelse:\n    print('connected')\n"
    )
    done = subprocess.run(
        ["setpriv", "--reuid", "1234", "--regid", "1234", "--clear-groups", sys.executable, "-c", probe, path],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.strip() == "PermissionError", (done.stdout, done.stderr)


def fit_compiled(backup_dir, epochs, optimizer, **backup_kwargs):
    x, y = classification_data(n=96)
    model = mf.Model(MLP(), seed=3)
    model.compile(optimizer=optimizer, loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    backup = mf.callbacks.BackupAndRestore(backup_dir, **backup_kwargs)
    return model, model.fit(x, y, batch_size=16, epochs=epochs, callbacks=[backup], verbose=0)


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
@pytest.mark.parametrize("tier", ["memory", "disk"])
@pytest.mark.parametrize(
    "first, second, differs",
    [
        (
            lambda: mf.optimizers.Adam(0.5),
            lambda: mf.optimizers.Adam(0.001),
            r"optimizer: saved .*0\.5.*, now .*0\.001",
        ),
        (lambda: optax.adam(0.5), lambda: optax.adam(0.001), "optimizer_constants: saved"),
    ],
    ids=["named", "optax"],
)
def test_a_backup_of_a_fit_compiled_differently_is_refused_naming_what_differs(
    tmp_path, keeper, tier, first, second, differs
):
    """A fit compiled with lr 0.5 leaves a backup (a memory snapshot, or one on disk); a fit of the same model
    compiled with lr 0.001 refuses it, naming the optimizer, before any step, and leaves it as it was."""
    kwargs = {"save_freq": 1000, "memory_freq": 2} if tier == "memory" else {"save_freq": 2}
    fit_compiled(tmp_path / "b", 1, first(), delete_checkpoint=False, **kwargs)
    fit_key = os.path.abspath(tmp_path / "b")
    held, on_disk = keeper.committed_steps(fit_key), sorted(os.listdir(tmp_path / "b"))
    assert (held and tier == "memory") or (not held and tier == "disk")
    with pytest.raises(ValueError, match=rf"written by a fit compiled differently: {differs}(.|\n)*another backup_dir"):
        fit_compiled(tmp_path / "b", 2, second(), **kwargs)
    assert keeper.committed_steps(fit_key) == held and sorted(os.listdir(tmp_path / "b")) == on_disk
    fit_compiled(tmp_path / "b", 2, first(), **kwargs)  # compiled as it was: resumes


@pytest.mark.slow
@pytest.mark.processes
def test_a_read_only_backup_directory_does_not_hide_a_newer_memory_snapshot(tmp_path, keeper, capsys):
    """Disk backup at step 4, memory snapshots at 5 and 6; the directory is then remounted read-only. The next
    fit resumes from memory at step 6 (saying once that the directory cannot be written), backs up in memory
    only, ends bitwise equal to an uninterrupted fit, and leaves the disk as it was."""
    full, full_history = fit(None, 2)
    with mounted(tmp_path / "b", "--bind"):
        fit(tmp_path / "b", 1, save_freq=4, memory_freq=1, delete_checkpoint=False)
        before = sorted(os.listdir(tmp_path / "b"))
        assert "4" in before and "6" not in before, before
        remount_read_only(tmp_path / "b")
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            resumed, resumed_history = fit(tmp_path / "b", 2, save_freq=4, memory_freq=1)
        said = [str(w.message) for w in said if "BackupAndRestore" in str(w.message)]
        assert len(said) == 1 and "Read-only file system" in said[0] and "memory only" in said[0], said
        assert "resumed from the launcher's memory snapshot at epoch 1, batch 6 (step 6)" in capsys.readouterr().out
        assert sorted(os.listdir(tmp_path / "b")) == before
    assert resumed_history.history == full_history.history
    for a, b in zip(full.get_weights(), resumed.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
