"""Reading an input ahead of the trainer on a thread, and stopping that thread when the trainer stops taking.

Generators, grain iterators and Parquet files are read on a thread so the step
never waits on a file; what the thread made but the caller never took is handed
back (`give_back`), so an input that resumes from a position loses nothing.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

#: Seconds a caller that stops taking waits for the reading thread before leaving it, stuck in the input
#: (a read that never returns), behind: a preempted or interrupted fit can end.
STUCK_READER_WAIT = 5.0


def read_ahead(
    items: Iterator,
    depth: int,
    *,
    name: str = "meshfit-read-ahead",
    give_back: Callable[[list], Any] | None = None,
) -> Iterator:
    """`items`, produced on a thread up to `depth` ahead of the caller; an error there is raised here.

    When the caller stops taking (an early stop, an error, the generator closed), the thread stops at its next
    item, and `give_back` gets the items it made that were not taken, in order (unless the thread is stuck
    in `items` itself past `STUCK_READER_WAIT` seconds: what it holds is then lost with it).
    """
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    untaken: list = []  # the item the thread made but could not hand over

    def offer(entry: tuple) -> bool:
        """Hands `entry` to the caller; False once the caller has stopped taking."""
        while not stop.is_set():
            try:
                ready.put(entry, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def reader() -> None:
        try:
            for item in items:
                if not offer(("item", item)):
                    untaken.append(item)
                    return
            offer(("end", None))
        except BaseException as error:  # noqa: BLE001 - raised again in the caller's thread
            offer(("error", error))

    thread = threading.Thread(target=reader, name=name, daemon=True)
    thread.start()
    try:
        while True:
            kind, value = ready.get()
            if kind == "end":
                return
            if kind == "error":
                raise value
            yield value
    finally:
        stop.set()
        if threading.current_thread() is not thread:  # (an abandoned generator may be collected on the thread)
            thread.join(timeout=STUCK_READER_WAIT)
        if give_back is not None and not thread.is_alive():
            left = []
            while not ready.empty():
                kind, value = ready.get_nowait()
                if kind == "item":
                    left.append(value)
            give_back(left + untaken)
