"""`--smoke`: a benchmark's tiny run, a few seconds, which the benchmarks' tests run.

Benchmarks are scripts nobody runs on every change, so they rot: an API change
broke `bench_checkpoint.py` for sessions before anyone noticed. Each benchmark
parses its arguments through `parse_args`, giving the sizes of its smoke run;
`benchmarks/test_smoke.py` runs every benchmark with `--smoke` (`python -m
pytest benchmarks`, which CI runs after the package's tests), so a change that
breaks one fails CI. Flags given on the command line win over the smoke sizes.
"""

from __future__ import annotations

import argparse


def parse_args(parser: argparse.ArgumentParser, argv=None, **smoke_defaults) -> argparse.Namespace:
    """Parses `argv` (the command line); with `--smoke`, `smoke_defaults` replace the parser's defaults."""
    unknown = sorted(set(smoke_defaults) - {action.dest for action in parser._actions})
    if unknown:
        raise ValueError(f"smoke defaults name no argument of the benchmark: {unknown}")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, a few seconds: what the test suite runs")
    args = parser.parse_args(argv)
    if args.smoke:
        parser.set_defaults(**smoke_defaults)
        args = parser.parse_args(argv)
    return args
