"""The parameter server's side, shared by thread workers and worker processes."""

from __future__ import annotations

import jax
import numpy as np


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
