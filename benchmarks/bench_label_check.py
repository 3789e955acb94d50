"""What the host-side checks of streamed batches cost: the label range and the first batch's shapes.

Trains the digits MLP (`examples/digits.py`) from a generator of host batches of 64 rows and reports
microseconds per step with the checks on and off (interleaved repeats, the median of each), and the
checks alone per batch (`timeit`). In-memory arrays are checked once per fit, not per step.

    python benchmarks/bench_label_check.py [--repeats 5] [--epochs 3] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import timeit

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, HERE)

import digits  # noqa: E402
from flax import nnx  # noqa: E402
from smoke import parse_args  # noqa: E402

import meshfit as mf  # noqa: E402
from meshfit.data import label_check  # noqa: E402
from meshfit.data import sources as data_lib  # noqa: E402
from meshfit.steps import terms  # noqa: E402

ROWS = 64


def batches(x, y, epochs):
    for _ in range(epochs):
        for i in range(len(x) // ROWS):
            yield x[i * ROWS : (i + 1) * ROWS], y[i * ROWS : (i + 1) * ROWS]


def us_per_step(x, y, epochs: int, checked: bool) -> float:
    """Microseconds per step of a fit over `epochs` passes of the generator (the first pass's compile left out)."""
    model = mf.Model(digits.MLP(64, 128, 10, rngs=nnx.Rngs(0)), seed=0)
    model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["acc"])
    model.fit(batches(x, y, 1), verbose=0)  # compiles
    source = data_lib.IterableData(batches(x, y, epochs))
    if not checked:  # the checks off: the first batch's shapes accepted for any, no label check installed
        source._check_spec = lambda parts, index: None
        source.set_label_check = lambda check: None
    steps = epochs * (len(x) // ROWS)
    start = time.perf_counter()
    model.fit(source, verbose=0)
    return (time.perf_counter() - start) / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=3)
    args = parse_args(parser, repeats=1, epochs=1)
    x, _, y, _ = digits.load_data()
    on, off = [], []
    for _ in range(args.repeats):
        off.append(us_per_step(x, y, args.epochs, checked=False))
        on.append(us_per_step(x, y, args.epochs, checked=True))
    source = data_lib.IterableData(iter(()))
    ranges = (label_check.LabelRange(terms.Output("output", ()), 10, None, "loss"),)
    xb, yb = x[:ROWS], y[:ROWS]
    source._check_spec({"x": xb, "y": yb}, 0)
    n = 200 if args.smoke else 20000
    spec = timeit.timeit(lambda: source._check_spec({"x": xb, "y": yb}, 1), number=n) / n * 1e6
    labels = timeit.timeit(lambda: label_check.check_labels(ranges, yb, str), number=n) / n * 1e6
    print(f"digits MLP, generator of {ROWS}-row batches, {args.epochs} epochs x {len(x) // ROWS} steps")
    print(f"fit, checks off: {statistics.median(off):.0f} us/step  (runs: {', '.join(f'{v:.0f}' for v in off)})")
    print(f"fit, checks on:  {statistics.median(on):.0f} us/step  (runs: {', '.join(f'{v:.0f}' for v in on)})")
    print(f"the checks alone, per batch: shapes {spec:.1f} us, labels {labels:.1f} us")


if __name__ == "__main__":
    main()
