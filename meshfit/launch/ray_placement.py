"""How many ranks' bundles a Ray cluster's nodes can hold: the size of an elastic restart on Ray.

`meshfit launch --ray --min-nprocs M` restarts a job whose bundles no longer all fit (a node gone for good)
with fewer processes. `placeable` bounds the sizes worth asking Ray for from the nodes' resources and the
placement strategy, so the launcher tries placement groups from that size down to M instead of from N.
Pure: no Ray import (the launcher passes what `ray.nodes()` says).
"""

from __future__ import annotations

import math


def bundles_per_node(resources: dict[str, float], bundle: dict[str, float]) -> float:
    """How many copies of `bundle` fit in a node of `resources` (`math.inf` for a bundle asking nothing)."""
    asked = {name: amount for name, amount in bundle.items() if amount > 0}
    if not asked:
        return math.inf
    return min(math.floor(resources.get(name, 0.0) / amount + 1e-9) for name, amount in asked.items())


def placeable(nodes: list[dict[str, float]], bundle: dict[str, float], strategy: str, wanted: int) -> int:
    """The most bundles of `bundle`, up to `wanted`, that nodes of these resources hold under `strategy`.

    PACK and SPREAD may use any node for any bundle; STRICT_PACK puts every bundle on one node; STRICT_SPREAD
    puts each on a node of its own.
    """
    fits = [bundles_per_node(resources, bundle) for resources in nodes]
    if strategy == "STRICT_PACK":
        total = max(fits, default=0)
    elif strategy == "STRICT_SPREAD":
        total = sum(1 for n in fits if n >= 1)
    else:
        total = sum(fits)
    return int(min(wanted, total))
