"""The digits MLP trained from Parquet shards, each process reading only its own row groups.

Writes the training digits to 8 Parquet files (row groups of 64 rows) once, then trains from them with
`mf.data.parquet`; on one machine, 2 processes x 2 simulated CPU devices:

    meshfit launch --nprocs 2 --devices-per-proc 2 examples/digits_parquet.py

or as one process: `python examples/digits_parquet.py`. With `--backup DIR` a killed or preempted job resumes
where its backup stood, on as many processes as before, fewer, or one (docs/data.md).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np
from flax import nnx

import meshfit as mf


def write_shards(directory: str, x: np.ndarray, y: np.ndarray, files: int = 8, row_group: int = 64) -> None:
    """`x` (one fixed-size list column `pixels`), `y` (`label`) and a row `id`, split over `files` files. Each file
    is written to a temporary name and renamed, so processes that write the same files at once never see a half."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(directory, exist_ok=True)
    for index, rows in enumerate(np.array_split(np.arange(len(x)), files)):
        path = os.path.join(directory, f"part-{index:02d}.parquet")
        if os.path.exists(path):
            continue
        pixels = pa.FixedSizeListArray.from_arrays(pa.array(x[rows].reshape(-1)), x.shape[1])
        table = pa.table({"id": rows, "pixels": pixels, "label": y[rows]})
        handle, temporary = tempfile.mkstemp(dir=directory, suffix=".tmp")
        os.close(handle)
        pq.write_table(table, temporary, row_group_size=row_group)
        os.replace(temporary, path)


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", default=os.path.join(tempfile.gettempdir(), "meshfit-digits-parquet"))
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--backup", default=None, help="a BackupAndRestore directory")
    args = parser.parse_args(argv)

    strategy = mf.strategies.MultiWorkerMirroredStrategy()  # joins the job first, before other JAX work
    from digits import MLP, load_data  # the model and data of examples/digits.py

    x_train, x_test, y_train, y_test = load_data()
    write_shards(args.shards, x_train, y_train)
    data = mf.data.parquet(args.shards, x="pixels", y="label", batch_size=args.batch_size, shuffle_seed=0)
    with strategy.scope():
        model = mf.Model(MLP(64, 128, 10, rngs=nnx.Rngs(0)))
        model.compile(
            optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"]
        )
    callbacks = [mf.callbacks.BackupAndRestore(args.backup)] if args.backup else []
    model.fit(data, epochs=args.epochs, verbose=2 if strategy.is_chief else 0, callbacks=callbacks)
    result = model.evaluate(x_test, y_test, verbose=0, return_dict=True)
    if strategy.is_chief:
        print(f"test accuracy: {result['accuracy']:.4f} on {strategy.process_count} processes, from Parquet")
    return result["accuracy"]


if __name__ == "__main__":
    main()
