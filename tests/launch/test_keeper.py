"""The launcher's snapshot keeper: commits only whole snapshots of every rank, authenticated peers only.

Real sockets and real processes: a rank is a client speaking the protocol
(`meshfit.runtime.keeper_protocol`); a rank killed half-way through sending is
a subprocess SIGKILLed after writing part of its frame.
"""

import io
import mmap
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from hostile import garbage, unauthenticated

from meshfit.launch.keeper import Keeper, agreed_steps
from meshfit.runtime import handshake
from meshfit.runtime import keeper_protocol as protocol


@pytest.fixture
def keeper():
    log = io.StringIO()
    k = Keeper(log)
    k.test_log = log
    yield k
    k.close()


def client(keeper):
    return protocol.connect(keeper.address, keeper.key)


def put(conn, step, rank, payload, world=2, fit="f", start=0, expect=None):
    digest = protocol.digest(payload)
    header = {"fit": fit, "rank": rank, "world": world, "step": step, "start": start, "size": len(payload)}
    if expect is not None:
        header["expect"] = expect
    protocol.send_json(conn, {"op": "put", **header, "digest": digest})
    reply = protocol.recv_json(conn)
    if not reply["ok"]:
        return reply
    protocol.send_payload(conn, payload)
    return protocol.recv_json(conn)


def latest(conn, rank, world=2, fit="f"):
    protocol.send_json(conn, {"op": "latest", "fit": fit, "rank": rank, "world": world, "step": 1 << 62})
    reply = protocol.recv_json(conn)
    if reply["step"] is None:
        return None
    return reply["step"], protocol.recv_payload(conn, reply["size"])


def test_a_snapshot_is_committed_only_once_every_rank_sent_its_part(keeper):
    a, b = client(keeper), client(keeper)
    assert put(a, 5, 0, b"r0@5")["committed"] is False
    assert latest(a, 0) is None  # rank 1's part has not arrived: nothing to restore
    assert put(b, 5, 1, b"r1@5")["committed"] is True
    assert latest(a, 0) == (5, b"r0@5") and latest(b, 1) == (5, b"r1@5")
    assert latest(a, 0, world=3) is None  # another world size: its parts are not this job's
    for step in (10, 15):
        put(a, step, 0, b"r0@%d" % step)
        put(b, step, 1, b"r1@%d" % step)
    assert keeper.committed_steps("f") == [10, 15]  # the newest two
    assert keeper.held_bytes() == 4 * len(b"r0@10")
    assert "committed the memory snapshot of step 5" in keeper.test_log.getvalue()


def test_an_evicted_snapshots_buffers_take_the_next_parts_but_never_one_being_sent(keeper):
    """The keeper reads new parts into the buffers of the snapshot a commit evicted (no fresh multi-GB
    allocation per snapshot), except while a part is being sent: a rank fetching step 2 that reads slowly
    gets step 2's bytes, though steps 3 to 5 arrive and evict it meanwhile."""
    size = 32 << 20  # more than the sockets buffer: the keeper's send blocks until the reader reads

    def part(step):
        return bytes([step]) * size

    writer, reader = client(keeper), client(keeper)
    for step in (1, 2):
        assert put(writer, step, 0, part(step), world=1)["committed"]
    protocol.send_json(reader, {"op": "latest", "fit": "f", "rank": 0, "world": 1, "step": 1 << 62})
    reply = protocol.recv_json(reader)  # the keeper is now sending step 2's buffer, and blocks
    for step in (3, 4, 5):
        assert put(writer, step, 0, part(step), world=1)["committed"]
    assert reply["step"] == 2 and protocol.recv_payload(reader, reply["size"]) == part(2)
    for step in (6, 7, 8):  # nothing is being sent: the evicted buffers are read into again
        assert put(writer, step, 0, part(step), world=1)["committed"]
        assert latest(reader, 0, world=1) == (step, part(step))
    assert keeper.committed_steps("f") == [7, 8] and keeper.held_bytes() == 2 * size


def test_parts_of_an_earlier_start_never_complete_a_snapshot(keeper):
    a, b = client(keeper), client(keeper)
    put(a, 5, 0, b"old", start=0)  # rank 0 of the first start sent step 5; rank 1 died first
    put(b, 5, 1, b"new", start=1)  # the restarted rank 1 reaches step 5 again
    assert latest(a, 0) is None
    put(a, 5, 0, b"new0", start=1)
    assert latest(a, 0) == (5, b"new0")


def test_a_part_the_host_cannot_hold_is_refused_for_every_rank():
    keeper = Keeper(io.StringIO(), max_bytes=10)
    try:
        a, b = client(keeper), client(keeper)
        refused = put(a, 5, 0, b"0123456")  # two parts of 7 bytes: 14 > 10
        assert refused["error"] == "memory" and "may hold 10 B" in refused["message"], refused
        assert put(b, 5, 1, b"0123456") == refused  # the same answer for every part of the snapshot
        assert not put(a, 10, 0, b"0")["ok"]  # once refused, the fit is disk-only: the ranks stop together
        assert latest(a, 0) is None
        assert keeper.held_bytes() == 0
    finally:
        keeper.close()


KILLED_MID_SEND = textwrap.dedent("""
    import os, signal, sys
    from meshfit.runtime import keeper_protocol as protocol
    address, key, start = sys.argv[1], bytes.fromhex(sys.argv[2]), int(sys.argv[3])
    conn = protocol.connect(address, key)
    payload = os.urandom(1 << 20)
    header = {"op": "put", "fit": "f", "rank": 1, "world": 2, "step": 10, "start": start, "size": len(payload),
              "digest": protocol.digest(payload)}
    protocol.send_json(conn, header)
    assert protocol.recv_json(conn)["ok"]
    protocol.send_payload(conn, payload[: len(payload) // 2])  # half the payload
    print("half sent", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.processes
def test_a_snapshot_whose_sender_was_killed_half_way_is_never_restored(keeper):
    a, b = client(keeper), client(keeper)
    put(a, 5, 0, b"r0@5")
    put(b, 5, 1, b"r1@5")
    put(a, 10, 0, b"r0@10")  # rank 0's part of step 10 arrived; rank 1 dies sending its own
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_MID_SEND, keeper.address, keeper.key.hex(), "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == -signal.SIGKILL and "half sent" in proc.stdout, proc.stderr
    time.sleep(0.2)
    assert keeper.committed_steps("f") == [5]
    assert latest(a, 0) == (5, b"r0@5") and latest(b, 1) == (5, b"r1@5")  # the previous committed one


def test_a_damaged_part_is_not_committed(keeper):
    a, b = client(keeper), client(keeper)
    put(a, 5, 0, b"r0@5")
    header = {"fit": "f", "rank": 1, "world": 2, "step": 5, "start": 0, "size": 4}
    protocol.send_json(b, {"op": "put", **header, "digest": protocol.digest(b"r1@5")})
    assert protocol.recv_json(b)["ok"]
    protocol.send_payload(b, b"r1@X")  # altered in transit
    assert protocol.recv_json(b) == {"ok": True, "committed": False, "damaged": True}
    assert keeper.committed_steps("f") == []


def test_strangers_are_closed_and_the_job_still_gets_through(keeper):
    """Silent, garbage and unauthenticated connections, then a rank with the key: served at once."""
    import socket

    port = int(keeper.address.rsplit(":", 1)[1])
    silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(8)]
    try:
        assert garbage(port, 1)
        assert unauthenticated(port)
        with pytest.raises(handshake.HANDSHAKE_ERRORS):
            protocol.connect(keeper.address, b"not the key" * 3)
        started = time.monotonic()
        a, b = client(keeper), client(keeper)
        put(a, 5, 0, b"r0")
        put(b, 5, 1, b"r1")
        assert latest(a, 0) == (5, b"r0")
        assert time.monotonic() - started < 5
    finally:
        for sock in silent:
            sock.close()
    assert "did not complete the handshake" in keeper.test_log.getvalue()


def test_a_flood_of_silent_strangers_on_the_tcp_port_does_not_shut_the_job_out(keeper):
    """Three times as many silent connections as handshakes run at once, held open: each new connection cuts
    the oldest still silent instead of being refused, so the job's ranks (over TCP, as other nodes' ranks
    reach a Ray node's keeper) connect and commit a snapshot at once."""
    import socket

    port = int(keeper.address.rsplit(":", 1)[1])
    silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(3 * Keeper._MAX_HANDSHAKES)]
    try:
        a, b = client(keeper), client(keeper)
        put(a, 5, 0, b"r0")
        assert put(b, 5, 1, b"r1")["committed"] is True
        assert latest(a, 0) == (5, b"r0")
    finally:
        for sock in silent:
            sock.close()


def test_the_ranks_of_this_node_reach_the_keeper_through_a_unix_socket_of_their_user(keeper):
    """`env()` points this node's ranks at the keeper's Unix socket (mode 0600 in a directory of mode 0700),
    which serves them as the TCP port does; it is gone when the keeper closes."""
    path = keeper.local_address[len(protocol.UNIX_PREFIX) :]
    assert keeper.env()[protocol.ENV_KEEPER_ADDRESS] == keeper.local_address
    assert (os.stat(path).st_mode & 0o777, os.stat(os.path.dirname(path)).st_mode & 0o777) == (0o600, 0o700)
    a = protocol.connect(keeper.local_address, keeper.key)
    assert put(a, 5, 0, b"r0", world=1)["committed"] is True
    assert latest(a, 0, world=1) == (5, b"r0")
    a.close()
    keeper.close()
    assert not os.path.exists(os.path.dirname(path))


def reserve(conn, step, rank, size, world=2, fit="f"):
    """Asks the keeper for shared memory for a part; the writable mapping of it, or the refusal."""
    header = {"fit": fit, "rank": rank, "world": world, "step": step, "start": 0, "size": size}
    protocol.send_json(conn, {"op": "reserve", **header})
    reply = protocol.recv_json(conn)
    if not reply["ok"]:
        return reply
    fd = protocol.recv_fd(conn)
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def local_client(keeper):
    return protocol.connect(keeper.local_address, keeper.key)


def test_a_rank_of_this_node_writes_and_reads_its_part_in_the_keepers_shared_memory(keeper):
    """Over the Unix socket the keeper lends a memfd: rank 0 writes its part in place and commits it with its
    digest, rank 1 sends its own over the connection; a restore maps rank 0's part read-only, with the digest
    it was committed with, and the memory is not recycled before the rank releases it."""
    a, b = local_client(keeper), client(keeper)
    part = os.urandom(3 << 20)
    shared = reserve(a, 5, 0, len(part))
    shared[:] = part
    protocol.send_json(a, {"op": "commit", "step": 5, "digest": protocol.digest(shared)})
    shared.close()
    assert protocol.recv_json(a)["committed"] is False
    assert put(b, 5, 1, b"r1@5")["committed"] is True
    protocol.send_json(a, {"op": "latest", "fit": "f", "rank": 0, "world": 2, "step": 1 << 62, "shared": True})
    reply = protocol.recv_json(a)
    assert (reply["step"], reply["size"], reply["shared"]) == (5, len(part), True)
    fd = protocol.recv_fd(a)
    view = mmap.mmap(fd, len(part), prot=mmap.PROT_READ)
    os.close(fd)
    assert view[:] == part and protocol.digest(view) == reply["digest"] == protocol.digest(part)
    for step in (10, 15):  # two newer snapshots evict step 5: its memory stays lent, not reused
        for conn, rank in ((b, 0), (b, 1)):
            put(conn, step, rank, bytes(len(part)) if rank == 0 else b"r1")
    assert view[:] == part
    view.close()
    protocol.send_json(a, {"op": "release"})
    assert protocol.recv_json(a) == {"ok": True}
    assert latest(b, 0)[0] == 15


def test_a_part_whose_rank_died_while_writing_it_is_never_committed(keeper):
    """A rank reserves shared memory and is gone before committing (its connection closes): the snapshot
    never counts, and the parts before it are still handed out."""
    a, b = local_client(keeper), client(keeper)
    put(b, 5, 0, b"r0@5")
    put(b, 5, 1, b"r1@5")
    shared = reserve(a, 10, 0, 4096)
    shared[:100] = b"x" * 100
    shared.close()
    a.close()
    put(b, 10, 1, b"r1@10")
    time.sleep(0.2)
    assert keeper.committed_steps("f") == [5] and latest(b, 0) == (5, b"r0@5")


def test_shared_memory_is_lent_over_the_unix_socket_only(keeper):
    a = client(keeper)  # TCP
    protocol.send_json(a, {"op": "reserve", "fit": "f", "rank": 0, "world": 1, "step": 1, "start": 0, "size": 8})
    with pytest.raises(EOFError):
        protocol.recv_json(a)  # the keeper closed the connection that broke the protocol
    assert "shared memory asked for over TCP" in keeper.test_log.getvalue()


def test_a_rank_that_breaks_the_protocol_after_the_handshake_is_closed(keeper):
    a = client(keeper)
    a.send_bytes(b"\x80\x04not json")
    with pytest.raises((EOFError, OSError)):
        a.recv_bytes()
    b = client(keeper)
    protocol.send_json(b, {"op": "put", "fit": "f", "rank": 5, "world": 2, "step": 1, "size": 1, "digest": ""})
    with pytest.raises((EOFError, OSError)):
        b.recv_bytes()
    for expect in ([1], [0, 2], "0,1"):  # ranks a replica keeper expects: must hold the sender, within the world
        c = client(keeper)
        header = {"op": "put", "fit": "f", "rank": 0, "world": 2, "step": 1, "size": 1, "digest": "", "expect": expect}
        protocol.send_json(c, header)
        with pytest.raises((EOFError, OSError)):
            c.recv_bytes()
    assert "broke the protocol" in keeper.test_log.getvalue()
    assert "expected ranks are malformed" in keeper.test_log.getvalue()


def test_the_launcher_agrees_on_the_newest_snapshot_whose_every_part_survives_a_lost_keeper():
    """Three nodes' keepers, a rank on each, two copies of every part (its node's keeper and the next one's,
    as `replica_keepers` places them). Snapshot 10 commits everywhere; snapshot 15 is cut short (rank 2 dies
    after sending to its own keeper only). Keeper 1 is lost with its node: every part of step 10 survives on
    keepers 0 and 2, and step 15 (incomplete on keeper 0) is not chosen."""
    key = os.urandom(32)
    keepers = [Keeper(io.StringIO(), key=key) for _ in range(3)]
    homes, world = [0, 1, 2], 3
    try:
        for step, senders in ((10, (0, 1, 2)), (15, (0, 1))):
            for rank in senders:
                for k in protocol.replica_keepers(homes, rank, 2):
                    expect = protocol.expected_ranks(homes, k, 2)
                    with client(keepers[k]) as conn:
                        put(conn, step, rank, f"r{rank}@{step}".encode(), world=world, expect=expect)
        with client(keepers[2]) as conn:  # rank 2's own copy of step 15: its replica on keeper 0 never came
            put(conn, 15, 2, b"r2@15", world=world, expect=protocol.expected_ranks(homes, 2, 2))
        assert protocol.replica_keepers(homes, 2, 2) == [2, 0] and protocol.expected_ranks(homes, 0, 2) == [0, 2]
        everyone = agreed_steps([k.inventory() for k in keepers])
        assert everyone["f"]["step"] == 10  # 15 is incomplete on keeper 0 (rank 2's replica missing)
        survivors = [keepers[0], keepers[2]]
        chosen = agreed_steps([k.inventory() for k in survivors])["f"]
        assert (chosen["step"], chosen["start"], chosen["world"]) == (10, 0, 3)
        assert chosen["holders"] == {0: [0], 1: [1], 2: [0, 1]}  # rank 1's part: only its replica on keeper 2
        with client(keepers[2]) as conn:  # and that replica is handed out, whole
            protocol.send_json(conn, {"op": "get", "fit": "f", "rank": 1, "world": 3, "step": 10, "start": 0})
            reply = protocol.recv_json(conn)
            assert protocol.recv_payload(conn, reply["size"]) == b"r1@10"
        assert agreed_steps([keepers[0].inventory()]) == {}  # rank 1's part is on no survivor: none agreed
        assert agreed_steps([k.inventory() for k in survivors], world=2)["f"]["step"] == 10  # onto fewer ranks
        assert agreed_steps([k.inventory() for k in survivors], world=4) == {}  # no part for a 4th rank
    finally:
        for k in keepers:
            k.close()
