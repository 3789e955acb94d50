"""A keeper's replicas on other nodes' keepers: parts sent on in the background, off the ranks' path.

Under `meshfit launch --ray` a rank hands its part of a snapshot to its own node's keeper only, naming the
keepers that hold replicas of it (`keeper_protocol.replica_keepers`, by the addresses the launcher gave
the ranks) and the ranks each of them expects. Once the part is whole there (written into the keeper's
shared memory and committed, or sent and checked on arrival), that keeper sends it on to each of them
with the `put` every keeper serves (`keeper_protocol.send_part`), straight from the memory it holds the
part in, on one authenticated connection per peer kept across snapshots. The rank's sender thread is free
as soon as its own keeper holds the part.

Each peer has a thread and a queue holding at most one part per (fit, rank), the newest: a peer slower
than the snapshots gets the newest of them, never a backlog. A peer that is gone, stopped or refuses costs
only its own thread a bounded wait (`connect`'s handshake and every stall `ANSWER_TIMEOUT`, the peer's
check `reply_timeout`), and the first such failure of each peer is said once in the keeper's log. Only
the launch's keepers are peers (`set_peers`): no request makes a keeper connect anywhere else.

Imports nothing of JAX: the launcher imports this module.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

from meshfit.runtime import keeper_protocol as protocol
from meshfit.runtime.handshake import HANDSHAKE_ERRORS, shut

#: What talking to a peer raises when it is gone, stopped, slow past its bounds, or not the launch's keeper.
PEER_ERRORS = (*HANDSHAKE_ERRORS, EOFError, protocol.ProtocolError)


class Forward(NamedTuple):
    """One part to send on: the `put` header the peer reads (its `fit`, `rank`, `step`, `start`, `size`,
    `digest`, and the ranks the peer `expect`s), and the part as the sending keeper holds it (handed to the
    forwarder's `claim`, which gives its bytes if the keeper still holds them)."""

    header: dict
    part: Any


class _Drop(NamedTuple):
    """Tells a peer that a fit ended: it forgets the fit's snapshots, after every part sent before."""

    fit: str


@dataclass
class _Peer:
    """One peer keeper: its queue of parts and drops (oldest first), what it is sending now, its connection."""

    address: str
    queue: collections.OrderedDict[tuple, Forward | _Drop] = field(default_factory=collections.OrderedDict)
    busy: Forward | _Drop | None = None
    conn: Connection | None = None
    fits: set[str] = field(default_factory=set)  # fits whose parts it was given (told when one is dropped)
    failed: bool = False  # its first failure was said


class ReplicaForwarder:
    """Sends parts on to the launch's other keepers, a thread per peer.

    Args:
        key: the launch's key (every keeper of a launch has the same one).
        say: writes one line to the keeper's log.
        claim: `claim(forward)` -> the part's bytes if its keeper still holds it, now counted as being sent
            (its memory is not reused until `release`); None if it was evicted (a newer snapshot took its place).
        release: `release()` ends what `claim` counted.
    """

    def __init__(
        self,
        key: bytes,
        say: Callable[[str], None],
        claim: Callable[[Forward], Any],
        release: Callable[[], None],
    ):
        self._key, self._say, self._claim, self._release = key, say, claim, release
        self._known: frozenset[str] = frozenset()
        self._unknown_said: set[str] = set()
        self._peers: dict[str, _Peer] = {}
        self._changed = threading.Condition()
        self._closed = False
        self.sent = 0  # parts a peer took whole
        self.failed = 0  # parts that did not reach their peer (gone, stopped, refused, damaged)

    def set_peers(self, addresses: Iterable[str]) -> None:
        """The launch's keepers' TCP addresses (`host:port`): the only ones parts are sent on to."""
        with self._changed:
            self._known = frozenset(addresses)

    def forward(self, address: str, forward: Forward) -> bool:
        """Queues `forward` for the keeper at `address` (replacing a part of the same fit and rank not yet
        sent); False, said once, when `address` is not one of the launch's keepers (nothing is sent)."""
        header = forward.header
        with self._changed:
            if self._closed:
                return False
            if address not in self._known:
                said = address in self._unknown_said
                self._unknown_said.add(address)
            else:
                peer = self._peers.get(address)
                if peer is None:
                    peer = self._peers[address] = _Peer(address)
                    thread = threading.Thread(target=self._run, args=(peer,), daemon=True, name="meshfit-replicas")
                    thread.start()
                key = ("put", header["fit"], header["rank"])
                peer.queue.pop(key, None)
                peer.queue[key] = forward
                peer.fits.add(header["fit"])
                self._changed.notify_all()
                return True
        if not said:
            self._say(
                f"a rank named {address[:100]!r} for a replica of its part, which is not one of the launch's "
                f"{len(self._known)} other keeper(s); no replica is sent there."
            )
        return False

    def drop(self, fit: str) -> None:
        """Tells every peer that was given parts of `fit` to forget its snapshots, after the part it is sending
        (parts of `fit` still queued are not sent)."""
        with self._changed:
            for peer in self._peers.values():
                for key in [k for k in peer.queue if k[1] == fit]:
                    del peer.queue[key]
                if fit in peer.fits:
                    peer.fits.discard(fit)
                    peer.queue[("drop", fit)] = _Drop(fit)
            self._changed.notify_all()

    def seal(self, start: int) -> None:
        """Drops the queued parts of the job's starts up to `start` (the launcher restarts the job: every
        keeper refuses them now, `Keeper.inventory(final=True)`)."""
        with self._changed:
            for peer in self._peers.values():
                for key in [k for k, job in peer.queue.items() if isinstance(job, Forward)]:
                    if peer.queue[key].header["start"] <= start:
                        del peer.queue[key]

    def settle(self, timeout: float, fit: str | None = None) -> bool:
        """Waits up to `timeout` seconds until no part (of `fit`, or of any fit) is queued or being sent;
        whether none is."""

        def of_fit(job) -> bool:
            if job is None:
                return False
            return fit is None or (job.fit if isinstance(job, _Drop) else job.header["fit"]) == fit

        def settled() -> bool:
            return not any(of_fit(p.busy) or any(of_fit(j) for j in p.queue.values()) for p in self._peers.values())

        with self._changed:
            return self._changed.wait_for(settled, timeout=timeout)

    def close(self) -> None:
        """Ends the peers' threads; a part being sent fails at once (its connection is closed under it)."""
        with self._changed:
            self._closed = True
            for peer in self._peers.values():
                peer.queue.clear()
            self._changed.notify_all()
            conns = [p.conn for p in self._peers.values() if p.conn is not None]
        for conn in conns:
            shut(conn)

    # -- a peer's thread -----------------------------------------------------------------

    def _run(self, peer: _Peer) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: peer.queue or self._closed)
                if self._closed:
                    break
                _, peer.busy = peer.queue.popitem(last=False)
                job = peer.busy
            try:
                self._send(peer, job)
            finally:
                with self._changed:
                    peer.busy = None
                    self._changed.notify_all()
        if peer.conn is not None:
            peer.conn.close()

    def _send(self, peer: _Peer, job: Forward | _Drop) -> None:
        payload = None if isinstance(job, _Drop) else self._claim(job)
        if payload is None and isinstance(job, Forward):
            return  # evicted while queued: a newer snapshot of it is on its way
        try:
            if peer.conn is None:
                peer.conn = protocol.connect(peer.address, self._key)
            if isinstance(job, _Drop):
                protocol.send_json(peer.conn, {"op": "drop", "fit": job.fit, "step": 0, "forwarded": True})
                reply = protocol.recv_json(peer.conn)
            else:
                reply = protocol.send_part(peer.conn, job.header, payload)
        except PEER_ERRORS as error:
            if peer.conn is not None:  # its frames are out of step: the next part reconnects
                peer.conn.close()
                peer.conn = None
            reply = {"ok": False, "message": protocol.error_text(error)}
        finally:
            if payload is not None:
                self._release()
        if isinstance(job, _Drop):
            return
        if reply.get("ok") and not reply.get("damaged"):
            with self._changed:
                self.sent += 1
            return
        if reply.get("error") == "restarted":
            return  # a part of a start the launcher restarted after: not a failure of the peer
        why = reply.get("message") or ("the part arrived damaged" if reply.get("damaged") else "refused")
        with self._changed:
            self.failed += 1
            first, peer.failed = not peer.failed, True
        if first:
            header = job.header
            self._say(
                f"could not send the replica of rank {header['rank']}'s part of step {header['step']} on to the "
                f"keeper at {peer.address} ({why}); the snapshot counts on the keepers that hold it, and no rank "
                "waited. Later failures to reach that keeper are not said."
            )
