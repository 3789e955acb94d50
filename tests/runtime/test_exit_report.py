"""`exit_report`: which errors are a peer's doing (a collective broken under a rank), read from real exception
chains."""

import json

from meshfit.runtime import exit_report


def _raised(make):
    try:
        make()
    except Exception as error:  # the chain as Python builds it
        return error
    raise AssertionError("nothing raised")


def test_a_broken_collective_is_found_through_the_errors_raised_from_it():
    def gloo():
        raise RuntimeError(
            "INTERNAL: Gloo all-reduce failed: [gloo/transport/tcp/pair.cc:547] Connection closed by peer [::1]:4242"
        )

    def write():
        try:
            gloo()
        except RuntimeError as error:
            raise OSError("could not write the backup of step 20") from error

    def during():
        try:
            gloo()
        except RuntimeError:
            raise ValueError("cleanup failed") from None

    error = _raised(write)
    found = exit_report.broken_collective(error)
    assert isinstance(found, RuntimeError) and "Connection closed by peer" in str(found)
    # `from None` hides the cause from the traceback, yet the context is still the broken collective.
    assert isinstance(exit_report.broken_collective(_raised(during)), RuntimeError)


def test_an_error_of_the_ranks_own_is_not_blamed_on_a_peer():
    for message in ("`memory_freq` must be a positive int", "Permission denied: '/proc/x'", "peer review"):
        assert exit_report.broken_collective(ValueError(message)) is None


def test_a_cycle_of_contexts_ends():
    first, second = ValueError("a"), ValueError("b")
    first.__context__, second.__context__ = second, first
    assert exit_report.broken_collective(first) is None


def test_the_launcher_acts_only_on_a_whole_report(tmp_path):
    whole = {"type": "ValueError", "message": "bad", "first_step": False, "time": 1.0}
    for name, content in {
        "whole": whole,
        "no message": {"type": "ValueError", "first_step": False},
        "message not text": {**whole, "message": ["bad"]},
        "first step not a flag": {**whole, "first_step": "no"},
        "a list": [whole],
    }.items():
        (tmp_path / name).write_text(json.dumps(content))
    (tmp_path / "torn").write_text('{"type": "Value')
    assert exit_report.read(str(tmp_path / "whole")) == whole
    for name in ("no message", "message not text", "first step not a flag", "a list", "torn", "absent"):
        assert exit_report.read(str(tmp_path / name)) is None, name
