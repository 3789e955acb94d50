"""Inputs as batches: in-memory arrays, generators and datasets, or a user's own `DataSource`.

A data source yields fixed-shape host batches (the last one padded and
masked), says how many there are and where a resumed epoch continues; which
source serves an input is `meshfit.data.inputs.data_source`. `parquet(...)`
reads Parquet files, each process its own row groups (pyarrow, imported
only when a source is made); `ray_dataset(...)` a Ray Data dataset with a
`tap` (Ray is never imported here).
"""

from meshfit.data.global_batches import GlobalBatchSource
from meshfit.data.parquet import ParquetData, parquet
from meshfit.data.ray_data import ray_dataset
from meshfit.data.sources import (
    REPLAY_BYTES,
    ArrayData,
    DataSource,
    IterableData,
    Replay,
    make_batch,
    stack_batches,
)

__all__ = [
    "parquet",
    "ParquetData",
    "ray_dataset",
    "GlobalBatchSource",
    "DataSource",
    "ArrayData",
    "IterableData",
    "Replay",
    "REPLAY_BYTES",
    "make_batch",
    "stack_batches",
]
