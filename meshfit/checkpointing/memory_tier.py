"""The memory tier of `BackupAndRestore`: snapshots of a backup kept in the launcher's RAM.

Every K steps each process sends the launcher's keeper
(`meshfit.launch.keeper`; under `meshfit launch --ray`, its node's keeper and
`replicas - 1` other nodes' keepers) its part of exactly what a disk backup holds (the
tree and JSON part of `checkpoint_schema.BACKUP`). Taking one holds the loop
for a copy of this process's shards on its own devices (a program per local
device, none across processes: one across processes costs the steps around
it a collective's wait); a thread then copies them to the host, skips a
state that is not finite (as the disk tier refuses one), packs them into one
part and sends it with its digest (`keeper_protocol.digest`: SHA-256 over
pieces hashed on several cores), which the keeper checks on arrival and the
process again when it fetches the part back. A restarted process asks the
keeper for the newest committed snapshot (under Ray: for the step the
launcher chose, from any keeper that holds its part) and rebuilds its arrays,
laid out as the live state, from the shards it had; a part whose digest does
not match is never restored.

A part's bytes, and how a tree becomes one and back, are
`meshfit.checkpointing.snapshot_parts`'s.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax

from meshfit.checkpointing import snapshot_parts as parts
from meshfit.checkpointing.job_fingerprint import BackupOfAnotherJob
from meshfit.runtime import keeper_protocol as protocol
from meshfit.runtime.handshake import HANDSHAKE_ERRORS

#: `latest` asks for the newest snapshot below this step: any.
NEWEST = 1 << 62


#: Snapshots a process may have started and not yet sent: one being sent while the next one's copies wait
#: for the steps before them.
IN_FLIGHT = 2


class MemoryTierUnavailable(RuntimeError):
    """The keeper cannot hold snapshots (no room on the host, or it is gone): back up to disk only."""


#: What talking to a keeper raises when it is gone, stopped, slow past `keeper_protocol.ANSWER_TIMEOUT`, or
#: not the job's (a failed handshake, a broken frame).
KEEPER_ERRORS = (*HANDSHAKE_ERRORS, EOFError, protocol.ProtocolError)


def error_text(error: BaseException) -> str:
    """`error` for a one-line warning: its type, and its message where it has one."""
    text = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
    if isinstance(error, BlockingIOError):
        text = f"no answer within {protocol.ANSWER_TIMEOUT:g} s"
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class MemoryTier:
    """This process's side of the keeper, for one fit (`fit`: its backup directory).

    `save` starts a snapshot and returns; `latest` fetches the newest committed one.
    """

    def __init__(self, fit: str, replicas: int = 1):
        if not protocol.available():
            raise MemoryTierUnavailable(
                "no snapshot keeper: `memory_freq` needs a launcher that keeps snapshots, "
                f"{protocol.LAUNCHERS_WITH_KEEPER}."
            )
        self.fit = fit
        self.rank = jax.process_index()
        self.world = jax.process_count()
        self.start = int(os.environ.get("MESHFIT_RESTART_COUNT", "0"))
        self.addresses = protocol.addresses()
        self._local = protocol.local_addresses()
        homes = protocol.homes(self.world)
        if len(homes) != self.world or max(homes) >= len(self.addresses):
            raise MemoryTierUnavailable(
                f"{protocol.ENV_KEEPER_HOMES}={os.environ.get(protocol.ENV_KEEPER_HOMES)!r} does not name a keeper "
                f"of {protocol.ENV_KEEPER_ADDRESS} for each of the {self.world} processes"
            )
        self.home = homes[self.rank]
        # This rank's part goes to its node's keeper and `replicas - 1` others; each expects a known set of ranks.
        self.targets = protocol.replica_keepers(homes, self.rank, replicas)
        self._expect = {k: protocol.expected_ranks(homes, k, replicas) for k in self.targets}
        self._conns: dict[int, Any] = {}
        # One sender thread for the fit, fed a snapshot at a time: starting a thread per snapshot holds the
        # loop about a millisecond (the new thread must take the GIL before `start` returns).
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._layouts: dict[tuple, parts.Layout] = {}  # by the saved tree's structure, shapes and shardings
        self._in_flight = 0  # snapshots started and not yet sent (at most IN_FLIGHT)
        self._sent = threading.Condition()
        self._sender: threading.Thread | None = None
        self._error: BaseException | None = None
        self.committed: list[int] = []  # steps this process saw committed (the keeper says so to the last sender)
        self._buffer: bytearray | None = None  # the sender thread's part, reused (`parts.pack_entries`)
        self.send_seconds = 0.0  # the last snapshot's time from its device copies to the keeper's reply
        self.part_bytes = 0  # the size of this process's part of it
        self.saved_world = self.world  # the world size of the job that took the snapshot `newest` fetched
        self.source = self.addresses[self.home]  # the keeper `newest` fetched from

    def _connection(self, keeper: int = 0):
        """The connection to keeper `keeper`: this node's through its Unix socket where one is named (no other
        user can reach it), another node's over TCP. Every read and write on it is bounded
        (`keeper_protocol.ANSWER_TIMEOUT`): a keeper that stops answering raises `OSError` here, not a hang."""
        if keeper not in self._conns:
            local = self._local[keeper] if keeper == self.home else ""
            self._conns[keeper] = protocol.connect(local or self.addresses[keeper])
        return self._conns[keeper]

    def _request(self, message: dict, keeper: int = 0) -> dict:
        conn = self._connection(keeper)
        protocol.send_json(conn, {"fit": self.fit, "rank": self.rank, "world": self.world, **message})
        return protocol.recv_json(conn)

    # -- saving ------------------------------------------------------------------------

    def save(self, step: int, tree, meta: dict[str, Any]) -> float:
        """Starts a snapshot of `tree` (device arrays copied on their devices now) and its JSON part `meta`.

        At most `IN_FLIGHT` snapshots are started and not yet sent: the previous one's copy to the host
        and send run while this one's device copies queue behind the steps in flight, so the loop waits
        only for the one before that. A previous one the keeper could not hold raises
        `MemoryTierUnavailable` here. In a multi-process job every process calls this at the same step with
        the same tree. Returns the seconds it waited for earlier snapshots (`send_seconds`: how long the last
        one took from the device to the keeper).
        """
        began = time.perf_counter()
        self._wait_until(IN_FLIGHT - 1)
        waited = time.perf_counter() - began
        flat = jax.tree_util.tree_leaves(tree)
        signature = (jax.tree_util.tree_structure(tree), parts.Layout.signature(flat))
        layout = self._layouts.get(signature)
        if layout is None:
            layout = self._layouts[signature] = parts.Layout(tree)
        held = [layout.copy(flat)]

        def send() -> None:
            started = time.perf_counter()
            try:
                copies, finite = held.pop()  # the device copies are freed once on the host
                if not all(bool(flag) for flag in finite):
                    return  # never kept: the disk tier refuses such a state too
                entries = parts.on_host(copies)
                del copies
                # One buffer for every part of the fit: only this thread packs and sends, one part at a time.
                part = self._buffer = parts.pack_entries(step, entries, meta, into=self._buffer)
                del entries
                self._send(step, part)
                self.send_seconds, self.part_bytes = time.perf_counter() - started, len(part)
            except BaseException as error:  # noqa: BLE001 - raised by the next save, wait or close
                for keeper in list(self._conns):  # after an error a connection's frames are out of step
                    self._forget(keeper)
                self._error = error

        with self._sent:
            self._in_flight += 1
        self._jobs.put(send)
        if self._sender is None:
            self._sender = threading.Thread(target=self._send_loop, name="meshfit-memory-snapshots", daemon=True)
            self._sender.start()
        return waited

    def _send_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            finally:
                with self._sent:
                    self._in_flight -= 1
                    self._sent.notify_all()

    def _send(self, step: int, part: bytes) -> None:
        """Sends the part to each of this rank's keepers (its node's first, then its replicas')."""
        digest = protocol.digest(part)
        committed = True
        for keeper in self.targets:
            where = f"the keeper at {self.addresses[keeper]}"
            try:
                reply = self._put(keeper, step, part, digest)
            except KEEPER_ERRORS as error:
                raise MemoryTierUnavailable(
                    f"{where} did not take the snapshot of step {step} ({error_text(error)})"
                ) from None
            if not reply.get("ok"):
                raise MemoryTierUnavailable(f"{where} refused the snapshot of step {step}: {reply.get('message')}")
            committed = committed and bool(reply.get("committed"))
        if committed:
            self.committed.append(step)

    def _put(self, keeper: int, step: int, part: bytes, digest: str) -> dict:
        """Sends the part to `keeper`; its answer (a refusal, or whether the snapshot is now committed)."""
        header = {"op": "put", "step": step, "start": self.start, "size": len(part), "digest": digest}
        reply = self._request({**header, "expect": self._expect[keeper]}, keeper)
        if not reply.get("ok"):
            return reply
        conn = self._connection(keeper)
        protocol.send_payload(conn, part)
        protocol.set_timeout(conn, protocol.reply_timeout(len(part)))  # the keeper checks the part first
        reply = protocol.recv_json(conn)
        protocol.set_timeout(conn, protocol.ANSWER_TIMEOUT)
        return reply

    def wait(self) -> None:
        """Returns when every snapshot in flight has been sent; raises what went wrong with one."""
        self._wait_until(0)

    def _wait_until(self, in_flight: int) -> None:
        """Returns when at most `in_flight` snapshots are still being sent; raises what went wrong with one."""
        with self._sent:
            self._sent.wait_for(lambda: self._in_flight <= in_flight)
        error, self._error = self._error, None
        if error is not None:
            if isinstance(error, MemoryTierUnavailable):
                raise error
            raise MemoryTierUnavailable(f"sending a snapshot to the keeper failed ({error_text(error)})")

    def drop(self) -> str | None:
        """Asks this rank's keepers to forget this fit's snapshots (a fit that ended). Never raises: returns
        why a keeper could not be asked (it is gone or does not answer; its snapshots go with the launch)."""
        failed = None
        for keeper in self.targets:
            try:
                self._request({"op": "drop", "step": 0}, keeper)
            except (*KEEPER_ERRORS, MemoryTierUnavailable) as error:
                self._forget(keeper)
                failed = failed or f"the keeper at {self.addresses[keeper]} ({error_text(error)})"
        return failed

    def close(self) -> str | None:
        """Waits for the snapshot in flight, ends the sender and the connections. Never raises: returns what
        went wrong with the last snapshots, if anything (they are not kept, the disk backups are)."""
        try:
            self.wait()
            return None
        except MemoryTierUnavailable as error:
            return str(error)
        finally:
            if self._sender is not None:
                self._jobs.put(None)  # the sender ends
                self._sender = None
            for keeper in list(self._conns):
                self._forget(keeper)

    def _forget(self, keeper: int) -> None:
        """Closes the connection to `keeper` (its state unknown after an error: the next request reconnects)."""
        conn = self._conns.pop(keeper, None)
        if conn is not None:
            conn.close()

    # -- restoring ---------------------------------------------------------------------

    def newest(self) -> tuple[int, bytes] | None:
        """The newest committed snapshot's step and this process's part, checked against its digest; None if
        the keeper has none of this job's world size or a larger one (`saved_world`: the job that took it).

        Under `meshfit launch --ray` the launcher chose the step every rank resumes from
        (`ENV_KEEPER_RESUME`); the part comes from the first keeper that holds it, this node's first
        (`source`: its address), so a part whose node was lost comes from its replica."""
        resume = os.environ.get(protocol.ENV_KEEPER_RESUME)
        if resume is None:
            return self._fetch({"op": "latest", "step": NEWEST}, self.home)
        chosen = json.loads(resume).get(self.fit)
        if chosen is None:
            return None
        step, start = chosen
        order = [self.home, *(k for k in range(len(self.addresses)) if k != self.home)]
        for keeper in order:
            try:
                fetched = self._fetch({"op": "get", "step": step, "start": start}, keeper)
            except KEEPER_ERRORS:
                self._forget(keeper)
                continue  # a keeper gone with its node: another holds the part
            if fetched is not None:
                return fetched
        return None

    def _fetch(self, request: dict, keeper: int) -> tuple[int, bytes] | None:
        reply = self._request(request, keeper)
        if reply.get("step") is None:
            return None
        self.saved_world = int(reply.get("world", self.world))
        part = protocol.recv_payload(self._connection(keeper), int(reply["size"]))
        if protocol.digest(part) != reply.get("digest"):
            warnings.warn(f"the memory snapshot of step {reply['step']} arrived damaged; not restored.", stacklevel=2)
            return None
        self.source = self.addresses[keeper]
        return int(reply["step"]), part

    def restore(
        self, step: int, part: bytes, template_of, first_epoch: int | None = None
    ) -> tuple[Any, dict[str, Any]] | None:
        """The tree and JSON part of a snapshot `newest` fetched, laid out as `template_of(meta)`; None (with a
        warning) when it does not fit this process, or is not a backup's part (its header and JSON part are
        checked whole, `BackupSchema.check_meta` with `first_epoch`, before `template_of` allocates the
        arrays the JSON part describes, so `BACKUP.restored` takes what this returns as it is)."""
        from meshfit.checkpointing.checkpoint_schema import BACKUP

        try:
            header, data = parts.unpack_header(part)
            if header["step"] != step:
                raise ValueError(f"the part holds step {header['step']}")
            meta = header["meta"]
            BACKUP.check_meta(meta, step, array_bytes=len(data), first_epoch=first_epoch)
            template = template_of(meta)
            tree = parts.unpack(part, template)
        except BackupOfAnotherJob:
            raise  # a snapshot of another compile: refused by the fit, not passed over
        # ValueError: what the checks refuse; the rest a last guard, should a part get past them.
        except (
            ValueError,
            KeyError,
            TypeError,
            IndexError,
            AttributeError,
            OverflowError,
            MemoryError,
            RecursionError,
        ) as error:
            warnings.warn(
                f"the memory snapshot of step {step} does not fit this fit ({str(error) or type(error).__name__}); "
                "not restored.",
                stacklevel=2,
            )
            return None
        return tree, meta
