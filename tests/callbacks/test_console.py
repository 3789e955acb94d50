"""`print_msg` and `is_chief`: the built-in callbacks print and write on process 0 only."""

import io

from meshfit.callbacks.console import is_chief, print_msg


def test_process_0_is_the_chief_and_prints_whole_lines():
    assert is_chief()  # a single-process run is process 0
    stream = io.StringIO()
    print_msg("Epoch 1: early stopping", stream=stream)
    print_msg("second", stream=stream)
    assert stream.getvalue() == "Epoch 1: early stopping\nsecond\n"
