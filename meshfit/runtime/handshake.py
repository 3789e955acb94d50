"""The HMAC challenge both ways on a new connection, bounded in time: one handshake for every meshfit channel.

`multiprocessing.connection`'s challenge proves each side knows the job's key
without sending it. A peer that stays silent, trickles bytes, sends garbage or
lacks the key ends in one of `HANDSHAKE_ERRORS` within the bound, never
blocking the caller: the parameter server's channels and the launcher's
snapshot keeper both open with it. Imports nothing of JAX.
"""

from __future__ import annotations

import os
import socket
import threading
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

__all__ = ["HANDSHAKE_ERRORS", "HANDSHAKE_TIMEOUT", "handshake"]

#: Seconds a connection has to complete the challenge both ways, unless told otherwise.
HANDSHAKE_TIMEOUT = 10.0
#: What a peer that is not one of the job's processes can make the handshake raise: silence (EOFError once the
#: bound shuts the socket), garbage (OSError "bad message length", AssertionError) or a wrong key.
HANDSHAKE_ERRORS = (AuthenticationError, EOFError, OSError, AssertionError)


def shut(conn: Connection) -> None:
    """Wakes and ends whatever reads or writes `conn` on another thread, without closing its descriptor under it."""
    try:
        with socket.socket(fileno=os.dup(conn.fileno())) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def handshake(conn: Connection, key: bytes, accepting: bool, timeout: float = HANDSHAKE_TIMEOUT, then=None):
    """Runs the HMAC challenge both ways on `conn` (and `then(conn)`, say reading a hello) within `timeout` s.

    Returns what `then` returned; raises one of `HANDSHAKE_ERRORS` if the peer
    fails or does not finish in time: the bound shuts the socket, so a silent or
    trickling peer ends in EOFError instead of blocking the caller. The accepting
    side delivers the challenge first, as `multiprocessing.connection.Listener` does.
    """
    done, lock = False, threading.Lock()

    def shut_unless_done():
        with lock:
            if not done:
                shut(conn)

    timer = threading.Timer(timeout, shut_unless_done)
    timer.daemon = True
    timer.start()
    try:
        if accepting:
            deliver_challenge(conn, key)
            answer_challenge(conn, key)
        else:
            answer_challenge(conn, key)
            deliver_challenge(conn, key)
        result = then(conn) if then else None
        with lock:
            done = True
            timer.cancel()
        return result
    except BaseException:
        timer.cancel()
        raise
