"""A memory snapshot's part: one process's shards of a backup's tree, as bytes and back.

A part is this process's shards only (a replicated array: one copy), as raw
bytes described by a JSON header; nothing is pickled:

    b"MFSNAP1\\n" | header length (8 bytes, big-endian) | header JSON | array bytes

`pack` (and `Layout`, which works out once per tree where its shards lie)
writes one; `unpack` reads one back laid out as a template's arrays. A part
comes back from a keeper, another process: `unpack_header` checks all of its
header (sizes against the part's own length, the nesting of its JSON, every
field's type and range) before anything is parsed or allocated, and refuses a
part that is not one of `pack`'s with a `ValueError` naming the field.

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
import math
import re
import struct
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshfit.checkpointing.checkpoint_schema import ARRAY_DTYPES, MAX_JSON_DEPTH, array_nbytes, short_repr
from meshfit.core.trees import decode, encode, is_key, on_devices, path_name
from meshfit.runtime import keeper_protocol as protocol

MAGIC = b"MFSNAP1\n"
#: The bytes before a part's header: `MAGIC` and the header's length.
_PREFIX = len(MAGIC) + 8
#: An escape in a JSON string (a backslash and the character it escapes); a JSON string once escapes are gone.
_ESCAPE, _STRING = re.compile(rb"\\.", re.DOTALL), re.compile(rb'"[^"]*"')
#: One axis of a shard's index in its array, as `_index_key` writes it: "start:stop", no leading zeros.
_RANGE = re.compile(r"(0|[1-9][0-9]{0,18}):(0|[1-9][0-9]{0,18})")  # an axis is shorter than 2**63
#: Bytes of a header whose nesting `_check_depth` counts at a time.
_DEPTH_CHUNK = 1 << 20


def _index_key(index: tuple[slice, ...], shape: tuple[int, ...]) -> str:
    """A shard's place in its array as text: "0:4,0:3" (full ranges spelt out)."""
    return ",".join(f"{s.start or 0}:{dim if s.stop is None else s.stop}" for s, dim in zip(index, shape, strict=True))


class PartPlan:
    """A part laid out before it is written: its header and where each shard goes, so its `size` is known
    before any byte moves (the keeper hands out shared memory of exactly that size to write it into)."""

    def __init__(self, step: int, entries, meta: dict[str, Any]):
        leaves, self._shards, offset = [], [], 0
        for name, dtype, shape, pieces in entries:
            described = []
            for key, data in pieces:
                raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
                described.append({"index": key, "offset": offset, "nbytes": raw.nbytes})
                self._shards.append((offset, raw))
                offset += raw.nbytes
            leaves.append({"path": name, "dtype": np.dtype(dtype).name, "shape": list(shape), "shards": described})
        header = json.dumps({"step": step, "meta": meta, "leaves": leaves}).encode()
        self._head = b"".join([MAGIC, struct.pack(">Q", len(header)), header])
        self.array_bytes = offset
        self.size = len(self._head) + offset

    def write(self, into) -> None:
        """Writes the part into `into` (any writable buffer of `size` bytes: a bytearray, a shared mapping),
        its shards copied in 16-MiB pieces on several cores (one core copies a few GB/s)."""
        target = np.frombuffer(into, np.uint8)
        if target.nbytes != self.size:
            raise ValueError(f"a part of {self.size} bytes written into a buffer of {target.nbytes}")
        start = len(self._head)
        target[:start] = np.frombuffer(self._head, np.uint8)
        chunk = protocol.DIGEST_CHUNK
        pieces = [(start + at + i, raw[i : i + chunk]) for at, raw in self._shards for i in range(0, raw.nbytes, chunk)]

        def copy(piece: tuple[int, np.ndarray]) -> None:
            at, raw = piece
            target[at : at + raw.nbytes] = raw

        protocol.in_pieces(copy, pieces, self.array_bytes)


def pack(step: int, tree, meta: dict[str, Any]) -> bytearray:
    """This process's part of a snapshot of `tree` (its device arrays fetched here) as bytes."""
    entries, _ = Layout(tree).copy(jax.tree_util.tree_leaves(tree))
    plan = PartPlan(step, on_host(entries), meta)
    part = bytearray(plan.size)
    plan.write(part)
    return part


def on_host(entries) -> list:
    """`Layout.copy` entries with every shard fetched to the host (waits for its device copy).

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
def _keys_and_finite(arrays, keys: tuple[bool, ...]):
    """The raw data of the typed PRNG keys among `arrays` (all on one device), and whether every
    floating-point one is finite: what a snapshot taken straight from host memory needs of the device."""
    raw = [jax.random.key_data(x) for x, key in zip(arrays, keys, strict=True) if key]
    finite = [jnp.isfinite(x).all() for x in arrays if jnp.issubdtype(x.dtype, jnp.inexact)]
    return raw, functools.reduce(jnp.logical_and, finite, jnp.bool_(True))


@functools.partial(jax.jit, static_argnums=1)
def _copy_on_device(arrays, keys: tuple[bool, ...]):
    """New buffers holding `arrays` (all on one device; typed PRNG keys as their raw data), and whether every
    floating-point one is finite (checked on the device, not over gigabytes on the host): a program of this
    process alone."""
    copies = [jax.random.key_data(x) if key else jnp.copy(x) for x, key in zip(arrays, keys, strict=True)]
    finite = [jnp.isfinite(x).all() for x in arrays if jnp.issubdtype(x.dtype, jnp.inexact)]
    return copies, functools.reduce(jnp.logical_and, finite, jnp.bool_(True))


class Layout:
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

    @property
    def in_host_memory(self) -> bool:
        """Whether every shard lies in this host's memory already (CPU devices): a snapshot can then be
        written straight from the live arrays (`views`), with no copy on the device first."""
        return all(device.platform == "cpu" for device in self.by_device)

    def views(self, flat: list) -> tuple[list, list]:
        """As `copy`, with the entries' data the live shards themselves (numpy views of host memory, waited
        for): valid only until the next step donates the state's buffers, so written out before it runs."""
        viewed: dict[tuple[int, int], Any] = {}
        finite: list = []
        for device, places in self.by_device.items():
            shards = [flat[i].addressable_shards[position].data for i, position in places]
            raw, all_finite = _keys_and_finite(shards, self.keys[device])
            raw = iter(raw)
            for place, shard, key in zip(places, shards, self.keys[device], strict=True):
                viewed[place] = np.asarray(next(raw) if key else shard)
            finite.append(all_finite)
        return self._entries(flat, viewed, finite), finite

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
        return self._entries(flat, copied, finite), finite

    def _entries(self, flat: list, data: dict[tuple[int, int], Any], finite: list) -> list:
        """Per leaf: (path, dtype, shape, [(index key, data)]), from each distinct shard's `data` (by leaf and
        shard position); host values whole, their finiteness appended to `finite`."""
        entries = []
        for i, (name, dtype, shape, shards) in enumerate(self.leaves):
            if shards is None:
                value = np.asarray(flat[i])
                whole = _index_key(tuple(slice(None) for _ in value.shape), value.shape)
                entries.append((name, value.dtype, tuple(value.shape), [(whole, value)]))
                finite.append(not np.issubdtype(value.dtype, np.inexact) or bool(np.isfinite(value).all()))
            else:
                entries.append((name, dtype, shape, [(index, data[i, position]) for index, position in shards]))
        return entries


def unpack_header(part: bytes) -> tuple[dict, memoryview]:
    """The JSON header of a part and a view of its array bytes, after checking both; `ValueError` naming what
    is wrong when `part` is not a part `pack` could have written.

    Checked before the header is parsed: its length against the part's, and how deeply its lists and
    objects nest (at most `MAX_JSON_DEPTH`: Python's parser recurses once a level). Then every field (see
    `_check_header`), so that `unpack` reads only bytes the part holds and allocates nothing a part asks
    for. `meta` is checked to be an object only: what it holds is its writer's (a backup's:
    `checkpoint_schema.BackupSchema.check_meta`).
    """
    if len(part) < _PREFIX or bytes(part[: len(MAGIC)]) != MAGIC:  # (any buffer: bytes, a shared mapping)
        raise ValueError("not a meshfit snapshot part (no MFSNAP1 header)")
    (length,) = struct.unpack(">Q", part[len(MAGIC) : _PREFIX])
    if length > len(part) - _PREFIX:
        raise ValueError(
            f"header length: {length:,} bytes, past the end of the part ({len(part) - _PREFIX:,} bytes after it)"
        )
    text = bytes(part[_PREFIX : _PREFIX + length])
    _check_depth(text)
    try:
        header = json.loads(text.decode())
    except ValueError as error:  # not UTF-8, not JSON
        raise ValueError(f"header: not JSON ({error})") from None
    except RecursionError:  # a last guard: `_check_depth` refuses any nesting that deep first
        raise ValueError("header: nested too deeply") from None
    data = memoryview(part)[_PREFIX + length :]
    _check_header(header, len(data))
    return header, data


def _check_depth(text: bytes) -> None:
    """Refuses JSON whose lists and objects nest deeper than `MAX_JSON_DEPTH`, in time linear in its length
    and without recursion. Escapes, then strings, are cut out first (in the order a parser reads them, so
    brackets inside strings are not counted); what a parser would refuse anyway may be miscounted, but
    never the prefix it reads before refusing it."""
    bare = np.frombuffer(_STRING.sub(b"", _ESCAPE.sub(b"", text)), np.uint8)
    depth = 0
    for start in range(0, bare.size, _DEPTH_CHUNK):
        chars = bare[start : start + _DEPTH_CHUNK]
        steps = np.isin(chars, (ord("["), ord("{"))).astype(np.int64) - np.isin(chars, (ord("]"), ord("}")))
        levels = depth + np.cumsum(steps)
        if int(levels.max()) > MAX_JSON_DEPTH:
            raise ValueError(f"header: lists and objects nested deeper than {MAX_JSON_DEPTH} levels")
        depth = int(levels[-1])


def _is_count(value: Any) -> bool:
    """Whether `value` is an int >= 0 (a bool is not)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_header(header: Any, data_length: int) -> None:
    """Refuses (`ValueError` naming the field) a header `pack` could not have written for `data_length` array
    bytes: `step` an int >= 0; `meta` an object; `leaves` a list of leaves, each with a unique `path`, a
    `dtype` of `ARRAY_DTYPES`, a `shape` numpy can hold and `shards` whose `index` lies within the shape
    ("start:stop" an axis, as `_index_key` writes it), whose `nbytes` are the index's elements times the
    dtype's size and whose bytes (`offset` on) lie within the array bytes."""
    if not isinstance(header, dict):
        raise ValueError(f"header: expected a JSON object. Received: {type(header).__name__}")
    missing = [key for key in ("step", "meta", "leaves") if key not in header]
    if missing:
        raise ValueError(f"header: lacks {', '.join(missing)}")
    if not _is_count(header["step"]):
        raise ValueError(f"step: expected an int >= 0. Received: {short_repr(header['step'])}")
    if not isinstance(header["meta"], dict):
        raise ValueError(f"meta: expected a JSON object. Received: {type(header['meta']).__name__}")
    leaves = header["leaves"]
    if not isinstance(leaves, list):
        raise ValueError(f"leaves: expected a list. Received: {type(leaves).__name__}")
    paths = set()
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, dict) or not {"path", "dtype", "shape", "shards"} <= set(leaf):
            raise ValueError(f"leaves[{i}]: expected an object with path, dtype, shape and shards")
        if not isinstance(leaf["path"], str):
            raise ValueError(f"leaves[{i}].path: expected a string. Received: {short_repr(leaf['path'])}")
        if leaf["path"] in paths:
            raise ValueError(f"leaves[{i}].path: {short_repr(leaf['path'])} a second time")
        paths.add(leaf["path"])
        name = leaf["path"] if len(leaf["path"]) <= 80 else leaf["path"][:77] + "..."
        path = f"{name} (leaves[{i}])"  # for messages
        shape, dtype = leaf["shape"], leaf["dtype"]
        array_nbytes(shape, dtype, path)
        shards = leaf["shards"]
        if not isinstance(shards, list):
            raise ValueError(f"{path}: shards: expected a list. Received: {type(shards).__name__}")
        indices = set()
        for shard in shards:
            if not isinstance(shard, dict) or not {"index", "offset", "nbytes"} <= set(shard):
                raise ValueError(f"{path}: expected shards that are objects with index, offset and nbytes")
            index, offset, nbytes = shard["index"], shard["offset"], shard["nbytes"]
            elements = _index_size(index, shape, path)
            if index in indices:
                raise ValueError(f"{path} [{index}]: the same shard a second time")
            indices.add(index)
            if not _is_count(offset) or not _is_count(nbytes):
                raise ValueError(
                    f"{path} [{index}]: expected offset and nbytes that are ints >= 0. "
                    f"Received: offset={short_repr(offset)}, nbytes={short_repr(nbytes)}"
                )
            if nbytes != elements * ARRAY_DTYPES[dtype].itemsize:
                raise ValueError(
                    f"{path} [{index}]: nbytes={nbytes:,}, expected {elements:,} elements of {dtype} "
                    f"({elements * ARRAY_DTYPES[dtype].itemsize:,} bytes)"
                )
            if offset + nbytes > data_length:
                raise ValueError(
                    f"{path} [{index}]: bytes {offset:,} to {offset + nbytes:,}, past the part's {data_length:,} "
                    "array bytes (the part ends inside it)"
                )


def _index_size(index: Any, shape: list[int], path: str) -> int:
    """The elements of a shard's `index` ("start:stop" an axis of `shape`, comma-separated; "" for a scalar),
    after checking it lies within the shape; `ValueError` naming `path` otherwise."""
    if not isinstance(index, str):
        raise ValueError(f"{path}: a shard's index: expected a string. Received: {short_repr(index)}")
    ranges = index.split(",") if index else []
    if len(ranges) != len(shape):
        raise ValueError(f"{path} [{short_repr(index)}]: expected a range for each of the {len(shape)} axes")
    sizes = []
    for text, dim in zip(ranges, shape, strict=True):
        match = _RANGE.fullmatch(text)
        if match is None or not int(match[1]) <= int(match[2]) <= dim:
            raise ValueError(
                f"{path} [{short_repr(index)}]: expected start:stop ranges within shape {shape} "
                f"(0 <= start <= stop <= the axis's length)"
            )
        sizes.append(int(match[2]) - int(match[1]))
    return math.prod(sizes)


def unpack(part, template, shared: bool = False) -> Any:
    """The tree of a part, laid out as `template` (device arrays on its shardings, numpy arrays on the host).

    `shared`: the part lies in memory its owner reuses once this returns (the keeper's shared memory): an
    array whose device kept a view of the part's bytes instead of copying them (a CPU device may) is copied
    out of it; the others were copied by their transfer to the device already.

    `ValueError` names what differs when the part does not fit the template (another model, another layout)
    or is not a part `pack` wrote (`unpack_header` checks it all before anything is read or allocated: no
    other exception comes of a bad part). The part's bytes are the caller's to check: `MemoryTier.newest`
    returns only a part that matches the digest it was sent with.
    """
    header, data = unpack_header(part)  # checks every field: what follows reads only the part's own bytes
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
        for shard in saved["shards"]:  # each within `data`, of a whole number of elements (`unpack_header`)
            raw = data[shard["offset"] : shard["offset"] + shard["nbytes"]]
            shards[shard["index"]] = np.frombuffer(raw, dtype=dtype)
        found.append((name, like, shape, shards))
    # Arrays built on several threads for a large part: each transfer to a device is one core's copy into
    # fresh memory, page faults and all.
    leaves = protocol.in_pieces(lambda leaf: _rebuilt(*leaf), found, len(data))
    if shared:
        base = np.frombuffer(part, np.uint8).ctypes.data
        leaves = [_owned(leaf, base, base + len(part)) for leaf in leaves]
    return decode(jax.tree_util.tree_unflatten(treedef, leaves), template)


def _owned(leaf, low: int, high: int):
    """`leaf` with no buffer inside the addresses [low, high) (shared memory about to be unmapped or reused)."""
    if not isinstance(leaf, jax.Array):
        return leaf
    inside = any(low <= shard.data.unsafe_buffer_pointer() < high for shard in leaf.addressable_shards)
    return jnp.copy(leaf) if inside else leaf


def _rebuilt(name: str, like, shape: tuple[int, ...], shards: dict[str, np.ndarray]):
    """A leaf laid out as `like` from this process's shards of it."""
    whole = _index_key(tuple(slice(None) for _ in shape), shape)
    if not on_devices(like):  # a host value: `pack` wrote it whole
        if set(shards) != {whole}:
            raise ValueError(f"{name}: expected the host array whole [{whole}] as its one shard, found {len(shards)}")
        return np.array(shards[whole].reshape(shape))

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
