"""A bound on the executions dispatched to the devices and not yet finished."""

from __future__ import annotations

from time import perf_counter

import jax

#: Seconds between marks under which an adaptive bound spaces its marks further apart (see `InFlight`).
SHORT_INTERVAL = 1e-3


class InFlight:
    """Bounds the number of dispatched, unfinished executions (a wait, not a transfer).

    Every `spacing`-th execution's token is kept as a mark; on reaching a mark
    the host waits for the previous one, so between `spacing` and `2 * spacing`
    executions stay queued and the host keeps ahead of the devices. Between
    marks an execution costs one count.

    `spacing` is `limit`, unless `max_spacing` is larger (one device, no
    collectives to pile up): then, while marks come less than `SHORT_INTERVAL`
    apart (executions of tens of microseconds: a tiny model on a CPU), the
    spacing doubles, up to `max_spacing`, and it halves back towards `limit`
    once marks come more than `4 * SHORT_INTERVAL` apart. Each wait that finds
    its mark unfinished puts the host thread to sleep and costs a wake-up:
    waiting every 4 executions of 60 µs cost 2 to 10 µs a step on a shared
    2-core machine, the more the busier. The queued work
    stays within `2 * limit` executions or about `8 * SHORT_INTERVAL`,
    whichever holds more, so a preemption's backup still waits for little.
    """

    def __init__(self, limit: int = 4, max_spacing: int | None = None):
        self.limit = limit
        self.max_spacing = limit if max_spacing is None else max(limit, max_spacing)
        self.spacing = limit
        self.since_mark = 0  # executions counted since the last mark
        self._mark = None
        self._marked_at: float | None = None  # when the last wait for a mark returned (adaptive spacing only)

    def add(self, token) -> None:
        """Counts one execution whose finish `token` (a device value it returns) tells."""
        if self.due():
            self.mark(token)

    def due(self) -> bool:
        """Counts one execution; True when its token is due as the next mark (then call `mark` with it).

        For callers whose token costs work to pick (`StateStore.advance`): they pick it only when due.
        """
        self.since_mark += 1
        return self.since_mark >= self.spacing

    def mark(self, token) -> None:
        """Keeps `token` as the new mark and waits for the previous one (`add` calls it every `spacing`)."""
        previous, self._mark, self.since_mark = self._mark, token, 0
        if previous is None:
            return
        if isinstance(previous, jax.Array):
            previous.block_until_ready()  # the array's own method: no pytree walk
        else:
            jax.block_until_ready(previous)
        if self.max_spacing > self.limit:
            self._adapt(perf_counter())

    def _adapt(self, now: float) -> None:
        last, self._marked_at = self._marked_at, now
        if last is None:
            return
        interval = now - last
        if interval < SHORT_INTERVAL and self.spacing < self.max_spacing:
            self.spacing = min(self.max_spacing, 2 * self.spacing)
        elif interval > 4 * SHORT_INTERVAL and self.spacing > self.limit:
            self.spacing = max(self.limit, self.spacing // 2)

    def clear(self) -> None:
        """Forgets the mark (everything before it is finished); the spacing learned so far is kept."""
        self.since_mark, self._mark, self._marked_at = 0, None, None
