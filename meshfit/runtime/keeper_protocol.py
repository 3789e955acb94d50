"""How a training process and the launcher's snapshot keeper talk: authenticated frames of JSON and bytes.

The keeper (`meshfit.launch.keeper`) holds the memory tier of
`BackupAndRestore(memory_freq=K)` in the launcher's process, outside the
ranks, so a rank that dies does not take its snapshot with it. A rank finds it
through two variables the launcher sets (`ENV_KEEPER_ADDRESS`,
`ENV_KEEPER_AUTHKEY`); the key is fresh for each `meshfit launch` and lives
across its restarts, as the snapshots do.

Every connection first runs `multiprocessing.connection`'s HMAC challenge both
ways within `HANDSHAKE_TIMEOUT` (`handshake`): a peer that stays silent, sends
garbage or lacks the key is dropped. After it, every message is a frame of
JSON (`send_json`, `recv_json`: an object, at most `HEADER_LIMIT` bytes),
optionally followed by a payload: exactly the bytes the JSON announced
(`size`) and their `digest`, written to the socket unframed (`send_payload`)
and read into one buffer allocated up front (`recv_payload`): a snapshot is
gigabytes, and a frame reader that grows its buffer as bytes come moves them
at a fraction of the socket's speed. Nothing is ever unpickled: the keeper
stores and returns bytes, and the ranks parse their own snapshots.

Imports nothing of JAX: the launcher imports this module.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import os
import socket
import struct
from multiprocessing.connection import Connection

import xxhash

from meshfit.runtime.handshake import handshake

#: `host:port` of the launcher's keeper (set by `meshfit launch`; absent without a launcher). Under
#: `meshfit launch --ray`, the keepers of the nodes that run ranks, comma-separated (node 0's first), then
#: those of nodes that ran ranks before a restart and still hold snapshots.
ENV_KEEPER_ADDRESS = "MESHFIT_KEEPER_ADDRESS"
#: Under `--ray`: each keeper of `ENV_KEEPER_ADDRESS`, in its order, as `unix:PATH` of its socket on its own
#: node, comma-separated: a rank reaches its own node's keeper there, where no other user can connect.
ENV_KEEPER_LOCAL = "MESHFIT_KEEPER_LOCAL"
#: The keepers' secret, hex (one per launch): every connection proves it knows it.
ENV_KEEPER_AUTHKEY = "MESHFIT_KEEPER_AUTHKEY"
#: Under `--ray`: each rank's own node's keeper, as indices into `ENV_KEEPER_ADDRESS`, comma-separated by
#: rank. Absent: every rank's keeper is the first.
ENV_KEEPER_HOMES = "MESHFIT_KEEPER_HOMES"
#: Under `--ray`: the snapshot each fit resumes from, chosen by the launcher from what the surviving keepers
#: hold, as JSON {fit: [step, start]}. Absent: each rank asks its keeper for the newest.
ENV_KEEPER_RESUME = "MESHFIT_KEEPER_RESUME"
#: Bytes the keeper may hold (a number; read by the launcher). Default: what `MemAvailable` allows.
ENV_KEEPER_MAX_BYTES = "MESHFIT_KEEPER_MAX_BYTES"
#: The launchers that keep snapshots, for messages.
LAUNCHERS_WITH_KEEPER = (
    "`meshfit launch --nprocs N` (one machine) and `meshfit launch --ray` (a keeper on each node that runs ranks)"
)

#: The largest JSON frame read: requests and replies are a few hundred bytes.
HEADER_LIMIT = 64 * 1024
#: `digest` hashes a buffer in pieces of this many bytes, several at once.
DIGEST_CHUNK = 16 << 20
#: Bytes moved by one system call of `send_payload` and `recv_payload`.
_IO_CHUNK = 16 << 20
#: Seconds a rank waits for the keeper to make progress on a request (a read or write that moves nothing):
#: a keeper that stops answering turns the memory tier off after this long, and the fit goes on from disk.
ANSWER_TIMEOUT = 10.0
#: Bytes a second the keeper is granted, on top of `ANSWER_TIMEOUT`, to check a part before it answers.
CHECK_RATE = 256 << 20
#: How an address names a keeper's Unix socket (`unix:PATH`): the ranks on its node connect there.
UNIX_PREFIX = "unix:"


class ProtocolError(Exception):
    """A frame that is not what the protocol says: the connection is closed."""


def available() -> bool:
    """Whether this process was started by a launcher that keeps snapshots."""
    return bool(os.environ.get(ENV_KEEPER_ADDRESS) and os.environ.get(ENV_KEEPER_AUTHKEY))


def addresses() -> list[str]:
    """The keepers' `host:port`s named by the environment (the first: this rank's keeper on one machine)."""
    return [a for a in os.environ.get(ENV_KEEPER_ADDRESS, "").split(",") if a]


def local_addresses() -> list[str]:
    """`ENV_KEEPER_LOCAL`'s Unix socket of each keeper of `addresses()` ("" where none is named)."""
    named = [a for a in os.environ.get(ENV_KEEPER_LOCAL, "").split(",")]
    return [named[i] if i < len(named) else "" for i in range(len(addresses()))]


def homes(world: int) -> list[int]:
    """Each rank's own node's keeper (an index into `addresses()`), by rank."""
    text = os.environ.get(ENV_KEEPER_HOMES, "")
    return [int(h) for h in text.split(",")] if text else [0] * world


def nodes() -> int:
    """How many keepers of distinct nodes the ranks can send to (the nodes that run ranks)."""
    return max(homes(1)) + 1


def replica_keepers(homes: list[int], rank: int, replicas: int) -> list[int]:
    """The keepers that hold `rank`'s part: its own node's, then the next `replicas - 1` nodes' in turn."""
    n = max(homes) + 1
    return [(homes[rank] + i) % n for i in range(min(replicas, n))]


def expected_ranks(homes: list[int], keeper: int, replicas: int) -> list[int]:
    """The ranks whose parts `keeper` holds once a snapshot is whole there."""
    return [r for r in range(len(homes)) if keeper in replica_keepers(homes, r, replicas)]


def connect(address: str | None = None, key: bytes | None = None, timeout: float | None = None) -> Connection:
    """An authenticated connection to the keeper named by the environment (or `address`, `key`), the
    connection and handshake within `timeout` seconds (None: `ANSWER_TIMEOUT`).

    `address` is `host:port`, or `unix:PATH` for a keeper's socket on this node (`Keeper.local_address`).
    Every later read and write on the connection gives up after `ANSWER_TIMEOUT` seconds without progress
    (`OSError`): a keeper that stops answering (stopped, or its host swapping) never holds a rank for longer.
    """
    address = address or addresses()[0]
    key = key if key is not None else bytes.fromhex(os.environ[ENV_KEEPER_AUTHKEY])
    timeout = ANSWER_TIMEOUT if timeout is None else timeout
    if address.startswith(UNIX_PREFIX):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(address[len(UNIX_PREFIX) :])
        except BaseException:
            sock.close()
            raise
    else:
        host, port = address.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(None)
    conn = Connection(sock.detach())
    try:
        handshake(conn, key, accepting=False, timeout=timeout)
        set_timeout(conn, ANSWER_TIMEOUT)
    except BaseException:
        conn.close()
        raise
    return conn


def set_timeout(conn: Connection, seconds: float) -> None:
    """Makes each read and write on `conn` raise `OSError` (EAGAIN) after `seconds` without progress (0: never).

    The kernel's own bound (`SO_RCVTIMEO`, `SO_SNDTIMEO`) on the blocking socket: `Connection` and
    `send_payload`/`recv_payload` read and write it with plain system calls, which then fail instead of
    blocking forever. It bounds a stall, not a transfer: gigabytes that keep moving never time out.
    """
    whole, fraction = divmod(max(seconds, 0.001), 1.0) if seconds else (0, 0)  # 0: no bound
    value = struct.pack("ll", int(whole), int(fraction * 1e6))
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:  # the same socket: options are the socket's
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


def error_text(error: BaseException) -> str:
    """`error` for a one-line warning or log line: its type, and its message where it has one."""
    text = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
    if isinstance(error, BlockingIOError):
        text = f"no answer within {ANSWER_TIMEOUT:g} s"
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def reply_timeout(nbytes: int) -> float:
    """Seconds to wait for the keeper's answer to a part of `nbytes` it checks before answering."""
    return ANSWER_TIMEOUT + nbytes / CHECK_RATE


def settle_timeout() -> float:
    """Seconds a keeper waits, when asked to `settle`, for the replicas it sends on to arrive before it answers:
    half of `ANSWER_TIMEOUT`, so the rank that asked has its answer within its own bound."""
    return ANSWER_TIMEOUT / 2


def send_part(conn: Connection, header: dict, payload) -> dict:
    """Sends a part with its `put` header (`size` and `digest` of `payload` in it) and returns the keeper's
    answer: a refusal before any byte is sent, or, once the keeper has read and checked the part (granted
    `reply_timeout`), whether it holds it (`committed`: the part completed its snapshot there)."""
    send_json(conn, header)
    reply = recv_json(conn)
    if not reply.get("ok"):
        return reply
    send_payload(conn, payload)
    set_timeout(conn, reply_timeout(len(payload)))  # the keeper checks the part first
    reply = recv_json(conn)
    set_timeout(conn, ANSWER_TIMEOUT)
    return reply


def send_json(conn: Connection, message: dict) -> None:
    conn.send_bytes(json.dumps(message).encode())


def recv_json(conn: Connection) -> dict:
    """The next JSON frame, an object; `ProtocolError` for anything else (EOFError when the peer closed)."""
    try:
        raw = conn.recv_bytes(HEADER_LIMIT)
    except (BlockingIOError, ConnectionError):
        raise  # no answer within the connection's bound (`set_timeout`), or the peer is gone
    except OSError as error:  # "bad message length": larger than a header may be
        raise ProtocolError(f"a frame over {HEADER_LIMIT} bytes where a JSON header was expected ({error})") from None
    try:
        message = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError) as error:
        raise ProtocolError(f"a frame that is not JSON ({type(error).__name__})") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"a JSON {type(message).__name__} where an object was expected")
    return message


def send_payload(conn: Connection, data) -> None:
    """Writes `data` (any bytes-like object) to the connection as it is: the JSON before it announced its size."""
    view = memoryview(data).cast("B")
    fd = conn.fileno()
    while view:
        view = view[os.write(fd, view[:_IO_CHUNK]) :]


def recv_payload(conn: Connection, size: int, into=None):
    """The `size` bytes that follow the JSON frame announcing them, read into one buffer (`into`, any writable
    buffer, when it is `size` bytes long: memory already paged in, where a fresh buffer costs a page fault per
    4 KiB); `EOFError`
    when the peer closes before all of them came."""
    payload = into if into is not None and len(into) == size else bytearray(size)
    view = memoryview(payload)
    fd, got = conn.fileno(), 0
    while got < size:
        read = os.readv(fd, [view[got : got + _IO_CHUNK]])
        if read == 0:
            raise EOFError(f"the peer closed the connection after {got} of the {size} bytes announced")
        got += read
    return payload


@functools.cache
def _threads() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="meshfit-snapshot")


def in_pieces(fn, items: list, nbytes: int) -> list:
    """`[fn(item) for item in items]`, on up to 8 threads when `nbytes` (what they cover) is at least two
    `DIGEST_CHUNK`s: hashing and numpy copies let go of the interpreter lock, so gigabytes move on several
    cores. Under that, on this thread: handing small pieces to threads costs more than it saves, and the
    threads would take the interpreter lock from the training loop."""
    if nbytes < 2 * DIGEST_CHUNK:
        return [fn(item) for item in items]
    return list(_threads().map(fn, items))


def _xxh3(data) -> bytes:
    return xxhash.xxh3_64_digest(data)


def digest(data) -> str:
    """XXH3-64 of the XXH3-64s of `data`'s `DIGEST_CHUNK`-byte pieces, as hex (16 digits).

    A checksum against damage (a flipped bit in the keeper's memory, a part cut short), not a signature: who may
    send and fetch parts is settled by the connection's HMAC handshake. XXH3 runs at memory speed (about
    10 GB/s a core, against SHA-256's 1.4), so checking gigabytes costs a snapshot and a restore a fraction of
    a second, and pieces of large parts are hashed on several cores.
    """
    view = memoryview(data).cast("B")
    pieces = [view[i : i + DIGEST_CHUNK] for i in range(0, len(view), DIGEST_CHUNK)] or [view]
    return xxhash.xxh3_64_hexdigest(b"".join(in_pieces(_xxh3, pieces, len(view))))


def send_fd(conn: Connection, fd: int) -> None:
    """Passes the descriptor `fd` to the peer of the Unix connection `conn` (`SCM_RIGHTS`), after the frames
    sent before it: the peer gets its own descriptor of the same memory (`recv_fd`)."""
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        socket.send_fds(sock, [b"F"], [fd])


def recv_fd(conn: Connection) -> int:
    """The descriptor `send_fd` passed next on `conn` (the caller closes it); `ProtocolError` if none came."""
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        data, fds, _, _ = socket.recv_fds(sock, 1, 1)
    if data != b"F" or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise ProtocolError("a shared-memory answer without its descriptor")
    return fds[0]
