"""The parameter server's side, shared by thread workers and worker processes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from meshfit.data import Batch


def split_rows(batch: Batch, parts: int) -> list[Batch]:
    """`parts` equal row blocks of a batch (padded to a multiple of `parts` by the loop)."""
    rows = batch.mask.shape[0] // parts
    return [jax.tree.map(lambda a, i=i: a[i * rows:(i + 1) * rows], batch) for i in range(parts)]


def weighted_mean(grads_per_worker, weights):
    """The gradients of a sync round's parts, weighted by their real rows: one global-batch gradient."""
    total = jnp.maximum(jnp.sum(weights), 1.0)
    return jax.tree.map(lambda *gs: sum(w * g for w, g in zip(weights, gs)) / total, *grads_per_worker)


def job_rng(steps, state, *salts: int):
    """The dropout key of one gradient job (raw key data), or None for modules without randomness.

    Derived from the server's key and `salts` only, so a job redone by another
    worker draws the same masks.
    """
    if not steps.adapter.uses_rng:
        return None
    key = jax.random.wrap_key_data(state.rng)
    for salt in salts:
        key = jax.random.fold_in(key, salt)
    return jax.random.key_data(key)


class ServerUpdates:
    """Applies workers' gradients to the server state and reports logs with staleness.

    Subclasses set `state`, `logs` and `staleness` (the staleness, in
    parameter versions, of each gradient applied this epoch).
    """

    def __init__(self, steps):
        self.steps = steps
        self.state = None
        self.logs = None
        self.staleness: list[int] = []
        self.apply = jax.jit(self._apply_and_log)

    def _apply_and_log(self, state, grads, model_state, increments):
        new_state = self.steps.apply_gradients(state, grads, model_state, increments, state.rng)
        return new_state, self.steps.logs(new_state.metrics)

    def current_logs(self) -> dict:
        """The server's latest logs, with `staleness` (mean) and `max_staleness` once gradients were applied."""
        logs = dict(self.logs) if self.logs is not None else dict(self.steps.logs(self.state.metrics))
        if self.staleness:
            logs["staleness"] = float(np.mean(self.staleness))
            logs["max_staleness"] = float(np.max(self.staleness))
        return logs
