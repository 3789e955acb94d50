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

A part is this process's shards only (a replicated array: one copy), as raw
bytes described by a JSON header; nothing is pickled:

    b"MFSNAP1\\n" | header length (8 bytes, big-endian) | header JSON | array bytes

Restoring needs each array's shards of this process in its part: the same
world size and layout, or, after an elastic restart onto fewer processes, a
part of the larger job that holds each array whole (replicated, as data
parallelism keeps the state: rank r of the smaller job reads rank r's part).
An array sharded across the larger job's processes cannot be assembled from
one part: such a snapshot is not restored (with a warning) and the restart
resumes from the disk backup, which restores onto any world size.
"""

from __future__ import annotations

import functools
import json
import os
import queue
import struct
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshfit.core.trees import decode, encode, is_key, path_name
from meshfit.runtime import keeper_protocol as protocol

MAGIC = b"MFSNAP1\n"
#: `latest` asks for the newest snapshot below this step: any.
NEWEST = 1 << 62


#: Snapshots a process may have started and not yet sent: one being sent while the next one's copies wait
#: for the steps before them.
IN_FLIGHT = 2


class MemoryTierUnavailable(RuntimeError):
    """The keeper cannot hold snapshots (no room on the host, or it is gone): back up to disk only."""


def _index_key(index: tuple[slice, ...], shape: tuple[int, ...]) -> str:
    """A shard's place in its array as text: "0:4,0:3" (full ranges spelt out)."""
    return ",".join(f"{s.start or 0}:{dim if s.stop is None else s.stop}" for s, dim in zip(index, shape, strict=True))


def _pack(step: int, entries, meta: dict[str, Any], into: bytearray | None = None) -> bytearray:
    """A part from `_Layout.copy` entries whose data are host arrays; written into `into` when it is the part's
    size (a buffer already paged in: a fresh one costs a page fault per 4 KiB), its shards copied in
    16-MiB pieces on several cores (one core copies a few GB/s)."""
    leaves, shards, offset = [], [], 0
    for name, dtype, shape, pieces in entries:
        described = []
        for key, data in pieces:
            raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
            described.append({"index": key, "offset": offset, "nbytes": raw.nbytes})
            shards.append((offset, raw))
            offset += raw.nbytes
        leaves.append({"path": name, "dtype": np.dtype(dtype).name, "shape": list(shape), "shards": described})
    header = json.dumps({"step": step, "meta": meta, "leaves": leaves}).encode()
    start = len(MAGIC) + 8 + len(header)
    part = into if into is not None and len(into) == start + offset else bytearray(start + offset)
    part[:start] = b"".join([MAGIC, struct.pack(">Q", len(header)), header])
    target = np.frombuffer(part, np.uint8)
    chunk = protocol.DIGEST_CHUNK
    pieces = [(start + at + i, raw[i : i + chunk]) for at, raw in shards for i in range(0, raw.nbytes, chunk)]

    def copy(piece: tuple[int, np.ndarray]) -> None:
        at, raw = piece
        target[at : at + raw.nbytes] = raw

    protocol.in_pieces(copy, pieces, offset)
    return part


def pack(step: int, tree, meta: dict[str, Any]) -> bytearray:
    """This process's part of a snapshot of `tree` (its device arrays fetched here) as bytes."""
    entries, _ = _Layout(tree).copy(jax.tree_util.tree_leaves(tree))
    return _pack(step, _on_host(entries), meta)


def _on_host(entries) -> list:
    """`_Layout.copy` entries with every shard fetched to the host (waits for its device copy).

    An accelerator's shards move through its pinned host memory, every transfer started before any is read:
    a DMA at the bus's speed, where reading device memory into pageable memory stages it through a bounce
    buffer (`benchmarks/bench_snapshot.py` times both)."""
    staged = [(name, dtype, shape, [(k, _to_pinned(x)) for k, x in shards]) for name, dtype, shape, shards in entries]
    return [(name, dtype, shape, [(k, np.asarray(x)) for k, x in shards]) for name, dtype, shape, shards in staged]


def _to_pinned(x):
    """`x` moving to its device's pinned host memory, if it is on an accelerator that has one; else `x`."""
    if isinstance(x, jax.Array) and _has_pinned_host(next(iter(x.devices()))):
        return jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))
    return x


@functools.cache
def _has_pinned_host(device) -> bool:
    # A CPU's arrays already are host memory: `np.asarray` shares them without a copy.
    return device.platform != "cpu" and any(m.kind == "pinned_host" for m in device.addressable_memories())


@functools.partial(jax.jit, static_argnums=1)
def _copy_on_device(arrays, keys: tuple[bool, ...]):
    """New buffers holding `arrays` (all on one device; typed PRNG keys as their raw data), and whether every
    floating-point one is finite (checked on the device, not over gigabytes on the host): a program of this
    process alone."""
    copies = [jax.random.key_data(x) if key else jnp.copy(x) for x, key in zip(arrays, keys, strict=True)]
    finite = [jnp.isfinite(x).all() for x in arrays if jnp.issubdtype(x.dtype, jnp.inexact)]
    return copies, functools.reduce(jnp.logical_and, finite, jnp.bool_(True))


class _Layout:
    """Where a tree's leaves put this process's distinct shards, worked out once for the tree's structure,
    shapes and shardings: each snapshot then only picks the shards and dispatches one copy per device."""

    def __init__(self, tree):
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
        self.leaves: list[tuple[str, Any, tuple[int, ...], list[tuple[str, int]] | None]] = []
        self.by_device: dict[Any, list[tuple[int, int]]] = {}  # device -> (leaf, shard position) to copy
        self.keys: dict[Any, tuple[bool, ...]] = {}
        for i, (path, leaf) in enumerate(flat):
            if not isinstance(leaf, jax.Array):
                self.leaves.append((path_name(path), None, (), None))
                continue
            encoded = jax.eval_shape(jax.random.key_data, leaf) if is_key(leaf) else leaf
            seen: dict[str, int] = {}
            for position, shard in enumerate(leaf.addressable_shards):
                # (A key array's shard index may already span its raw data's trailing axis.)
                index = _index_key(shard.index + (slice(None),) * (encoded.ndim - len(shard.index)), encoded.shape)
                if index not in seen:
                    seen[index] = position
                    self.by_device.setdefault(shard.device, []).append((i, position))
            self.leaves.append((path_name(path), encoded.dtype, tuple(encoded.shape), list(seen.items())))
        for device, places in self.by_device.items():
            self.keys[device] = tuple(is_key(flat[i][1]) for i, _ in places)

    @staticmethod
    def signature(flat: list) -> tuple:
        return tuple((x.shape, x.dtype, x.sharding) if isinstance(x, jax.Array) else type(x) for x in flat)

    def copy(self, flat: list) -> tuple[list, list]:
        """Per leaf of `flat`: (path, dtype, shape, [(index key, data)]), device shards copied on their devices
        (dispatched, not waited for, so later steps that donate the state's buffers leave the copies intact),
        host values whole; and flags (device scalars, host bools) that are all true when every floating-point
        value is finite. One program per local device, none across processes (such a program costs the steps
        around it a collective's wait)."""
        copied: dict[tuple[int, int], Any] = {}
        finite: list = []
        for device, places in self.by_device.items():
            shards = [flat[i].addressable_shards[position].data for i, position in places]
            copies, all_finite = _copy_on_device(shards, self.keys[device])
            copied.update(zip(places, copies, strict=True))
            finite.append(all_finite)
        entries = []
        for i, (name, dtype, shape, shards) in enumerate(self.leaves):
            if shards is None:
                value = np.asarray(flat[i])
                whole = _index_key(tuple(slice(None) for _ in value.shape), value.shape)
                entries.append((name, value.dtype, tuple(value.shape), [(whole, value)]))
                finite.append(not np.issubdtype(value.dtype, np.inexact) or bool(np.isfinite(value).all()))
            else:
                entries.append((name, dtype, shape, [(index, copied[i, position]) for index, position in shards]))
        return entries, finite


def unpack_header(part: bytes) -> tuple[dict, memoryview]:
    """The JSON header of a part and a view of its array bytes; `ValueError` if it is not one."""
    if not part.startswith(MAGIC) or len(part) < len(MAGIC) + 8:
        raise ValueError("not a meshfit snapshot part (no MFSNAP1 header)")
    (length,) = struct.unpack(">Q", part[len(MAGIC) : len(MAGIC) + 8])
    start = len(MAGIC) + 8
    if start + length > len(part):
        raise ValueError("a snapshot part cut short in its header")
    header = json.loads(part[start : start + length].decode())
    return header, memoryview(part)[start + length :]


def unpack(part: bytes | bytearray, template) -> Any:
    """The tree of a part, laid out as `template` (device arrays on its shardings, numpy arrays on the host).

    `ValueError` names what differs when the part does not fit the template (another model, another layout).
    The part's bytes are the caller's to check: `MemoryTier.newest` returns only a part that matches the
    digest it was sent with.
    """
    header, data = unpack_header(part)
    by_path = {leaf["path"]: leaf for leaf in header["leaves"]}
    flat, treedef = jax.tree_util.tree_flatten_with_path(encode(template))
    found = []  # per leaf (name, template, shape, shards)
    for path, like in flat:
        name = path_name(path)
        saved = by_path.get(name)
        if saved is None:
            raise ValueError(f"{name}: not in the snapshot")
        dtype = jnp.dtype(saved["dtype"])
        shape = tuple(saved["shape"])
        if shape != tuple(like.shape) or dtype != np.dtype(like.dtype):
            raise ValueError(
                f"{name}: saved {shape} {dtype.name}, expected {tuple(like.shape)} {np.dtype(like.dtype).name}"
            )
        shards = {}
        for shard in saved["shards"]:
            raw = data[shard["offset"] : shard["offset"] + shard["nbytes"]]
            if len(raw) != shard["nbytes"]:
                raise ValueError(f"{name} [{shard['index']}]: the part ends inside it")
            shards[shard["index"]] = np.frombuffer(raw, dtype=dtype)
        found.append((name, like, shape, shards))
    return decode(jax.tree_util.tree_unflatten(treedef, [_rebuilt(*leaf) for leaf in found]), template)


def _rebuilt(name: str, like, shape: tuple[int, ...], shards: dict[str, np.ndarray]):
    """A leaf laid out as `like` from this process's shards of it."""
    if not isinstance(like, jax.Array):
        (only,) = shards.values()
        return np.array(only.reshape(shape))
    whole = _index_key(tuple(slice(None) for _ in shape), shape)

    def piece(index):
        key = _index_key(index, shape)
        if key in shards:
            return shards[key].reshape(tuple(len(range(*s.indices(d))) for s, d in zip(index, shape, strict=True)))
        if whole in shards:  # a replicated array: any shard is a slice of the whole
            return shards[whole].reshape(shape)[index]
        raise ValueError(
            f"{name}: this process's part holds no shard [{key}] nor the whole array (another layout, or "
            "a world size that split it across processes)"
        )

    return jax.make_array_from_callback(shape, like.sharding, piece)


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
        self._layouts: dict[tuple, _Layout] = {}  # by the saved tree's structure, shapes and shardings
        self._in_flight = 0  # snapshots started and not yet sent (at most IN_FLIGHT)
        self._sent = threading.Condition()
        self._sender: threading.Thread | None = None
        self._error: BaseException | None = None
        self.committed: list[int] = []  # steps this process saw committed (the keeper says so to the last sender)
        self._buffer: bytearray | None = None  # the sender thread's part, reused (`_pack`)
        self.send_seconds = 0.0  # the last snapshot's time from its device copies to the keeper's reply
        self.part_bytes = 0  # the size of this process's part of it
        self.saved_world = self.world  # the world size of the job that took the snapshot `newest` fetched
        self.source = self.addresses[self.home]  # the keeper `newest` fetched from

    def _connection(self, keeper: int = 0):
        if keeper not in self._conns:
            self._conns[keeper] = protocol.connect(self.addresses[keeper])
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
        signature = (jax.tree_util.tree_structure(tree), _Layout.signature(flat))
        layout = self._layouts.get(signature)
        if layout is None:
            layout = self._layouts[signature] = _Layout(tree)
        held = [layout.copy(flat)]

        def send() -> None:
            started = time.perf_counter()
            try:
                copies, finite = held.pop()  # the device copies are freed once on the host
                if not all(bool(flag) for flag in finite):
                    return  # never kept: the disk tier refuses such a state too
                entries = _on_host(copies)
                del copies
                # One buffer for every part of the fit: only this thread packs and sends, one part at a time.
                part = self._buffer = _pack(step, entries, meta, into=self._buffer)
                del entries
                self._send(step, part)
                self.send_seconds, self.part_bytes = time.perf_counter() - started, len(part)
            except BaseException as error:  # noqa: BLE001 - raised by the next save, wait or close
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
            conn = self._connection(keeper)
            header = {"op": "put", "step": step, "start": self.start, "size": len(part), "digest": digest}
            reply = self._request({**header, "expect": self._expect[keeper]}, keeper)
            where = f"the keeper at {self.addresses[keeper]}"
            if not reply.get("ok"):
                raise MemoryTierUnavailable(f"{where} refused the snapshot of step {step}: {reply.get('message')}")
            protocol.send_payload(conn, part)
            reply = protocol.recv_json(conn)
            if not reply.get("ok"):
                raise MemoryTierUnavailable(f"{where} refused the snapshot of step {step}: {reply.get('message')}")
            committed = committed and bool(reply.get("committed"))
        if committed:
            self.committed.append(step)

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
            raise MemoryTierUnavailable(f"sending a snapshot to the keeper failed ({type(error).__name__}: {error})")

    def drop(self) -> None:
        """Asks this rank's keepers to forget this fit's snapshots (a fit that ended)."""
        for keeper in self.targets:
            self._request({"op": "drop", "step": 0}, keeper)

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._sender is not None:
                self._jobs.put(None)  # the sender ends
                self._sender = None
            for conn in self._conns.values():
                conn.close()
            self._conns.clear()

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
            except (OSError, EOFError, protocol.ProtocolError):
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

    def restore(self, step: int, part: bytes, template_of) -> tuple[Any, dict[str, Any]] | None:
        """The tree and JSON part of a snapshot `newest` fetched, laid out as `template_of(meta)`; None (with a
        warning) when it does not fit this process."""
        try:
            header, _ = unpack_header(part)
            meta = header["meta"]
            template = template_of(meta)
            tree = unpack(part, template)
        except (ValueError, KeyError, TypeError) as error:
            warnings.warn(
                f"the memory snapshot of step {step} does not fit this fit ({error}); not restored.", stacklevel=2
            )
            return None
        return tree, meta
