"""Hostile peers, for tests and benchmarks: every port a job's processes listen on, and strangers that connect.

A stranger on the same machine can reach every listening port of a job. Three
kinds are played here, each over a real TCP connection to each port:

- silent: connects and says nothing, holding the socket open until the end;
- garbage: sends random bytes after a length header that claims 2 GiB, then closes;
- unauthenticated: speaks the port's protocol without the job's secret: it
  answers a `multiprocessing.connection` HMAC challenge with a wrong digest
  where the port sends one, and otherwise sends what a client of another job
  sends first (an HTTP/2 preface, as gRPC does, and a start-up hello of another
  protocol version).

`Strangers(job.proc.pid)` (a `processes.Job` is a process group) finds the
ports while the job runs, from `/proc/net/tcp*` and the socket inodes in each
process's `/proc/<pid>/fd`, and attacks each new port at once (start-up) and
every `every` seconds after (training).
"""

from __future__ import annotations

import os
import re
import socket
import struct
import threading
import time

KINDS = ("silent", "garbage", "unauthenticated")
_LISTEN = "0A"  # TCP state LISTEN in /proc/net/tcp
_CHALLENGE = b"#CHALLENGE#"  # what `multiprocessing.connection.deliver_challenge` sends first
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def group_pids(pgid: int) -> list[int]:
    """The live processes of process group `pgid` (a `processes.Job` is one: a launcher and its ranks)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, pgrp, ...
        if fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(int(entry))
    return pids


def _listening_inodes() -> dict[int, int]:
    """Socket inode -> port of every TCP socket listening on this machine (IPv4 and IPv6)."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == _LISTEN:
                found[int(cols[9])] = int(cols[1].rsplit(":", 1)[1], 16)
    return found


def listening_ports(pids: list[int]) -> dict[int, set[int]]:
    """pid -> the TCP ports it listens on, matching its socket descriptors with the kernel's table of listeners."""
    inodes = _listening_inodes()
    ports: dict[int, set[int]] = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            match = re.fullmatch(r"socket:\[(\d+)\]", target)
            if match and int(match.group(1)) in inodes:
                ports.setdefault(pid, set()).add(inodes[int(match.group(1))])
    return ports


def _connect(port: int) -> socket.socket | None:
    try:
        return socket.create_connection(("127.0.0.1", port), timeout=2.0)
    except OSError:
        return None


def garbage(port: int, seed: int) -> bool:
    """Sends a length header claiming 2 GiB and 64 KiB of random bytes, then closes; False if nothing answered."""
    sock = _connect(port)
    if sock is None:
        return False
    with sock:
        try:
            sock.sendall(struct.pack("!i", 0x7FFFFFFF) + os.urandom(65536) + bytes([seed % 256]) * 16)
        except OSError:
            pass  # the port closed on us: what a careful server does
    return True


def unauthenticated(port: int) -> bool:
    """Speaks the port's first step without the job's secret (see the module); False if nothing answered."""
    sock = _connect(port)
    if sock is None:
        return False
    with sock:
        sock.settimeout(0.5)
        try:
            first = sock.recv(4096)
        except OSError:
            first = b""
        try:
            if _CHALLENGE in first:
                sock.sendall(struct.pack("!i", 16) + b"\x00" * 16)  # a wrong HMAC digest
                sock.settimeout(2.0)
                sock.recv(4096)  # the refusal
            else:
                sock.sendall(_HTTP2_PREFACE + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
                sock.sendall(b'{"protocol": "meshfit-join/0", "id": 1, "processes": 2}\n')
                time.sleep(0.2)
        except OSError:
            pass
    return True


class Strangers:
    """Attacks every listening port of a process group with each kind of stranger until `stop()`.

    Attacks each port as soon as it appears, then every `every` seconds;
    silent connections stay open until `stop()`. `select(pid, port)`, if
    given, picks the ports to attack. `injected` counts the connections made,
    by kind; `ports` maps each pid to the ports found.
    """

    def __init__(self, pgid: int, every: float = 2.0, scan: float = 0.1, select=None):
        self.pgid, self.every, self.scan = pgid, every, scan
        self.select = select or (lambda pid, port: True)  # which (pid, port) to attack: every one by default
        self.injected = dict.fromkeys(KINDS, 0)
        self.ports: dict[int, set[int]] = {}
        self._silent: list[socket.socket] = []
        self._last: dict[int, float] = {}  # port -> when last attacked
        self._lock = threading.Lock()
        self._attacks: list[threading.Thread] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="strangers")

    def __enter__(self) -> Strangers:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        for attack in self._attacks:
            attack.join(timeout=10)
        for sock in self._silent:
            sock.close()
        self._silent.clear()

    @property
    def total(self) -> int:
        return sum(self.injected.values())

    def _run(self) -> None:
        while not self._stop.wait(self.scan):
            now = time.monotonic()
            for pid, ports in listening_ports(group_pids(self.pgid)).items():
                self.ports.setdefault(pid, set()).update(ports)
                for port in ports:
                    if self.select(pid, port) and now - self._last.get(port, -1e9) >= self.every:
                        self._last[port] = now
                        attack = threading.Thread(target=self._attack, args=(port,), daemon=True)
                        self._attacks.append(attack)
                        attack.start()

    def _attack(self, port: int) -> None:
        """One stranger of each kind at `port` (a thread per port and round: a slow port holds up no other)."""
        sock = _connect(port)
        made = {"silent": sock is not None, "garbage": garbage(port, port), "unauthenticated": unauthenticated(port)}
        with self._lock:
            if sock is not None:
                if self._stop.is_set():
                    sock.close()
                else:
                    self._silent.append(sock)
            for kind, done in made.items():
                self.injected[kind] += done
