"""The loss and metric terms a step computes, each addressed to one of the model's outputs.

`meshfit.outputs` resolves `compile`'s arguments into these terms on the first
batch; the steps (`meshfit.steps.builtin`) only loop over them. Both import them from
here, so the steps know nothing of how `compile` was called.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from meshfit import losses as losses_lib

__all__ = ["LOSS_KEY", "Output", "LossTerm", "MetricTerm"]

#: The log key of the training objective: the weighted sum of the outputs' losses.
LOSS_KEY = "loss"


class Output(NamedTuple):
    """One output of the model: its log name and its path (dict keys, list indices) from the root."""

    name: str
    path: tuple

    def of(self, tree: Any) -> Any:
        """This output's part of `tree` (predictions, targets or per-output sample weights)."""
        for key in self.path:
            tree = getattr(tree, key) if _is_field(tree, key) else tree[key]
        return tree


def _is_field(tree: Any, key: Any) -> bool:
    """Whether `key` names a field of a NamedTuple or dataclass (read with getattr), not a dict key."""
    return isinstance(key, str) and not isinstance(tree, dict)


class LossTerm(NamedTuple):
    """One output's loss and its weight in the total (None: unweighted).

    `scalar`: the loss returns one value for the batch, not one per sample
    (`meshfit.outputs.find_scalar_losses`), so the steps compute it on the real
    rows of a partial batch rather than masking its padding.
    """

    output: Output
    loss: losses_lib.Loss
    weight: float | None
    scalar: bool = False


class MetricTerm(NamedTuple):
    """One metric of one output, with the key it is logged under; `weighted` ones use `sample_weight`."""

    output: Output
    metric: Any
    weighted: bool
    log_name: str
