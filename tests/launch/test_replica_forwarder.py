"""A keeper sends the replicas its ranks name on to the launch's other keepers, in the background.

Real keepers and sockets: a rank is a client speaking the protocol (`meshfit.runtime.keeper_protocol`);
a peer that never answers is a real listening socket that accepts and stays silent. The rank-level checks
(a fit's snapshots, a stopped or gone replica keeper) are in tests/checkpointing/test_memory_tier.py.
"""

import io
import os
import socket
import threading

import pytest

from meshfit.launch.keeper import Keeper
from meshfit.runtime import keeper_protocol as protocol


@pytest.fixture
def pair():
    """Two keepers of one launch (one key), each told the other's address as `ray_keepers` does."""
    key = os.urandom(32)
    keepers = [Keeper(io.StringIO(), key=key) for _ in range(2)]
    for keeper in keepers:
        keeper.set_peers([k.address for k in keepers])
    yield keepers
    for keeper in keepers:
        keeper.close()


class SilentPeer:
    """A TCP listener that accepts connections and never says a word (a stopped keeper's port), counting them."""

    def __init__(self):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.accepted = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def close(self):
        self.server.close()
        for conn in self.accepted:
            conn.close()


def put(keeper, step, rank, payload, world=1, replicas=(), start=0):
    """Rank `rank`'s part of step `step` sent to `keeper`, naming `replicas` ((address, expected ranks), ...)."""
    header = {"op": "put", "fit": "f", "rank": rank, "world": world, "step": step, "start": start}
    header.update(size=len(payload), digest=protocol.digest(payload), expect=list(range(world)))
    header["replicas"] = [{"address": a, "expect": e} for a, e in replicas]
    with protocol.connect(keeper.address, keeper.key) as conn:
        return protocol.send_part(conn, header, payload)


def latest(keeper, rank=0, world=1):
    with protocol.connect(keeper.address, keeper.key) as conn:
        protocol.send_json(conn, {"op": "latest", "fit": "f", "rank": rank, "world": world, "step": 1 << 62})
        reply = protocol.recv_json(conn)
        return None if reply["step"] is None else (reply["step"], bytes(protocol.recv_payload(conn, reply["size"])))


def test_a_part_is_sent_on_to_the_keeper_its_rank_names_from_the_keepers_memory(pair):
    own, other = pair
    reply = put(own, 5, 0, b"r0@5", replicas=[(other.address, [0])])
    assert reply["ok"] and reply["committed"]  # the rank's answer: its own keeper holds the part
    assert own.settle(30)
    assert latest(other) == (5, b"r0@5") and other.committed_steps("f") == [5]
    assert own.replica_counts == (1, 0)
    assert f"holds replicas that the keeper at {own.address} sends on" in other.log.getvalue()


def test_a_keeper_never_connects_to_an_address_that_is_not_one_of_the_launchs_keepers(pair):
    """A rank names a listening port that is no keeper of the launch: nothing connects to it, the part is
    still held by the rank's own keeper, and the keeper says so once."""
    own, _ = pair
    stranger = SilentPeer()
    try:
        for step in (1, 2):
            assert put(own, step, 0, b"part", replicas=[(stranger.address, [0])])["committed"]
        assert own.settle(30) and own.committed_steps("f") == [1, 2]
        assert stranger.accepted == []
        said = [ln for ln in own.log.getvalue().splitlines() if "not one of the launch's" in ln]
        assert len(said) == 1 and stranger.address in said[0], own.log.getvalue()
    finally:
        stranger.close()


def test_a_replica_evicted_before_its_turn_is_not_sent(monkeypatch):
    """The peer holds the keeper's thread for it (it accepts and never answers: `ANSWER_TIMEOUT`, 1 s here).
    Meanwhile rank 0's part of step 2 waits in the queue, and steps 3 and 4 commit and evict step 2: when its
    turn comes, the keeper no longer holds it (its memory may hold another part by then), so it is not sent."""
    monkeypatch.setattr(protocol, "ANSWER_TIMEOUT", 1.0)
    own, peer = Keeper(io.StringIO()), SilentPeer()
    try:
        own.set_peers([peer.address])
        to_peer = [(peer.address, [0])]
        put(own, 1, 0, b"r0@1", world=2, replicas=to_peer)  # its replica is being sent: the thread waits
        put(own, 1, 1, b"r1@1", world=2)
        put(own, 2, 0, b"r0@2", world=2, replicas=to_peer)  # queued behind it
        for step in (2, 3, 4):  # rank 0's parts of 3 and 4 name no replica: step 2's stays queued
            put(own, step, 1, f"r1@{step}".encode(), world=2)
            if step > 2:
                put(own, step, 0, f"r0@{step}".encode(), world=2)
        assert own.committed_steps("f") == [3, 4]  # step 2 evicted
        assert own.settle(30)
        assert len(peer.accepted) == 1  # step 1's try only: step 2's replica was never sent
        assert own.replica_counts == (0, 1)
    finally:
        own.close()
        peer.close()


def test_a_final_inventory_refuses_later_parts_of_the_starts_so_far(pair):
    """The launcher asks before a restart (`final=True`): a part of a start so far that arrives after it (a
    replica still on its way, a rank not yet gone) is refused, so the inventory the launcher chose from stays
    what the keeper holds; the restarted job's parts are taken. Such a refusal is no failure of the peer."""
    own, other = pair
    put(other, 5, 0, b"r0@5")
    held = other.inventory(final=True)
    assert put(other, 10, 0, b"r0@10")["error"] == "restarted"
    assert put(own, 10, 0, b"r0@10", replicas=[(other.address, [0])])["committed"]  # own was not asked
    assert own.settle(30) and own.replica_counts == (0, 0)  # refused by the other: not a failure, not said
    assert other.inventory() == held
    assert put(other, 10, 0, b"r0@10 of the restart", start=1)["committed"]
    assert "could not send" not in own.log.getvalue()


def test_a_dropped_fit_is_dropped_on_the_replicas_keepers_after_the_replicas_on_their_way(pair):
    own, other = pair
    for step in (1, 2, 3):
        put(own, step, 0, b"part", replicas=[(other.address, [0])])
    with protocol.connect(own.address, own.key) as conn:
        protocol.send_json(conn, {"op": "drop", "fit": "f", "step": 0})
        assert protocol.recv_json(conn) == {"ok": True, "replicas_dropped": True}
    assert own.committed_steps("f") == other.committed_steps("f") == []
    assert other.held_bytes() == 0


@pytest.mark.parametrize(
    "replicas",
    ["127.0.0.1:1", [["127.0.0.1:1", [0]]], [{"address": 5, "expect": [0]}], [{"address": "a:1", "expect": [1]}]],
    ids=["not a list", "not objects", "address not a string", "expect without the sender"],
)
def test_malformed_replicas_close_the_connection(pair, replicas):
    own, _ = pair
    header = {"op": "put", "fit": "f", "rank": 0, "world": 1, "step": 1, "size": 1, "digest": "", "replicas": replicas}
    with protocol.connect(own.address, own.key) as conn:
        protocol.send_json(conn, header)
        with pytest.raises((EOFError, OSError)):
            conn.recv_bytes()
    assert "replica" in own.log.getvalue() and "broke the protocol" in own.log.getvalue()
