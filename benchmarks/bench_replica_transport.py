"""A snapshot part's replica to another Ray node: the keepers' sockets against Ray's object store.

Under `meshfit launch --ray` the memory tier keeps each rank's part in its node's keeper and a replica in
another node's keeper (`memory_replicas`), so a lost node loses no snapshot. Issue 49 asks that replicas
be the keeper's job, off the rank's path, and that on Ray the faster of two transports carry them: the
keepers' own protocol (`meshfit.runtime.keeper_protocol`: an HMAC-authenticated TCP connection, a JSON
header, the raw bytes read into one buffer, an XXH3 digest checked on arrival) or Ray's object store
(`ray.put` on one node, `ray.get` on the other). This measures both, on a real two-node Ray cluster
(`ray.cluster_utils.Cluster`, token authentication on, as `tests/ray_clusters.py` starts it) on this
machine, with a part of `--mib` MiB of random bytes held by an actor on node A:

  * keepers: a real `meshfit.launch.keeper.Keeper` in an actor on node B (as `meshfit.launch.ray_keepers`
    runs it, listening on the node's IP); the actor on A sends the part with the calls
    `MemoryTier._put` makes for a replica (a `put` header, the payload, the keeper's answer), on one
    connection kept across parts as the tier keeps it. Timed until the keeper answers that it holds the
    part whole: it read the bytes into its own memory (its buffers recycled from evicted snapshots, as
    in a fit) and checked their digest.
  * Ray's object store: the actor on A `ray.put`s the part (into A's store) and asks the actor on B to
    `ray.get` it (Ray moves it into B's store; the array is a view of it) and check the same XXH3 digest.
    Timed until B answers. The digest of the part is computed once beforehand for both paths, as the
    tier computes it once for its own keeper and every replica.
  * baselines, the machine's limits: a bare TCP socket between the same two actors (`sendall` of the
    bytes, `recv_into` one buffer already paged in, one byte back), the ratio's denominator; a memcpy in
    one process (`np.copyto` into a buffer already paged in, one core); the XXH3 digest alone (what the
    two checked paths add over the socket on the receiving side).

Each round times every path once, alternating, after `--warmup` untimed rounds (so the keeper reuses the
memory of the snapshots it evicts and every buffer is paged in); printed: the median of `--repeats`
rounds in seconds and GB/s (1e9 bytes), and the speed relative to the bare socket (its seconds over the
path's: above 1 is faster than the socket), also as "paired": the median over rounds of that ratio.
Both nodes are processes of this one machine, so "the network" is the loopback device and every copy
competes for the same cores and memory bus: a real network changes the absolute figures.

    python benchmarks/bench_replica_transport.py [--mib 256 [1024 ...]] [--repeats 3] [--warmup 3]

Needs Ray (`pip install "meshfit[ray]"`).
"""

from __future__ import annotations

import argparse
import io
import os
import socket
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from smoke import parse_args  # noqa: E402

FIT = "bench-replica-transport"  # the keeper keeps snapshots by fit (a backup directory's name)
PATHS = (
    ("socket", "bare TCP socket, loopback (baseline)"),
    ("keeper", "keepers' protocol: put, digest checked, held"),
    ("ray", "Ray object store: put, get, digest checked"),
    ("memcpy", "memcpy in one process (one core)"),
    ("digest", "XXH3 digest of the part alone"),
)


class Receiver:
    """Node B: a keeper (as `ray_keepers` runs one), a bare socket sink, and a holder of `ray.get` parts."""

    def __init__(self, key: bytes, size: int):
        import threading

        import ray

        from meshfit.launch.keeper import Keeper

        self.host = ray.util.get_node_ip_address()
        self.log = io.StringIO()  # what the keeper says (returned by `close`)
        self.keeper = Keeper(self.log, host=self.host, key=key)
        self.size = size
        self.buffer = bytearray(size)  # the sink's one buffer, paged in by the warm-up rounds
        self.sink = socket.create_server((self.host, 0))
        self.held = None  # the newest `ray.get` part (its ref and array), kept in this node's store
        threading.Thread(target=self._drain, daemon=True).start()

    def addresses(self) -> dict:
        return {"keeper": self.keeper.address, "sink": [self.host, self.sink.getsockname()[1]]}

    def _drain(self) -> None:
        conn, _ = self.sink.accept()
        with conn:
            view = memoryview(self.buffer)
            while True:
                got = 0
                while got < self.size:
                    read = conn.recv_into(view[got:], min(self.size - got, 16 << 20))
                    if not read:
                        return
                    got += read
                conn.sendall(b"k")

    def hold(self, refs: list, digest: str) -> dict:
        """`ray.get`s the part (pulled into this node's object store), checks its digest, keeps it."""
        import ray

        from meshfit.runtime import keeper_protocol as protocol

        began = time.perf_counter()
        array = ray.get(refs[0])
        got = time.perf_counter()
        whole = len(array) == self.size and protocol.digest(array) == digest
        checked = time.perf_counter()
        self.held = (refs[0], array)  # the previous part's memory goes once this one is held
        return {"whole": whole, "get": got - began, "check": checked - got}

    def sink_digest(self) -> str:
        from meshfit.runtime import keeper_protocol as protocol

        return protocol.digest(self.buffer)

    def committed(self) -> list[int]:
        return self.keeper.committed_steps(FIT)

    def close(self) -> str:
        self.held = None
        self.keeper.close()
        return self.log.getvalue()


class Sender:
    """Node A: the part, and each path's sending side, timed here."""

    def __init__(self, size: int, key: bytes):
        import numpy as np

        from meshfit.runtime import keeper_protocol as protocol

        self.part = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)  # incompressible
        self.digest = protocol.digest(self.part)
        self.copy = np.empty_like(self.part)
        self.key = key
        self.conn = None  # to the keeper on B, kept across parts as the memory tier keeps it
        self.sock: socket.socket | None = None  # to B's bare sink
        self.step = 0

    def part_digest(self) -> str:
        return self.digest

    def keeper(self, address: str) -> float:
        """Puts the part to the keeper at `address` as `MemoryTier._put` sends a replica; seconds until the
        keeper answers that it holds it whole."""
        from meshfit.runtime import keeper_protocol as protocol

        if self.conn is None:
            self.conn = protocol.connect(address, self.key)
        conn, size = self.conn, len(self.part)
        self.step += 1  # a new step each time: the keeper evicts and recycles as in a fit
        began = time.perf_counter()
        header = {"op": "put", "step": self.step, "start": 0, "size": size, "digest": self.digest}
        protocol.send_json(conn, {"fit": FIT, "rank": 0, "world": 1, **header, "expect": [0]})
        reply = protocol.recv_json(conn)
        if not reply.get("ok"):
            raise RuntimeError(f"the keeper refused the part: {reply.get('message')}")
        protocol.send_payload(conn, self.part)
        protocol.set_timeout(conn, protocol.reply_timeout(size))  # the keeper checks the part first
        reply = protocol.recv_json(conn)
        protocol.set_timeout(conn, protocol.ANSWER_TIMEOUT)
        seconds = time.perf_counter() - began
        if not (reply.get("ok") and reply.get("committed")):
            raise RuntimeError(f"the keeper did not hold the part of step {self.step}: {reply}")
        return seconds

    def object_store(self, receiver) -> dict:
        """`ray.put`s the part here and has `receiver` (node B) get and check it; seconds until it answers."""
        import ray

        began = time.perf_counter()
        ref = ray.put(self.part)
        put = time.perf_counter()
        got = ray.get(receiver.hold.remote([ref], self.digest))
        seconds = time.perf_counter() - began
        if not got["whole"]:
            raise RuntimeError("the part Ray's object store delivered does not match its digest")
        return {"seconds": seconds, "put": put - began, **got}

    def bare_socket(self, sink: list) -> float:
        if self.sock is None:
            self.sock = socket.create_connection(tuple(sink))
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        began = time.perf_counter()
        self.sock.sendall(memoryview(self.part))
        if self.sock.recv(1, socket.MSG_WAITALL) != b"k":
            raise RuntimeError("the sink closed before acknowledging the part")
        return time.perf_counter() - began

    def memcpy(self) -> float:
        import numpy as np

        began = time.perf_counter()
        np.copyto(self.copy, self.part)
        return time.perf_counter() - began

    def digest_alone(self) -> float:
        from meshfit.runtime import keeper_protocol as protocol

        began = time.perf_counter()
        protocol.digest(self.part)
        return time.perf_counter() - began

    def close(self) -> None:
        for channel in (self.conn, self.sock):
            if channel is not None:
                channel.close()


def load() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def measure(ray, mib: float, args, pin_a: dict, pin_b: dict) -> dict[str, list[float]]:
    """One size: actors on A and B, `args.warmup` untimed rounds, `args.repeats` timed; seconds by path."""
    import secrets

    size = max(1, int(mib * (1 << 20)))
    key = secrets.token_bytes(32)
    receiver = ray.remote(Receiver).options(num_cpus=0, **pin_b).remote(key, size)
    sender = ray.remote(Sender).options(num_cpus=0, **pin_a).remote(size, key)
    try:
        where = ray.get(receiver.addresses.remote())
        times: dict[str, list[float]] = {name: [] for name, _ in PATHS}
        splits: list[dict] = []
        for round_ in range(args.warmup + args.repeats):
            timed = round_ >= args.warmup
            row = {
                "socket": ray.get(sender.bare_socket.remote(where["sink"])),
                "keeper": ray.get(sender.keeper.remote(where["keeper"])),
            }
            split = ray.get(sender.object_store.remote(receiver))
            row["ray"] = split["seconds"]
            row["memcpy"] = ray.get(sender.memcpy.remote())
            row["digest"] = ray.get(sender.digest_alone.remote())
            if timed:
                for name, seconds in row.items():
                    times[name].append(seconds)
                splits.append(split)
        digest = ray.get(sender.part_digest.remote())
        if ray.get(receiver.sink_digest.remote()) != digest:
            raise RuntimeError("the bare socket's sink holds other bytes than the part")
        committed = ray.get(receiver.committed.remote())
        if args.warmup + args.repeats not in committed:
            raise RuntimeError(f"the keeper on node B does not hold the last part (it holds steps {committed})")
    finally:
        ray.get(sender.close.remote())
        said = ray.get(receiver.close.remote())
        ray.kill(sender)
        ray.kill(receiver)
    report(size, times, splits, args)
    for line in said.splitlines():
        print("  the keeper on B said: " + line.removeprefix("[launch] keeper: "))
    return times


def report(size: int, times: dict[str, list[float]], splits: list[dict], args) -> None:
    median = {name: statistics.median(values) for name, values in times.items()}
    socket_s = times["socket"]
    print(
        f"\npart of {size / (1 << 20):g} MiB, node A -> node B; median of {args.repeats} round(s) after "
        f"{args.warmup} warm-up round(s); {load()}"
    )
    print(f"  {'path':48s} {'seconds':>8s} {'GB/s':>7s} {'x socket':>9s} {'paired':>7s}")
    for name, label in PATHS:
        paired = statistics.median(s / t for s, t in zip(socket_s, times[name], strict=True))
        print(
            f"  {label:48s} {median[name]:8.4f} {size / median[name] / 1e9:7.2f} "
            f"{median['socket'] / median[name]:9.2f} {paired:7.2f}"
        )
    parts = {part: statistics.median(s[part] for s in splits) for part in ("put", "get", "check")}
    print(
        f"  Ray's split (medians): ray.put on A {parts['put']:.3f} s, ray.get on B {parts['get']:.3f} s, "
        f"digest check on B {parts['check']:.3f} s"
    )
    keeper, store = median["keeper"], median["ray"]
    faster, slower = (
        ("keepers' sockets", "Ray's object store") if keeper <= store else ("Ray's object store", "keepers' sockets")
    )
    print(f"  faster replica path: {faster}, {max(keeper, store) / min(keeper, store):.2f}x {slower}'s speed")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, nargs="+", default=[256.0], help="the part's size(s), MiB")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (each path once a round)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first (the keeper then recycles)")
    args = parse_args(parser, argv, mib=[0.25], repeats=1, warmup=1)
    try:
        import ray
    except ImportError:
        sys.exit("bench_replica_transport.py needs Ray: pip install 'meshfit[ray]'")
    from ray_clusters import token_cluster

    # Each node's object store holds the part as A put it, B's copy, and the one B holds from the round
    # before, with room to spare; the head (no CPUs, nothing scheduled) a small one.
    store = int(3.5 * max(args.mib) * (1 << 20)) + (128 << 20)
    nodes = [
        {"num_cpus": 1, "resources": {"replica_node_a": 1}, "object_store_memory": store},
        {"num_cpus": 1, "resources": {"replica_node_b": 1}, "object_store_memory": store},
    ]
    began = time.perf_counter()
    with token_cluster({"num_cpus": 0, "object_store_memory": 128 << 20}, nodes) as (cluster, _):
        ray.init(address=cluster.address, log_to_driver=True)
        try:
            print(
                f"Ray {ray.__version__}: a head and two nodes (A, B) on this machine, token auth, "
                f"{os.cpu_count()} CPU cores; started in {time.perf_counter() - began:.1f} s; {load()}"
            )
            for mib in args.mib:
                measure(
                    ray, mib, args, {"resources": {"replica_node_a": 0.01}}, {"resources": {"replica_node_b": 0.01}}
                )
        finally:
            ray.shutdown()


if __name__ == "__main__":
    main()
