"""What the built-in callbacks print and write, on one process only.

In a multi-host run every process runs the same callbacks; `is_chief()` picks
the one that prints and writes files, and `print_msg()` prints there without
breaking an open progress bar.
"""

from __future__ import annotations

import sys

from tqdm.std import tqdm


def is_chief() -> bool:
    """True on the process that prints and writes files (`jax.process_index() == 0`)."""
    import jax

    return jax.process_index() == 0


def print_msg(message: str, *, stream=None) -> None:
    """Prints `message` on process 0 only, without breaking an open tqdm bar."""
    if not is_chief():
        return
    tqdm.write(message, file=stream if stream is not None else sys.stdout)
