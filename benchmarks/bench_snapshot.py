"""Where a memory-tier snapshot's time goes, as ratios to the same machine's memcpy and socket.

A state of `--gib` GiB (float32 arrays of `--array-mib` MiB on the default
device) is snapshotted to a real keeper (`meshfit.launch.keeper.Keeper`, in a
child process as under `meshfit launch`, reached through its Unix socket)
`--repeats` times through `MemoryTier.save` and `wait`: the seconds per
snapshot. Then the phases of one snapshot, each timed alone in the order the
tier's sender thread runs them: the copy on the device, the copy to the
host, writing the part (one copy into a buffer), its checksum (XXH3), the
hand-over (the part written into the keeper's shared memory, its checksum,
the commit); and a restore (the keeper's memory mapped, the checksum, arrays
rebuilt on the device). The baselines are the machine's limits: memcpy of
the state's bytes into a buffer already paged in (on the cores the tier's
copies use), and `jax.device_get` of the state with its bytes written to a
socket that a child process reads into one buffer. On a GPU it also times
the copy to the host through `pinned_host` memory.

With `--replicas 2` the child runs two keepers, as two Ray nodes' keepers
under `meshfit launch --ray` (here both on this machine, reached over
loopback TCP): the rank's own (its Unix socket, its shared memory) and
another node's, which holds the replica that the rank's own keeper sends on.
It also prints the rank's own time per snapshot (`MemoryTier.send_seconds`,
from the device copies to its own keeper's answer: what the sender thread is
busy with), beside the whole (`save` and `wait`, which waits for the
replicas too).

    python benchmarks/bench_snapshot.py [--gib 1] [--array-mib 64] [--repeats 3] [--replicas 1]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time

from smoke import parse_args


def serve(replicas: int) -> None:
    """The child: a keeper (and, with `replicas` 2, another node's that holds the replicas) and a raw sink
    (reads `size` bytes into one buffer, answers one byte); prints where."""
    from meshfit.launch.keeper import Keeper
    from meshfit.runtime import keeper_protocol as protocol

    keeper = Keeper(log=sys.stderr)
    env = keeper.env()
    if replicas > 1:  # the rank's own keeper (keeper 1, its `HOMES`) and another node's (keeper 0)
        other = Keeper(log=sys.stderr, key=keeper.key)
        if hasattr(keeper, "set_peers"):  # (a keeper from before replicas were its job: the rank sends them)
            keeper.set_peers([other.address, keeper.address])
        env = {
            protocol.ENV_KEEPER_ADDRESS: f"{other.address},{keeper.address}",
            protocol.ENV_KEEPER_LOCAL: f",{keeper.local_address}",
            protocol.ENV_KEEPER_AUTHKEY: keeper.key.hex(),
            protocol.ENV_KEEPER_HOMES: "1",
        }
    sink = socket.create_server(("127.0.0.1", 0))

    def drain() -> None:
        while True:
            conn, _ = sink.accept()
            with conn:
                while header := conn.recv(8, socket.MSG_WAITALL):
                    (size,) = struct.unpack(">Q", header)
                    view, got = memoryview(bytearray(size)), 0
                    while got < size:
                        got += conn.recv_into(view[got:], min(size - got, 16 << 20))
                    conn.sendall(b"k")

    threading.Thread(target=drain, daemon=True).start()
    print(json.dumps({"env": env, "sink": sink.getsockname()[1]}), flush=True)
    sys.stdin.read()  # until the parent closes it
    keeper.close()


def timed(fn, repeats: int) -> float:
    """The median seconds of `repeats` calls of `fn`."""
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--gib", type=float, default=1.0, help="the state's size")
    parser.add_argument("--array-mib", type=int, default=64, help="the size of each array of the state")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--replicas", type=int, choices=(1, 2), default=1, help="keepers holding each snapshot")
    args = parse_args(parser, gib=1 / 64, array_mib=4, repeats=2, replicas=2)
    if args.serve:
        serve(args.replicas)
        return
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--replicas", str(args.replicas)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        where = json.loads(child.stdout.readline())
        os.environ.update(where["env"])
        run(args, where["sink"])
    finally:
        child.stdin.close()
        child.wait(timeout=60)


def run(args, sink_port: int) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from meshfit.checkpointing import memory_tier as tier
    from meshfit.checkpointing import snapshot_parts as parts
    from meshfit.runtime import keeper_protocol as protocol

    count = max(1, round(args.gib * 1024 / args.array_mib))
    elements = args.array_mib * (1 << 20) // 4
    keys = jax.random.split(jax.random.key(0), count)
    state = {f"w{i:03d}": jax.random.normal(k, (elements,), jnp.float32) for i, k in enumerate(keys)}
    state = jax.block_until_ready(state)
    nbytes = sum(x.nbytes for x in state.values())
    device = next(iter(state.values())).devices().pop()
    print(f"{device.platform} ({device.device_kind}): a state of {nbytes / 2**30:.2f} GiB in {count} arrays")
    meta = {  # what a backup's JSON part holds (`checkpoint_schema.BACKUP`), with nothing in it
        "epoch": 0,
        "step_in_epoch": 0,
        "data_origin": 0,
        "history": {},
        "history_epochs": [],
        "callbacks": {},
        "data": {},
        "format": 2,
        "array_specs": {},
    }

    memory = tier.MemoryTier(os.path.join(os.getcwd(), "bench-snapshot"), args.replicas)
    for step in range(-3, 0):  # compiles, connects, and fills the keeper (its newest 2 and a spare): from then
        memory.save(step + 3, state, meta)  # on each snapshot reuses the memory of the one it evicts, as in a fit
        memory.wait()

    steps = iter(range(3, 1 << 30))  # a new step each time: the keeper evicts and recycles as in a fit
    sending: list[float] = []

    def snapshot() -> None:
        memory.save(next(steps), state, meta)
        memory.wait()
        sending.append(memory.send_seconds)

    whole = timed(snapshot, args.repeats)

    sink = socket.create_connection(("127.0.0.1", sink_port))

    def baseline() -> None:
        host = jax.device_get(state)
        for value in host.values():
            sink.sendall(struct.pack(">Q", value.nbytes))
            sink.sendall(memoryview(value).cast("B"))
            sink.recv(1)

    baseline()
    bare = timed(baseline, args.repeats)

    # The machine's memcpy: the state's bytes copied into a buffer already paged in, on as many cores as the
    # tier's own copies use (`keeper_protocol.in_pieces`).
    host_state = [np.asarray(x).reshape(-1).view(np.uint8) for x in jax.device_get(list(state.values()))]
    target = np.empty(nbytes, np.uint8)
    chunk, pieces, at = protocol.DIGEST_CHUNK, [], 0
    for raw in host_state:
        pieces += [(at + i, raw[i : i + chunk]) for i in range(0, raw.nbytes, chunk)]
        at += raw.nbytes

    def memcpy() -> None:
        def copy(piece) -> None:
            where, raw = piece
            target[where : where + raw.nbytes] = raw

        protocol.in_pieces(copy, pieces, nbytes)

    memcpy()
    copied = timed(memcpy, args.repeats)
    print(f"replicas: {args.replicas} ({len(memory.targets)} keeper(s) hold each snapshot)")
    print(
        f"snapshot (save + wait): {whole:.3f} s ({nbytes / whole / 1e9:.2f} GB/s), the rank's own sending "
        f"{statistics.median(sending):.3f} s (median)"
    )
    print(f"baseline memcpy: {copied:.3f} s ({nbytes / copied / 1e9:.2f} GB/s)")
    print(f"baseline device_get + socket: {bare:.3f} s ({nbytes / bare / 1e9:.2f} GB/s)")
    print(f"snapshot bandwidth / memcpy bandwidth: {copied / whole:.3f}")
    print(f"snapshot / (device_get + socket): {whole / bare:.2f}")

    # One snapshot's phases, each alone, in the sender thread's order.
    flat = jax.tree_util.tree_leaves(state)
    layout = parts.Layout(state)
    phases: dict[str, float] = {}
    held: dict = {}

    def device_copy() -> None:
        held["entries"], held["finite"] = jax.block_until_ready(layout.copy(flat))

    def to_host() -> None:
        assert all(bool(f) for f in held["finite"])
        held["host"] = parts.on_host(held["entries"])

    def write() -> None:
        plan = held["plan"] = parts.PartPlan(next(steps), held["host"], meta)
        held["part"] = held.get("part") if len(held.get("part") or b"") == plan.size else bytearray(plan.size)
        plan.write(held["part"])

    def part_digest() -> None:
        protocol.digest(held["part"])

    def hand_over() -> None:
        step = next(steps)
        memory._hand_over(step, *memory._written(step, parts.PartPlan(step, held["host"], meta)))

    def restore() -> None:
        step, part = memory.newest()
        jax.block_until_ready(memory.restore(step, part, lambda meta: state)[0])

    for name, fn in [
        ("copy on the device", device_copy),
        ("copy to the host", to_host),
        ("write the part (one copy into a buffer)", write),
        ("the part's checksum (XXH3)", part_digest),
        ("hand over (write into the keeper's shared memory, checksum, commit)", hand_over),
        ("restore (map, checksum, arrays on the device)", restore),
    ]:
        phases[name] = timed(fn, args.repeats)
        memory.wait()  # (replicas the keeper still sends on do not run into the next phase)
    if device.platform != "cpu":

        def pinned() -> None:
            moved = [jax.device_put(x, x.sharding.with_memory_kind("pinned_host")) for x in flat]
            [np.asarray(x) for x in jax.block_until_ready(moved)]

        copies = [x for _, _, _, shards in held["entries"] for _, x in shards]

        def split() -> tuple[float, float]:
            """The tier's copy to the host in two: the transfers to pinned memory, then reading them."""
            began = time.perf_counter()
            moved = jax.block_until_ready([parts._to_pinned(x) for x in copies])
            middle = time.perf_counter()
            [np.asarray(x) for x in moved]
            return middle - began, time.perf_counter() - middle

        try:
            pinned()
            phases["copy to the host through pinned_host memory"] = timed(pinned, args.repeats)
            print(f"the tier moves shards through pinned host memory: {parts._has_pinned_host(device)}")
            split()
            puts, reads = zip(*(split() for _ in range(args.repeats)), strict=True)
            phases["the tier's transfers to pinned memory"] = statistics.median(puts)
            phases["the tier's np.asarray of the pinned arrays"] = statistics.median(reads)
        except Exception as error:  # noqa: BLE001 - a backend without pinned host memory: say so, go on
            print(f"pinned_host: {type(error).__name__}: {str(error)[:200]}")
    for name, seconds in phases.items():
        print(f"  {name}: {seconds:.3f} s ({nbytes / seconds / 1e9:.2f} GB/s, {copied / seconds:.3f} x memcpy)")
    memory.drop()
    memory.close()
    sink.close()


if __name__ == "__main__":
    main()
