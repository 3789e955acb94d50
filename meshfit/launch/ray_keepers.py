"""The memory tier under `meshfit launch --ray`: a snapshot keeper on each node that runs ranks.

`NodeKeepers` starts, for each node a rank is placed on, a Ray actor (no CPUs, pinned to that node) that
runs the same `meshfit.launch.keeper.Keeper` as the local launcher, listening on the node's IP. The keepers
live for the whole launch, across `--max-restarts`: one lost with its node is not replaced, and a node that
runs ranks after a restart gets one. Every keeper of a launch shares one fresh key (`secrets`), handed to
the actors through Ray (the cluster's token authentication) and to the ranks through their environment; the
ranks and keepers then speak `meshfit.runtime.keeper_protocol` (HMAC handshake, JSON and raw bytes, nothing
unpickled).

Each rank hands its part to its node's keeper, which sends it on to the next `memory_replicas - 1` nodes'
keepers (`keeper_protocol.replica_keepers`; `meshfit.launch.replica_forwarder`), so a lost node loses no
snapshot. Before each start the launcher tells every keeper the launch's keepers' addresses
(`Keeper.set_peers`: the only ones it sends replicas to), lets the replicas on their way arrive
(`Keeper.settle`, up to `SETTLE_BEFORE_RESTART` seconds), asks every surviving keeper what it holds
(`Keeper.inventory(final=True)`: a replica of the starts so far that arrives later is refused, so the
answer stays true) and picks, per fit, the newest snapshot whose every rank's part survives and that no
keeper holds incomplete (`keeper.agreed_steps`); every rank then restores that one step, from whichever
keeper holds its part (`ENV_KEEPER_RESUME`).
"""

from __future__ import annotations

import json
import secrets
import sys
from typing import Any, TextIO

from meshfit.launch.keeper import Keeper, agreed_steps
from meshfit.runtime import keeper_protocol as protocol

#: Seconds to wait for a keeper's answer before taking it as gone with its node.
ANSWER_TIMEOUT = 30.0
#: Seconds a restart waits for the replicas the keepers are still sending on (to a keeper gone with its node
#: they fail at once, or within their bounds): a replica that arrives in time makes its snapshot count.
SETTLE_BEFORE_RESTART = 2.0


class _KeeperActor:
    """A `Keeper` on this actor's node, listening on the node's IP."""

    def __init__(self, key: bytes):
        import ray

        self.keeper = Keeper(sys.stderr, host=ray.util.get_node_ip_address(), key=key)

    def address(self) -> str:
        return self.keeper.address

    def local_address(self) -> str:
        return self.keeper.local_address

    def set_peers(self, addresses: list[str]) -> None:
        self.keeper.set_peers(addresses)

    def settle(self, timeout: float) -> bool:
        return self.keeper.settle(timeout)

    def inventory(self) -> dict[str, dict]:
        return self.keeper.inventory(final=True)  # (asked before a start only: the launcher's choice stays true)

    def close(self) -> None:
        self.keeper.close()


class NodeKeepers:
    """The keepers of one launch, by node id: `env(nodes)` before each start, `close()` at its end."""

    def __init__(self, ray, log: TextIO = sys.stderr):
        self.ray = ray
        self.log = log
        self.key = secrets.token_bytes(32)
        self.keepers: dict[str, tuple[Any, str, str]] = {}  # node id -> (actor, TCP address, Unix socket address)

    def _start(self, node_id: str) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        actor = (
            self.ray.remote(_KeeperActor)
            .options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
            .remote(self.key)
        )
        address, local = self.ray.get([actor.address.remote(), actor.local_address.remote()], timeout=ANSWER_TIMEOUT)
        self.keepers[node_id] = (actor, address, local)

    def _inventories(self) -> dict[str, dict]:
        """What every keeper still reachable holds, by node id, once the replicas they send on arrived (or
        `SETTLE_BEFORE_RESTART` passed); those gone with their node are forgotten."""
        settling = [actor.settle.remote(SETTLE_BEFORE_RESTART) for actor, _, _ in self.keepers.values()]
        if settling:  # (a keeper gone with its node answers with an error: its inventory below says so)
            self.ray.wait(settling, num_returns=len(settling), timeout=SETTLE_BEFORE_RESTART + ANSWER_TIMEOUT)
        refs = {node: actor.inventory.remote() for node, (actor, _, _) in self.keepers.items()}
        held = {}
        for node, ref in refs.items():
            try:
                held[node] = self.ray.get(ref, timeout=ANSWER_TIMEOUT)
            except (self.ray.exceptions.RayError, self.ray.exceptions.GetTimeoutError) as error:
                self.log.write(
                    f"[launch] the snapshot keeper on node id {node[:12]} is gone (its node lost): "
                    f"{str(error).splitlines()[0][:200]}\n"
                )
                del self.keepers[node]
        return held

    def env(self, nodes: list[tuple[str, str]]) -> dict[str, str]:
        """The ranks' keeper variables for a start whose rank r runs on `nodes[r]` (node id, IP): the keepers
        of those nodes (started where missing), then the others still holding snapshots; each rank's own;
        and the snapshot each fit resumes from."""
        held = self._inventories()
        order: list[str] = []
        for node_id, _ in nodes:
            if node_id not in order:
                order.append(node_id)
        for node_id in order:
            if node_id not in self.keepers:
                self._start(node_id)
                held[node_id] = {}
        order += [node for node in self.keepers if node not in order]
        self._set_peers([self.keepers[node][1] for node in order])
        chosen = agreed_steps([held.get(node, {}) for node in order], world=len(nodes))
        for fit, snapshot in chosen.items():
            holders = "; ".join(
                f"rank {rank}'s part on "
                + ", ".join(f"node id {order[i][:12]} ({self.keepers[order[i]][1]})" for i in keepers)
                for rank, keepers in sorted(snapshot["holders"].items())
            )
            self.log.write(
                f"[launch] memory snapshots: {fit} resumes from step {snapshot['step']}, the newest whose every "
                f"part survives ({holders}).\n"
            )
        self.log.flush()
        return {
            protocol.ENV_KEEPER_ADDRESS: ",".join(self.keepers[node][1] for node in order),
            protocol.ENV_KEEPER_LOCAL: ",".join(self.keepers[node][2] for node in order),
            protocol.ENV_KEEPER_AUTHKEY: self.key.hex(),
            protocol.ENV_KEEPER_HOMES: ",".join(str(order.index(node_id)) for node_id, _ in nodes),
            protocol.ENV_KEEPER_RESUME: json.dumps({fit: [s["step"], s["start"]] for fit, s in chosen.items()}),
        }

    def _set_peers(self, addresses: list[str]) -> None:
        """Tells every keeper the launch's keepers' addresses (the only ones it sends replicas to)."""
        refs = {node: actor.set_peers.remote(addresses) for node, (actor, _, _) in self.keepers.items()}
        for node, ref in refs.items():
            try:
                self.ray.get(ref, timeout=ANSWER_TIMEOUT)
            except (self.ray.exceptions.RayError, self.ray.exceptions.GetTimeoutError) as error:
                self.log.write(
                    f"[launch] the snapshot keeper on node id {node[:12]} was not told the other keepers, so it sends "
                    f"no replicas: {str(error).splitlines()[0][:200]}\n"
                )

    def close(self) -> None:
        for actor, _, _ in self.keepers.values():
            try:
                self.ray.get(actor.close.remote(), timeout=5)
            except (self.ray.exceptions.RayError, self.ray.exceptions.GetTimeoutError):
                pass
            self.ray.kill(actor)
        self.keepers.clear()
