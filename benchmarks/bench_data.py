"""Training from Parquet files against the same rows as in-memory arrays: steps per second of one epoch.

The rows (a digits-sized task: 64 float features as one list column, 10 classes) are written once as Parquet
shards; each contender trains one epoch per `fit` call on one device, after a warm-up epoch (compilation):
  * arrays:          `model.fit(x, y, batch_size=B, shuffle=False)` (the rows in memory, gathered per stage);
  * parquet:         `model.fit(mf.data.parquet(dir, ...))`, file order (row groups read on a thread);
  * parquet_shuffle: the same with `shuffle_seed=0` (row groups and rows within each shuffled);
  * parquet_no_read_ahead: file order with `read_ahead=0` (each batch read when the trainer takes it).
Contenders alternate, `--repeats` times; the median of each is printed with its ratio to arrays.

    python benchmarks/bench_data.py [--rows 65536] [--batch-size 128] [--row-group 4096] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from flax import nnx
from smoke import parse_args

import meshfit as mf

FEATURES, CLASSES, HIDDEN = 64, 10, 256


class MLP(nnx.Module):
    def __init__(self, *, rngs):
        self.hidden = nnx.Linear(FEATURES, HIDDEN, rngs=rngs)
        self.middle = nnx.Linear(HIDDEN, HIDDEN, rngs=rngs)
        self.out = nnx.Linear(HIDDEN, CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.middle(nnx.relu(self.hidden(x)))))


def write_shards(directory: str, x: np.ndarray, y: np.ndarray, files: int, row_group: int) -> None:
    for index, part in enumerate(np.array_split(np.arange(len(x)), files)):
        pixels = pa.FixedSizeListArray.from_arrays(pa.array(x[part].reshape(-1)), FEATURES)
        table = pa.table({"x": pixels, "y": y[part]})
        pq.write_table(table, os.path.join(directory, f"part-{index:03d}.parquet"), row_group_size=row_group)


def model() -> mf.Model:
    m = mf.Model(MLP(rngs=nnx.Rngs(0)))
    m.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    return m


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=65536)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--row-group", type=int, default=4096, help="rows per Parquet row group")
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parse_args(parser, argv, rows=2048, row_group=256, files=2, repeats=1)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.rows, FEATURES), dtype=np.float32)
    y = rng.integers(0, CLASSES, args.rows).astype(np.int32)
    with tempfile.TemporaryDirectory() as directory:
        write_shards(directory, x, y, args.files, args.row_group)

        def parquet(**kwargs):
            return lambda m: m.fit(
                mf.data.parquet(directory, x="x", y="y", batch_size=args.batch_size, **kwargs), verbose=0
            )

        contenders = {
            "arrays": lambda m: m.fit(x, y, batch_size=args.batch_size, shuffle=False, verbose=0),
            "parquet": parquet(),
            "parquet_shuffle": parquet(shuffle_seed=0),
            "parquet_no_read_ahead": parquet(read_ahead=0),
        }
        models = {name: model() for name in contenders}
        for name, fit in contenders.items():
            fit(models[name])  # warm-up: compiles
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for _ in range(args.repeats):
            for name, fit in contenders.items():
                start = time.perf_counter()
                fit(models[name])
                times[name].append(time.perf_counter() - start)
    steps = -(-args.rows // args.batch_size)
    print(f"{args.rows} rows, batch {args.batch_size}, {steps} steps an epoch, row groups of {args.row_group}")
    base = statistics.median(times["arrays"])
    for name, values in times.items():
        seconds = statistics.median(values)
        print(f"{name:>22}: {steps / seconds:8.1f} steps/s  ({base / seconds:.2f} of arrays)")


if __name__ == "__main__":
    main()
