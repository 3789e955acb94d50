"""The snapshot keeper: the memory tier of `BackupAndRestore(memory_freq=K)`, held by the launcher.

`meshfit launch` starts one `Keeper` (a listener and its threads in the
launcher's process) before the ranks and keeps it across `--max-restarts`, so
snapshots outlive the processes that sent them; `meshfit launch --ray` runs
one on each node that runs ranks (`meshfit.launch.ray_keepers`). Each rank
hands its part of a snapshot every K steps (`meshfit.checkpointing.memory_tier`)
to its node's keeper; under Ray that keeper sends it on, in the background, to
the keepers the rank names for its replicas on other nodes
(`meshfit.launch.replica_forwarder`; only the launch's keepers, `set_peers`). A
snapshot is *committed* at a keeper once the part of every rank it expects
(every rank of the job, on one machine; under Ray, its node's ranks' and those
it holds replicas of) has arrived whole (its digest checked on arrival, or
committed in place by its rank), and only committed snapshots are handed out:
a rank killed while sending, or a replica that never arrived, leaves a partial
one that no restart sees. Parts from an earlier start of the job never
complete a snapshot of a later one. `agreed_steps` picks, from the
inventories of the keepers left after a node is lost, the one step every
restarted rank resumes from; the launcher takes them with `final=True`, after
which no part of the starts so far is taken, so a replica still on its way
cannot change what a keeper holds after the launcher chose.

The keeper holds bytes only: it parses no array and unpickles nothing (the
frames are JSON and raw bytes, `meshfit.runtime.keeper_protocol`). It keeps
the newest two committed snapshots of each fit (by its backup directory) and
refuses a part the host cannot hold (`ENV_KEEPER_MAX_BYTES`, else half the
memory the kernel says is available), which the rank takes as its cue to back
up to disk only. Every connection proves it knows the job's key (HMAC) within
`HANDSHAKE_TIMEOUT` on a thread of its own: a stranger that stays silent,
sends garbage or lacks the key is closed and holds nothing up.

Imports nothing of JAX or numpy: the launcher starts in a fraction of a second.
"""

from __future__ import annotations

import collections
import mmap
import os
import secrets
import shutil
import sys
import tempfile
import threading
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Listener
from typing import NamedTuple, TextIO

from meshfit.launch.replica_forwarder import Forward, ReplicaForwarder
from meshfit.runtime import keeper_protocol as protocol
from meshfit.runtime.handshake import HANDSHAKE_ERRORS, handshake, shut

#: Committed snapshots kept per fit: the newest, and the one before in case the newest cannot be used.
KEEP = 2


def size_text(nbytes: int) -> str:
    """`nbytes` in the unit that reads best: "512 B", "3.2 KiB", "1.5 MiB", "2.0 GiB"."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def available_memory() -> int:
    """Bytes the kernel says can be allocated without swapping (`MemAvailable`); a large number if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 1 << 62


class _Segment:
    """Memory the keeper owns for one part: a memfd, mapped here. Ranks of this node get its descriptor over
    their Unix connection (`SCM_RIGHTS`) and write or read the part in place, at memory speed; no other
    process can map it. Freed when the keeper lets go of it (and every rank has unmapped it)."""

    def __init__(self, size: int):
        self.fd = os.memfd_create("meshfit-snapshot-part", os.MFD_CLOEXEC)
        weakref.finalize(self, os.close, self.fd)
        os.ftruncate(self.fd, size)
        self.view: mmap.mmap | bytearray = mmap.mmap(self.fd, size) if size else bytearray()

    def __len__(self) -> int:
        return len(self.view)


class _Part(NamedTuple):
    """One rank's part of a snapshot, with the `keeper_protocol.digest` it came with (checked on arrival)."""

    payload: _Segment
    digest: str


@dataclass
class _Lent:
    """What the keeper lent one connection: shared memory is lent to Unix connections (`shares`) only.

    `reserved`: the part a rank is writing into the keeper's memory (not yet committed); `leases`: parts whose
    descriptors a restoring rank may still be reading (not recycled until it says `release`)."""

    shares: bool
    reserved: tuple | None = None
    leases: int = 0


@dataclass
class _Snapshot:
    """The parts of one snapshot (one fit, one step, one start of the job) that this keeper holds, by rank.

    `expect`: the ranks whose parts this keeper holds once the snapshot is whole here (every rank of the job
    for the one keeper of `meshfit launch`; under `--ray`, the ranks whose own or replica keeper this is).
    """

    world: int
    expect: frozenset[int]
    start: int = 0
    parts: dict[int, _Part] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(len(p.payload) for p in self.parts.values())


class Keeper:
    """Holds the ranks' snapshots in this process; `env()` tells the ranks where and how to reach it.

    Args:
        log: where the keeper says what it holds (the launcher's stderr).
        max_bytes: the most bytes it holds; None: `ENV_KEEPER_MAX_BYTES`, else half of `available_memory()`
            at each part.
        host: the address it listens on: this machine only, or a Ray node's IP (`meshfit.launch.ray_keepers`).
        key: the job's secret (one for every keeper of a launch); None: a fresh one.
    """

    _MAX_HANDSHAKES = 64  # TCP connections being authenticated at once; a new one evicts the oldest

    def __init__(
        self,
        log: TextIO = sys.stderr,
        max_bytes: int | None = None,
        host: str | None = "127.0.0.1",
        key: bytes | None = None,
    ):
        if max_bytes is None and os.environ.get(protocol.ENV_KEEPER_MAX_BYTES):
            max_bytes = int(os.environ[protocol.ENV_KEEPER_MAX_BYTES])
        self.max_bytes = max_bytes
        self.key = key if key is not None else secrets.token_bytes(32)
        self.log = log
        self.closed = threading.Event()
        # The ranks of this node connect through a Unix socket in a directory only this user can enter: no
        # other user can reach it, so none can crowd the ranks out. A TCP port (for other nodes' ranks) is
        # reachable by anyone on the network; its strangers are handled by `_admit`.
        self._socket_dir = tempfile.mkdtemp(prefix="meshfit-keeper-", dir=os.environ.get("XDG_RUNTIME_DIR") or None)
        path = os.path.join(self._socket_dir, "keeper.sock")
        self._listeners = [Listener(path, family="AF_UNIX", backlog=128)]
        os.chmod(path, 0o600)
        self.local_address = protocol.UNIX_PREFIX + path
        self.address = self.local_address
        if host is not None:
            self._listeners.append(Listener((host, 0), backlog=128))  # no authkey: the handshake runs off this thread
            tcp_host, port = self._listeners[-1].address
            self.address = f"{tcp_host}:{port}"
        self.peak_bytes = 0
        self._lock = threading.Lock()
        self._newest_start = -1  # the newest start of the job whose parts came
        self._sealed = -1  # parts of starts up to this one are refused (`inventory(final=True)`)
        self._forwarder = ReplicaForwarder(self.key, self._say, self._claim, self._unclaim)
        self._via_said: set[str] = set()  # keepers whose replicas this one said it holds
        self._committed: dict[str, dict[int, _Snapshot]] = {}  # fit -> step -> snapshot
        self._pending: dict[tuple[str, int, int], _Snapshot] = {}  # (fit, start, step) -> parts so far
        self._decided: dict[tuple[str, int, int], str] = {}  # (fit, start, step) -> why refused ("": accepted)
        self._refused: dict[tuple[str, int], str] = {}  # (fit, start) -> why its snapshots are refused
        # The buffers of the snapshot the newest commit evicted, read into again by the next parts of their
        # size: a fresh multi-GB buffer costs a page fault per 4 KiB. Not while a part is being sent out.
        self._spares: list[_Segment] = []
        self._sending = 0
        self._handshaking: collections.OrderedDict[int, Connection] = collections.OrderedDict()  # TCP, oldest first
        self._stranger_seen = False
        self._said_holding: set[str] = set()
        self._threads = [
            threading.Thread(target=self._accept, args=(listener,), daemon=True, name="meshfit-keeper")
            for listener in self._listeners
        ]
        for thread in self._threads:
            thread.start()

    def env(self) -> dict[str, str]:
        """The variables that point ranks on this node at this keeper (its Unix socket)."""
        return {protocol.ENV_KEEPER_ADDRESS: self.local_address, protocol.ENV_KEEPER_AUTHKEY: self.key.hex()}

    def held_bytes(self) -> int:
        with self._lock:
            return self._held()

    def committed_steps(self, fit: str) -> list[int]:
        with self._lock:
            return sorted(self._committed.get(fit, {}))

    def set_peers(self, addresses: list[str]) -> None:
        """The TCP addresses of the launch's keepers (`meshfit.launch.ray_keepers` gives them before each
        start): the only keepers this one sends replicas on to."""
        self._forwarder.set_peers(a for a in addresses if a != self.address)

    def settle(self, timeout: float) -> bool:
        """Waits up to `timeout` seconds for the replicas this keeper sends on; whether none is left."""
        return self._forwarder.settle(timeout)

    @property
    def replica_counts(self) -> tuple[int, int]:
        """(replicas sent on that their keepers took whole, replicas that did not reach theirs), so far."""
        return self._forwarder.sent, self._forwarder.failed

    def inventory(self, final: bool = False) -> dict[str, dict]:
        """What this keeper holds, by fit: its committed snapshots' steps with their start, world size and
        the ranks whose parts it holds, and the steps of snapshots whose parts are still arriving (JSON-able:
        the Ray launcher asks every node's keeper, `agreed_steps`).

        With `final` (the launcher, about to restart the job): parts of the starts so far are refused from
        now on, replicas still on their way included, so what this returns of them stays what it holds."""
        if final:
            with self._lock:
                self._sealed = max(self._sealed, self._newest_start)
            self._forwarder.seal(self._sealed)  # (its queued replicas of those starts would be refused)
        with self._lock:
            fits: dict[str, dict] = {}
            for fit, steps in self._committed.items():
                entry = fits.setdefault(fit, {"committed": {}, "pending": []})
                for step, snapshot in steps.items():
                    entry["committed"][step] = {
                        "start": snapshot.start,
                        "world": snapshot.world,
                        "ranks": sorted(snapshot.parts),
                    }
            for fit, _, step in self._pending:
                fits.setdefault(fit, {"committed": {}, "pending": []})["pending"].append(step)
            return fits

    def close(self) -> None:
        self.closed.set()
        self._forwarder.close()
        for listener in self._listeners:
            listener.close()  # (the Unix one unlinks its socket file)
        shutil.rmtree(self._socket_dir, ignore_errors=True)
        if self.peak_bytes:
            self._say(f"held at most {size_text(self.peak_bytes)} of memory snapshots.")
        sent, failed = self.replica_counts
        if failed:
            self._say(f"{failed} of {sent + failed} replica(s) did not reach the other keeper (said above).")
        with self._lock:
            self._committed.clear()
            self._pending.clear()
            self._spares.clear()

    # -- connections -------------------------------------------------------------------

    def _accept(self, listener: Listener) -> None:
        tcp = listener is not self._listeners[0]
        while not self.closed.is_set():
            try:
                conn = listener.accept()
            except OSError:
                if self.closed.wait(0.05):
                    return
                continue
            if tcp:
                self._admit(conn)
            threading.Thread(target=self._serve, args=(conn, tcp), daemon=True, name="meshfit-keeper-conn").start()

    def _admit(self, conn: Connection) -> None:
        """Counts a TCP connection as authenticating; past `_MAX_HANDSHAKES`, the oldest still silent is cut.

        Strangers that connect and stay silent hold a slot each until their handshake's bound: were new
        connections refused while the slots are full, a flood of them would shut the job's ranks out. Cutting
        the oldest instead lets every new connection its turn, a rank's included."""
        with self._lock:
            self._handshaking[id(conn)] = conn
            while len(self._handshaking) > self._MAX_HANDSHAKES:
                _, oldest = self._handshaking.popitem(last=False)
                shut(oldest)  # (its handshake's thread ends)

    def _serve(self, conn: Connection, tcp: bool) -> None:
        try:
            try:
                handshake(conn, self.key, accepting=True)
            finally:
                if tcp:
                    with self._lock:
                        self._handshaking.pop(id(conn), None)
        except HANDSHAKE_ERRORS as error:
            conn.close()
            self._stranger(error)
            return
        lent = _Lent(shares=not tcp)
        try:
            while not self.closed.is_set():
                request = protocol.recv_json(conn)
                self._handle(conn, request, lent)
        except (EOFError, OSError):
            pass  # the rank closed its connection, died, or stopped moving the bytes it announced
        except protocol.ProtocolError as error:
            self._say(f"closed a connection of the job that broke the protocol: {error}.")
        finally:
            conn.close()
            with self._lock:
                self._sending -= lent.leases  # parts it was reading: free to recycle
            lent.reserved = None  # a part never committed (its rank died writing it): its memory goes

    def _stranger(self, error: BaseException) -> None:
        if self._stranger_seen:
            return
        self._stranger_seen = True
        why = f"{type(error).__name__}: {str(error) or 'silent, or closed'}"
        self._say(
            f"closed a connection to {self.address} that did not complete the handshake ({why}); it is not one "
            "of the job's processes. Further ones are closed without a word."
        )

    def _say(self, line: str) -> None:
        self.log.write(f"[launch] keeper: {line}\n")
        self.log.flush()

    # -- requests ----------------------------------------------------------------------

    def _handle(self, conn: Connection, request: dict, lent: _Lent) -> None:
        op = request.get("op")
        if op == "put":
            self._put(conn, request)
        elif op == "reserve":
            self._reserve(conn, request, lent)
        elif op == "commit":
            self._commit_reserved(conn, request, lent)
        elif op == "latest":
            self._latest(conn, request, lent)
        elif op == "get":
            self._get(conn, request, lent)
        elif op == "release":
            if lent.leases:
                lent.leases -= 1
                with self._lock:
                    self._sending -= 1
            protocol.send_json(conn, {"ok": True})
        elif op == "drop":
            self._drop(conn, str(request.get("fit")), forwarded=bool(request.get("forwarded")))
        elif op == "settle":
            settled = self._forwarder.settle(protocol.settle_timeout(), str(request.get("fit")))
            protocol.send_json(conn, {"ok": True, "settled": settled})
        else:
            raise protocol.ProtocolError(f"an unknown request {str(op)[:40]!r}")

    @staticmethod
    def _fields(request: dict) -> tuple[str, int, int, int, int]:
        try:
            fit, step, rank, world, start = (
                request["fit"],
                request["step"],
                request["rank"],
                request["world"],
                request.get("start", 0),
            )
        except KeyError as missing:
            raise protocol.ProtocolError(f"a request without {missing}") from None
        ints = (step, rank, world, start)
        if not isinstance(fit, str) or not all(type(v) is int for v in ints) or not 0 <= rank < world:
            raise protocol.ProtocolError(f"a request with malformed fields {str(request)[:200]}")
        return fit, step, rank, world, start

    def _room(self, size: int, world: int) -> str | None:
        """Why a snapshot of `world` parts like one of `size` bytes cannot be held (None when it can)."""
        held = self._held()
        if self.max_bytes is not None:
            if held + world * size > self.max_bytes:
                return (
                    f"a snapshot of {world} part(s) of {size_text(size)} does not fit: the keeper holds "
                    f"{size_text(held)} and may hold {size_text(self.max_bytes)} ({protocol.ENV_KEEPER_MAX_BYTES})"
                )
            return None
        # Steady state: KEEP committed snapshots and one arriving, `world` parts each.
        needed = (KEEP + 1) * world * size - held
        free = available_memory() // 2
        if needed > free:
            return (
                f"holding the snapshots needs {size_text(needed)} more, and half the host's available memory is "
                f"{size_text(free)}"
            )
        return None

    def _part_fields(self, request: dict) -> tuple[tuple, dict | None]:
        """A part's fields (fit, step, rank, world, start, size, expect) and the refusal to answer (None: it is
        taken): one answer for every part of a snapshot, and none after a refusal, so the ranks stop sending
        together (a snapshot's device copy is one program across all of them)."""
        fit, step, rank, world, start = self._fields(request)
        size = request.get("size")
        if type(size) is not int or size < 0:
            raise protocol.ProtocolError("a part without its size")
        expect = _ranks(request.get("expect", list(range(world))), rank, world)
        fields = (fit, step, rank, world, start, size, expect)
        with self._lock:
            if start <= self._sealed:
                return fields, self._restarted(start)
            self._newest_start = max(self._newest_start, start)
            refusal = self._refused.get((fit, start)) or self._decided.get((fit, start, step), "")
            if (fit, start, step) not in self._decided and not refusal:
                refusal = self._room(size, len(set(expect))) or ""
                self._decided[(fit, start, step)] = refusal
            if refusal:
                self._refused[(fit, start)] = refusal
        return fields, ({"ok": False, "error": "memory", "message": refusal} if refusal else None)

    def _restarted(self, start: int) -> dict:
        """The answer to a part of a start the launcher restarted the job after (`inventory(final=True)`)."""
        return {
            "ok": False,
            "error": "restarted",
            "message": f"the launcher restarted the job after start {start}: its snapshots are no longer taken",
        }

    @staticmethod
    def _replicas(request: dict, fields: tuple) -> list[tuple[str, list[int]]]:
        """The keepers a rank names for replicas of its part, with the ranks each expects (none: no replicas)."""
        named = request.get("replicas", [])
        if not isinstance(named, list) or len(named) > 64 or not all(isinstance(r, dict) for r in named):
            raise protocol.ProtocolError(f"a part whose replicas are malformed {str(named)[:200]}")
        replicas = []
        for replica in named:
            address = replica.get("address")
            if not isinstance(address, str) or not 0 < len(address) <= 300:
                raise protocol.ProtocolError(f"a replica without its keeper's address {str(replica)[:200]}")
            replicas.append((address, _ranks(replica.get("expect"), fields[2], fields[3], "replica")))
        return replicas

    def _segment(self, size: int) -> _Segment:
        """Memory for a part of `size` bytes: an evicted snapshot's (already paged in), else new."""
        with self._lock:
            spare = next((b for b in self._spares if len(b) == size), None)
            if spare is not None:
                self._spares.remove(spare)
        return spare if spare is not None else _Segment(size)

    def _put(self, conn: Connection, request: dict) -> None:
        """A part sent over the connection (a rank without this node's shared memory, or another keeper
        sending a replica on: `via`), checked on arrival."""
        fields, refusal = self._part_fields(request)
        digest, via = request.get("digest"), request.get("via")
        if not isinstance(digest, str):
            raise protocol.ProtocolError("a put without its digest")
        replicas = self._replicas(request, fields)
        if refusal:
            protocol.send_json(conn, refusal)
            return
        protocol.send_json(conn, {"ok": True})
        segment = self._segment(fields[5])
        protocol.set_timeout(conn, protocol.ANSWER_TIMEOUT)  # a rank stopped mid-part frees this thread
        protocol.recv_payload(conn, fields[5], into=segment.view)
        protocol.set_timeout(conn, 0)  # between requests a rank's connection idles as long as its steps take
        if protocol.digest(segment.view) != digest:
            protocol.send_json(conn, {"ok": True, "committed": False, "damaged": True})  # never committed
            return
        part = _Part(segment, digest)
        reply = self._add_part(fields, part)
        self._send_on(fields, part, replicas, reply)  # (queued before the answer: a `settle` after it waits for them)
        if reply["ok"] and isinstance(via, str) and via not in self._via_said:
            self._via_said.add(via)
            self._say(f"holds replicas that the keeper at {via[:100]} sends on from its node's ranks.")
        protocol.send_json(conn, reply)

    def _reserve(self, conn: Connection, request: dict, lent: _Lent) -> None:
        """Memory for a part that a rank of this node writes itself: the keeper's own (a memfd), its descriptor
        passed over the Unix connection (no one else can map it); the part counts once the rank commits it."""
        if not lent.shares:
            raise protocol.ProtocolError("shared memory asked for over TCP")
        fields, refusal = self._part_fields(request)
        if refusal:
            protocol.send_json(conn, refusal)
            return
        lent.reserved = (fields, self._segment(fields[5]))
        protocol.send_json(conn, {"ok": True})
        protocol.send_fd(conn, lent.reserved[1].fd)

    def _commit_reserved(self, conn: Connection, request: dict, lent: _Lent) -> None:
        """The part written into the memory `_reserve` lent, with its digest (computed by its rank over these
        very bytes; each replica's keeper checks them on arrival): counted as if sent."""
        digest, step = request.get("digest"), request.get("step")
        if lent.reserved is None or not isinstance(digest, str) or step != lent.reserved[0][1]:
            raise protocol.ProtocolError("a commit without its reserved part, step or digest")
        replicas = self._replicas(request, lent.reserved[0])
        (fields, segment), lent.reserved = lent.reserved, None
        part = _Part(segment, digest)
        reply = self._add_part(fields, part)
        self._send_on(fields, part, replicas, reply)
        protocol.send_json(conn, reply)

    def _send_on(self, fields: tuple, part: _Part, replicas: list[tuple[str, list[int]]], reply: dict) -> None:
        """Queues the replicas of a part this keeper now holds (`reply`: its answer to the part's rank) for the
        keepers its rank named, each sent from this keeper's memory on a thread of the forwarder."""
        if not reply["ok"]:
            return
        fit, step, rank, world, start, size, _ = fields
        header = {"op": "put", "fit": fit, "rank": rank, "world": world, "step": step, "start": start}
        header.update(size=size, digest=part.digest, via=self.address)
        for address, expect in replicas:
            self._forwarder.forward(address, Forward({**header, "expect": expect}, part))

    def _claim(self, forward: Forward) -> mmap.mmap | bytearray | None:
        """The bytes of a part queued to be sent on, counted as being sent (`_sending`: its memory is not
        reused until `_unclaim`); None when this keeper no longer holds it (evicted, dropped)."""
        header = forward.header
        fit, step, start, rank = header["fit"], header["step"], header["start"], header["rank"]
        with self._lock:
            held = self._committed.get(fit, {}).get(step)
            if held is None or held.start != start:
                held = self._pending.get((fit, start, step))
            if held is None or held.parts.get(rank) is not forward.part:
                return None
            self._sending += 1
            return forward.part.payload.view

    def _unclaim(self) -> None:
        with self._lock:
            self._sending -= 1

    def _drop(self, conn: Connection, fit: str, forwarded: bool) -> None:
        """Forgets `fit`'s snapshots (the fit ended). Asked by a rank, this keeper also tells the keepers it sent
        replicas of `fit` to, after the replica each is being sent, and answers once they have (or after
        `settle_timeout`), so no replica arrives after the fit was dropped there."""
        with self._lock:
            self._committed.pop(fit, None)
            for key in [k for k in self._pending if k[0] == fit]:
                del self._pending[key]
            self._spares.clear()
        dropped = True
        if not forwarded:
            self._forwarder.drop(fit)
            dropped = self._forwarder.settle(protocol.settle_timeout(), fit)
        protocol.send_json(conn, {"ok": True, "replicas_dropped": dropped})

    def _add_part(self, fields: tuple, part: _Part) -> dict:
        """Adds a rank's whole part to its snapshot, committing the snapshot once every part is there; the
        answer to the rank."""
        fit, step, rank, world, start, _, expect = fields
        committed = None
        with self._lock:
            if start <= self._sealed:
                return self._restarted(start)
            # Parts of an earlier start of the job never complete a snapshot of this one.
            for key in [k for k in self._pending if k[0] == fit and k[1] < start]:
                del self._pending[key]
            snapshot = self._pending.setdefault((fit, start, step), _Snapshot(world, frozenset(expect), start))
            if snapshot.world == world and snapshot.expect == frozenset(expect):
                snapshot.parts[rank] = part
            if set(snapshot.parts) == snapshot.expect:
                committed = self._commit(fit, start, step)
            self.peak_bytes = max(self.peak_bytes, self._held())
            held = self._held()
        if committed is not None and fit not in self._said_holding:
            self._said_holding.add(fit)
            self._say(
                f"committed the memory snapshot of step {step} (parts of {len(expect)} of {world} process(es), "
                f"{size_text(committed)}); "
                f"holding {size_text(held)} (at most the newest {KEEP} snapshots of each process)."
            )
        return {"ok": True, "committed": committed is not None, "held": held}

    def _commit(self, fit: str, start: int, step: int) -> int:
        snapshot = self._pending.pop((fit, start, step))
        steps = self._committed.setdefault(fit, {})
        steps[step] = snapshot
        evicted = [steps.pop(old) for old in sorted(steps)[:-KEEP]]
        if not self._sending:
            self._spares = [p.payload for old in evicted for p in old.parts.values()]
        for key in [k for k in self._pending if k[0] == fit and k[2] <= step]:
            del self._pending[key]
        for key in [k for k in self._decided if k[0] == fit and k[2] <= step]:
            del self._decided[key]
        return snapshot.nbytes

    def _latest(self, conn: Connection, request: dict, lent: _Lent) -> None:
        fit, below, rank, world, _ = self._fields(request)
        with self._lock:
            steps = self._committed.get(fit, {})
            # A smaller world (an elastic restart) gets the part of its own rank in the larger one: the rank
            # decides whether that part alone holds its arrays (`snapshot_parts.unpack`).
            found = [s for s in sorted(steps) if s < below and steps[s].world >= world]
            step = found[-1] if found else None
            saved = steps[step] if step is not None else None
            self._sending += 1
        self._send_part(conn, step, saved, rank, lent, bool(request.get("shared")))

    def _get(self, conn: Connection, request: dict, lent: _Lent) -> None:
        """This rank's part of the committed snapshot of exactly `step` (and `start`, when given), if held."""
        fit, step, rank, _, _ = self._fields(request)
        start = request.get("start")
        with self._lock:
            saved = self._committed.get(fit, {}).get(step)
            if saved is not None and start is not None and saved.start != start:
                saved = None
            self._sending += 1
        self._send_part(conn, step, saved, rank, lent, bool(request.get("shared")))

    def _send_part(
        self, conn: Connection, step: int | None, saved: _Snapshot | None, rank: int, lent: _Lent, shared: bool
    ) -> None:
        """Rank `rank`'s part of `saved` with the digest it came with: the rank checks the bytes end to end.
        The caller counted it in `_sending` under the lock it found `saved` with: no buffer is recycled while
        one is sent. With `shared` (a rank of this node, over the Unix socket) the part's descriptor is lent
        instead of its bytes sent, and stays counted until the rank says `release` (or closes)."""
        lease = False
        try:
            part = saved.parts.get(rank) if saved is not None else None
            if saved is None or part is None:
                protocol.send_json(conn, {"step": None})
                return
            reply = {"step": step, "size": len(part.payload), "digest": part.digest, "world": saved.world}
            protocol.set_timeout(conn, protocol.ANSWER_TIMEOUT)  # a stopped reader frees the part's buffer
            if shared and lent.shares:
                protocol.send_json(conn, {**reply, "shared": True})
                protocol.send_fd(conn, part.payload.fd)
                lease = True
                lent.leases += 1
            else:
                protocol.send_json(conn, reply)
                protocol.send_payload(conn, part.payload.view)
            protocol.set_timeout(conn, 0)
        finally:
            if not lease:
                with self._lock:
                    self._sending -= 1

    def _held(self) -> int:
        committed = sum(s.nbytes for steps in self._committed.values() for s in steps.values())
        return committed + sum(s.nbytes for s in self._pending.values())


def _ranks(expect, rank: int, world: int, what: str = "part") -> list[int]:
    """`expect` checked: the ranks of `world` a keeper expects parts of, `rank` (the sender) among them."""
    if not isinstance(expect, list) or not all(type(r) is int and 0 <= r < world for r in expect) or rank not in expect:
        raise protocol.ProtocolError(f"a {what} whose expected ranks are malformed {str(expect)[:200]}")
    return expect


def agreed_steps(inventories: list[dict[str, dict]], world: int = 1) -> dict[str, dict]:
    """The snapshot each fit resumes from, given the `inventory()` of every keeper still reachable.

    Per fit: the newest committed (step, start) whose part of every rank of its world some keeper holds,
    and that no keeper holds still incomplete (a snapshot cut short by the failure: some part or replica
    never arrived), taken by a job of at least `world` processes (the restarted job's: rank r reads rank
    r's part, so a smaller job's snapshot has no part for the ranks a larger restart adds). Returns
    {fit: {"step", "start", "world", "holders": {rank: [keeper index, ...]}}}; a fit with no such snapshot
    is absent (it resumes from disk). Every rank restores this one step, so the restarted job agrees on it
    even when the keeper that held a part is gone with its node.
    """
    chosen: dict[str, dict] = {}
    for fit in sorted({fit for inventory in inventories for fit in inventory}):
        pending = {step for inventory in inventories for step in inventory.get(fit, {}).get("pending", [])}
        holders: dict[tuple[int, int, int], dict[int, list[int]]] = {}
        for index, inventory in enumerate(inventories):
            for step, held in inventory.get(fit, {}).get("committed", {}).items():
                by_rank = holders.setdefault((int(step), held["start"], held["world"]), {})
                for rank in held["ranks"]:
                    by_rank.setdefault(rank, []).append(index)
        for step, start, saved in sorted(holders, reverse=True):
            by_rank = holders[(step, start, saved)]
            if step not in pending and saved >= world and set(by_rank) == set(range(saved)):
                chosen[fit] = {"step": step, "start": start, "world": saved, "holders": by_rank}
                break
    return chosen
