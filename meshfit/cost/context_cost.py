"""What a `context` mesh axis costs a step, per device: the K/V traffic of context-parallel attention.

Context-parallel attention (`meshfit.layers.dot_product_attention` under a
`context` axis) runs in a `shard_map`, so its collectives are written into the
lowered program, where GSPMD's own (added while compiling) are not yet: the
lowered program's collectives are the attention's. Ring attention passes K/V
blocks with collective-permutes (and, for a causal mask, moves its blocks into
the load-balanced layout and back); all-gather attention gathers K and V, and
its backward reduce-scatters their gradients. Activation memory per device is
in `StepReport.memory` ("temporaries"); a sequence split over C devices holds
about 1/C of each activation.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ContextCost:
    """The context axis of one compiled training step, per device.

    Attributes:
        size: C, the devices each sequence is split over.
        collectives: operand bytes per collective kind that the context-parallel attention writes into the
            step (forward and backward, every layer), per device: what it hands to the collectives.
        kv_bytes: the bytes each device sends per step for them: a collective-permute's operand, an
            all-gather's operand to each of the C - 1 others, (C - 1)/C of a reduce-scatter's or an
            all-reduce's operand (twice for an all-reduce), as ring algorithms send.
    """

    size: int
    collectives: dict
    kv_bytes: int


def context_cost(lowered_collectives: dict, size: int) -> ContextCost:
    """The `ContextCost` of a step whose lowered program wrote `lowered_collectives` (operand bytes per kind)."""
    share = (size - 1) / size
    sent = {
        "collective-permute": 1.0,
        "all-gather": float(size - 1),
        "reduce-scatter": share,
        "all-reduce": 2 * share,
        "all-to-all": share,
    }
    kv = sum(n * sent.get(kind, 1.0) for kind, n in lowered_collectives.items())
    return ContextCost(size, dict(lowered_collectives), int(kv))
