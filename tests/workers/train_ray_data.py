"""Worker for the Ray Data split test: one rank of a `meshfit launch --ray` job training from a ray.data.Dataset.

    python train_ray_data.py RAY_ADDRESS OUT

RAY_ADDRESS `local` starts a Ray instance of the rank's own instead (a job whose ranks share no cluster).

Joins the cluster, trains 2 epochs on 96 rows (each with its id in column `id`) with a global batch of 16,
and writes the ids `fit` took on this rank, through `mf.data.ray_dataset`'s tap, to OUT/ids-<rank>.json as
`{epoch: [[step, ids], ...]}`, so a test can check that the ranks' shares are disjoint and cover the dataset.
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402
import ray  # noqa: E402

import meshfit as mf  # noqa: E402


def main():
    address, out = sys.argv[1], sys.argv[2]
    if address == "local":
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    else:
        ray.init(address=address, log_to_driver=False, configure_logging=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    strategy = mf.strategies.MultiWorkerMirroredStrategy()
    ids = np.arange(96)
    rows = [{"x": np.array([i, i % 5, i % 7, 1.0], np.float32), "y": int(i % 3), "id": int(i)} for i in ids]
    dataset = ray.data.from_items(rows)
    from helpers import MLP

    with strategy.scope():
        model = mf.Model(MLP(din=4, hidden=8, dout=3), seed=7)
        model.compile(optimizer="sgd", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    taken: dict[int, list] = {}
    tap = lambda epoch, step, rows: taken.setdefault(epoch, []).append([step, rows["id"].tolist()])  # noqa: E731
    history = model.fit(mf.data.ray_dataset(dataset, batch_size=16, tap=tap), epochs=2, verbose=0)
    print(f"rank {strategy.process_index} trained, loss {history.history['loss']}", flush=True)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"ids-{strategy.process_index}.json"), "w") as f:
        json.dump(taken, f)
    print("finished", flush=True)


if __name__ == "__main__":
    main()
