"""The memory tier of `BackupAndRestore`: snapshots of a backup kept in the launcher's RAM.

Every K steps each process hands the launcher's keeper
(`meshfit.launch.keeper`; under `meshfit launch --ray`, its own node's
keeper) its part of exactly what a disk backup holds (the tree and JSON part
of `checkpoint_schema.BACKUP`).

On its own node the keeper lends the rank shared memory (a memfd passed over
the rank's Unix connection): the rank writes its part there in place and
commits it with its checksum (`keeper_protocol.digest`, XXH3 at memory
speed); no byte crosses a socket. Where the shards are host memory already
(CPU devices) the part is written from the live arrays before the next step
can donate them; on an accelerator, taking a snapshot holds the loop only for
a copy of this process's shards on its own devices (a program per local
device, none across processes), and a thread copies them to the host. Either
way a state that is not finite is never kept (as the disk tier refuses one),
and the checksum and the commit run on the sender thread behind the next
steps. Replicas on other nodes' keepers (`replicas - 1` of them) are the
keeper's job: the commit names them (their addresses and the ranks each
expects), and the keeper sends the part on from its own memory in the
background (`meshfit.launch.replica_forwarder`), each replica checked on
arrival. The sender thread is free once its own keeper holds the part, and a
replica keeper that is gone or stopped never holds the rank up. A snapshot
is committed at each keeper that holds every part it expects, so a replica
that has not arrived never makes a keeper offer that snapshot (`wait` also
waits for the replicas, bounded). A restarted process asks the keeper for the
newest committed snapshot (under Ray: for the step the launcher chose, from
any keeper that holds its part), maps its own node's keeper's memory
read-only (or reads the part over TCP), checks the checksum, and rebuilds its
arrays, laid out as the live state, from the shards it had; a part that does
not match its checksum is never restored.

A part's bytes, and how a tree becomes one and back, are
`meshfit.checkpointing.snapshot_parts`'s.
"""

from __future__ import annotations

import json
import mmap
import os
import queue
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax

from meshfit.checkpointing import snapshot_parts as parts
from meshfit.checkpointing.checkpoint_schema import BACKUP
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


def _mapped(fd: int, size: int, writable: bool) -> mmap.mmap:
    """The keeper's shared memory behind `fd` (closed here), mapped whole and paged in at once."""
    try:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=prot)
    finally:
        os.close(fd)


def _unmap(part) -> None:
    """Unmaps a part in the keeper's shared memory (nothing for a part in this process's own buffer). A view
    still held elsewhere keeps the mapping until it goes: the keeper's memory is then freed later, never
    written through it."""
    if isinstance(part, mmap.mmap):
        try:
            part.close()
        except BufferError:
            pass


#: `error` for a one-line warning (BackupAndRestore's too).
error_text = protocol.error_text


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
        # Each keeper's Unix socket, where this rank may reach it: named apart under `--ray`, or the address itself.
        self._local = [
            local or (address if address.startswith(protocol.UNIX_PREFIX) else "")
            for address, local in zip(self.addresses, protocol.local_addresses(), strict=True)
        ]
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
        # The replicas are sent on by the home keeper: the commit names each one's keeper and expected ranks.
        self._replicas = [{"address": self.addresses[k], "expect": self._expect[k]} for k in self.targets[1:]]
        self._unsettled = False  # a part was handed over since the home keeper last said its replicas arrived
        self._conns: dict[int, Any] = {}
        # One sender thread for the fit, fed a snapshot at a time: starting a thread per snapshot holds the
        # loop about a millisecond (the new thread must take the GIL before `start` returns).
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._layouts: dict[tuple, parts.Layout] = {}  # by the saved tree's structure, shapes and shardings
        self._in_flight = 0  # snapshots started and not yet sent (at most IN_FLIGHT)
        self._sent = threading.Condition()
        self._sender: threading.Thread | None = None
        self._error: BaseException | None = None
        # Steps whose snapshot this process's part completed at its own keeper (it says so to the last part).
        self.committed: list[int] = []
        self._buffer: bytearray | None = None  # the part written here when no keeper lends memory, reused
        self.send_seconds = 0.0  # the last snapshot's time from its device copies to its own keeper's reply
        self.part_bytes = 0  # the size of this process's part of it
        self.saved_world = self.world  # the world size of the job that took the snapshot `newest` fetched
        self.source = self.addresses[self.home]  # the keeper `newest` fetched from
        self._lease: int | None = None  # the keeper whose shared memory a fetched part is, until `release`

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
        flat = jax.tree_util.tree_leaves(tree)
        signature = (jax.tree_util.tree_structure(tree), parts.Layout.signature(flat))
        layout = self._layouts.get(signature)
        if layout is None:
            layout = self._layouts[signature] = parts.Layout(tree)
        if layout.in_host_memory:
            # The shards are host memory: written into the part now, from the live arrays (before the next
            # step donates them), at memcpy's speed; a copy on the device first would cost a pass over fresh
            # memory. The checksum and the hand-over run behind the next steps.
            self._wait_until(0)  # (one part at a time: the connection and the buffer are the previous one's)
            waited = time.perf_counter() - began
            entries, finite = layout.views(flat)
            written = self._written(step, parts.PartPlan(step, entries, meta))
            del entries
        else:
            self._wait_until(IN_FLIGHT - 1)
            waited = time.perf_counter() - began
            copied = [layout.copy(flat)]

        def send() -> None:
            started = time.perf_counter() if not layout.in_host_memory else began
            try:
                if layout.in_host_memory:
                    part, shared = written
                    if not all(bool(flag) for flag in finite):
                        _unmap(part)
                        return  # never kept: the disk tier refuses such a state too
                else:
                    copies, all_finite = copied.pop()  # the device copies are freed once on the host
                    if not all(bool(flag) for flag in all_finite):
                        return
                    plan = parts.PartPlan(step, parts.on_host(copies), meta)
                    del copies
                    part, shared = self._written(step, plan)
                size = len(part)
                self._hand_over(step, part, shared)
                self.send_seconds, self.part_bytes = time.perf_counter() - started, size
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

    def _written(self, step: int, plan: parts.PartPlan) -> tuple[Any, bool]:
        """The part written out, and whether it lies in the keeper's shared memory: its own node's keeper lends
        that where it can (`_reserved`: the part is then written in place, never sent); else this rank's
        buffer (one for every part of the fit, reused: only one part is written at a time)."""
        home = self.targets[0]
        where = f"the keeper at {self.addresses[home]}"
        try:
            part = self._reserved(home, step, plan.size) if self._shares(home) else None
        except KEEPER_ERRORS as error:
            raise MemoryTierUnavailable(
                f"{where} did not take the snapshot of step {step} ({error_text(error)})"
            ) from None
        if isinstance(part, dict):
            raise MemoryTierUnavailable(f"{where} refused the snapshot of step {step}: {part.get('message')}")
        shared = part is not None
        if part is None:
            if self._buffer is None or len(self._buffer) != plan.size:
                self._buffer = bytearray(plan.size)
            part = self._buffer
        try:
            plan.write(part)
        except BaseException:
            if shared:
                _unmap(part)
            raise
        return part, shared

    def _hand_over(self, step: int, part, shared: bool) -> None:
        """Commits the written part with its checksum to this rank's own keeper (in place, where `shared`; else
        sent over the connection), naming the keepers it sends replicas on to. Returns once that keeper holds
        the part: the replicas travel behind the next steps, on the keeper's threads."""
        where = f"the keeper at {self.addresses[self.home]}"
        try:
            digest = protocol.digest(part)
            try:
                if shared:
                    request = {"op": "commit", "step": step, "digest": digest, "replicas": self._replicas}
                    reply = self._request(request, self.home)
                else:
                    reply = self._put(self.home, step, part, digest)
            except KEEPER_ERRORS as error:
                raise MemoryTierUnavailable(
                    f"{where} did not take the snapshot of step {step} ({error_text(error)})"
                ) from None
            if not reply.get("ok"):
                raise MemoryTierUnavailable(f"{where} refused the snapshot of step {step}: {reply.get('message')}")
        finally:
            if shared:
                _unmap(part)
        self._unsettled = bool(self._replicas)
        if reply.get("committed"):
            self.committed.append(step)

    def _shares(self, keeper: int) -> bool:
        """Whether `keeper` is reached through its Unix socket, where it lends its shared memory."""
        return keeper == self.home and bool(self._local[keeper])

    def _reserved(self, keeper: int, step: int, size: int):
        """The keeper's shared memory for this rank's part of `size` bytes, mapped here (a writable `mmap`); or
        the keeper's refusal (a dict)."""
        request = {"op": "reserve", "step": step, "start": self.start, "size": size, "expect": self._expect[keeper]}
        reply = self._request(request, keeper)
        if not reply.get("ok"):
            return reply
        return _mapped(protocol.recv_fd(self._connection(keeper)), size, writable=True)

    def _put(self, keeper: int, step: int, part: bytes, digest: str) -> dict:
        """Sends the part to `keeper` (this rank's own, naming the replicas it sends on); its answer (a
        refusal, or whether the snapshot is now committed there)."""
        header = {"fit": self.fit, "rank": self.rank, "world": self.world, "op": "put", "step": step}
        header.update(start=self.start, size=len(part), digest=digest, expect=self._expect[keeper])
        return protocol.send_part(self._connection(keeper), {**header, "replicas": self._replicas}, part)

    def wait(self) -> None:
        """Returns when every snapshot in flight is held by this rank's own keeper and the replicas it sends on
        have arrived (or it gave up on them: after `keeper_protocol.settle_timeout`, a replica keeper gone or
        stopped costs this no more); raises what went wrong with this rank's own keeper."""
        self._wait_until(0)
        if not self._unsettled:
            return
        try:
            self._request({"op": "settle", "step": 0}, self.home)
        except KEEPER_ERRORS as error:
            self._forget(self.home)
            where = f"the keeper at {self.addresses[self.home]}"
            raise MemoryTierUnavailable(f"{where} did not answer ({error_text(error)})") from None
        self._unsettled = False

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
        """Asks this rank's keeper to forget this fit's snapshots (a fit that ended); it tells the keepers it sent
        replicas to, after the replicas on their way. Where it cannot be asked, the replicas' keepers are
        asked here. Never raises: returns why a keeper could not be asked (it is gone or does not answer; its
        snapshots go with the launch)."""
        failed = None
        for keeper in self.targets:
            try:
                self._request({"op": "drop", "step": 0}, keeper)
            except (*KEEPER_ERRORS, MemoryTierUnavailable) as error:
                self._forget(keeper)
                failed = failed or f"the keeper at {self.addresses[keeper]} ({error_text(error)})"
                continue
            if keeper == self.home:
                break  # it tells the others
        return failed

    def close(self) -> str | None:
        """Waits for the snapshot in flight, ends the sender and the connections. Never raises: returns what
        went wrong with the last snapshots, if anything (they are not kept, the disk backups are)."""
        self._lease = None  # (closing the connection tells the keeper)
        try:
            self._wait_until(0)  # (not for the replicas: the keeper sends them on after this process is gone)
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

    def _fetch(self, request: dict, keeper: int) -> tuple[int, Any] | None:
        """The part `request` asks `keeper` for, checked against its digest: read over the connection, or, from
        this node's keeper, its shared memory mapped here (read only, lent until `release`)."""
        shares = self._shares(keeper)
        reply = self._request({**request, "shared": shares}, keeper)
        if reply.get("step") is None:
            return None
        self.saved_world = int(reply.get("world", self.world))
        size = int(reply["size"])
        if reply.get("shared") and shares:
            self._lease = keeper
            part = _mapped(protocol.recv_fd(self._connection(keeper)), size, writable=False)
        else:
            part = protocol.recv_payload(self._connection(keeper), size)
        if protocol.digest(part) != reply.get("digest"):
            warnings.warn(f"the memory snapshot of step {reply['step']} arrived damaged; not restored.", stacklevel=2)
            self.release(part)
            return None
        self.source = self.addresses[keeper]
        return int(reply["step"]), part

    def release(self, part=None) -> None:
        """Lets go of a part `newest` fetched (its shared memory unmapped, the keeper told it may reuse it).
        Never raises: a keeper gone has nothing left to reuse."""
        if part is not None:
            _unmap(part)
        keeper, self._lease = self._lease, None
        if keeper is not None:
            try:
                self._request({"op": "release"}, keeper)
            except KEEPER_ERRORS:
                self._forget(keeper)

    def restore(
        self, step: int, part: bytes, template_of, first_epoch: int | None = None
    ) -> tuple[Any, dict[str, Any]] | None:
        """The tree and JSON part of a snapshot `newest` fetched, laid out as `template_of(meta)`; None (with a
        warning) when it does not fit this process, or is not a backup's part (its header and JSON part are
        checked whole, `BackupSchema.check_meta` with `first_epoch`, before `template_of` allocates the
        arrays the JSON part describes, so `BACKUP.restored` takes what this returns as it is)."""
        try:
            header, data = parts.unpack_header(part)
            if header["step"] != step:
                raise ValueError(f"the part holds step {header['step']}")
            meta = header["meta"]
            BACKUP.check_meta(meta, step, array_bytes=len(data), first_epoch=first_epoch)
            del data
            template = template_of(meta)
            tree = parts.unpack(part, template, shared=isinstance(part, mmap.mmap))
        except BackupOfAnotherJob:
            self.release(part)
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
            self.release(part)
            return None
        self.release(part)
        return tree, meta
