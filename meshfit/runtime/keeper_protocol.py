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
JSON (`send_json`, `recv_json`: an object, at most `HEADER_LIMIT` bytes)
optionally followed by a frame of raw bytes. Nothing is ever unpickled: the
keeper stores and returns bytes, and the ranks parse their own snapshots.

Imports nothing of JAX: the launcher imports this module.
"""

from __future__ import annotations

import json
import os
import socket
from multiprocessing.connection import Connection

from meshfit.runtime.handshake import HANDSHAKE_TIMEOUT, handshake

#: `host:port` of the launcher's keeper (set by `meshfit launch`; absent without a launcher).
ENV_KEEPER_ADDRESS = "MESHFIT_KEEPER_ADDRESS"
#: The keeper's secret, hex: every connection proves it knows it.
ENV_KEEPER_AUTHKEY = "MESHFIT_KEEPER_AUTHKEY"
#: Bytes the keeper may hold (a number; read by the launcher). Default: what `MemAvailable` allows.
ENV_KEEPER_MAX_BYTES = "MESHFIT_KEEPER_MAX_BYTES"
#: The launchers that keep snapshots, for messages.
LAUNCHERS_WITH_KEEPER = "`meshfit launch --nprocs N` (one machine)"

#: The largest JSON frame read: requests and replies are a few hundred bytes.
HEADER_LIMIT = 64 * 1024


class ProtocolError(Exception):
    """A frame that is not what the protocol says: the connection is closed."""


def available() -> bool:
    """Whether this process was started by a launcher that keeps snapshots."""
    return bool(os.environ.get(ENV_KEEPER_ADDRESS) and os.environ.get(ENV_KEEPER_AUTHKEY))


def connect(address: str | None = None, key: bytes | None = None, timeout: float = HANDSHAKE_TIMEOUT) -> Connection:
    """An authenticated connection to the keeper named by the environment (or `address`, `key`)."""
    address = address or os.environ[ENV_KEEPER_ADDRESS]
    key = key if key is not None else bytes.fromhex(os.environ[ENV_KEEPER_AUTHKEY])
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn = Connection(sock.detach())
    try:
        handshake(conn, key, accepting=False, timeout=timeout)
    except BaseException:
        conn.close()
        raise
    return conn


def send_json(conn: Connection, message: dict) -> None:
    conn.send_bytes(json.dumps(message).encode())


def recv_json(conn: Connection) -> dict:
    """The next JSON frame, an object; `ProtocolError` for anything else (EOFError when the peer closed)."""
    try:
        raw = conn.recv_bytes(HEADER_LIMIT)
    except OSError as error:  # "bad message length": larger than a header may be
        raise ProtocolError(f"a frame over {HEADER_LIMIT} bytes where a JSON header was expected ({error})") from None
    try:
        message = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError) as error:
        raise ProtocolError(f"a frame that is not JSON ({type(error).__name__})") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"a JSON {type(message).__name__} where an object was expected")
    return message


def recv_payload(conn: Connection, size: int) -> bytes:
    """The next bytes frame, which must be exactly `size` bytes long."""
    try:
        payload = conn.recv_bytes(max(size, 1))
    except OSError as error:
        raise ProtocolError(f"a payload over the {size} bytes announced ({error})") from None
    if len(payload) != size:
        raise ProtocolError(f"a payload of {len(payload)} bytes, {size} announced")
    return payload
