"""A bound on the executions dispatched to the devices and not yet finished."""

from __future__ import annotations

import jax


class InFlight:
    """Bounds the number of dispatched, unfinished executions (a wait, not a transfer).

    Every `limit`-th execution's token is kept as a mark; on reaching a mark
    the host waits for the previous one, so between `limit` and `2 * limit`
    executions stay queued and the host keeps ahead of the devices. Between
    marks an execution costs one count.
    """

    def __init__(self, limit: int = 4):
        self.limit = limit
        self._since_mark = 0
        self._mark = None

    def add(self, token) -> None:
        self._since_mark += 1
        if self._since_mark < self.limit:
            return
        previous, self._mark, self._since_mark = self._mark, token, 0
        if previous is None:
            return
        if isinstance(previous, jax.Array):
            previous.block_until_ready()  # the array's own method: no pytree walk
        else:
            jax.block_until_ready(previous)

    def clear(self) -> None:
        self._since_mark, self._mark = 0, None
