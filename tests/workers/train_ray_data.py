"""Worker for the Ray Data split test: one rank of a `meshfit launch --ray` job training from a ray.data.Dataset.

    python train_ray_data.py RAY_ADDRESS OUT

Joins the cluster, trains 2 epochs on 96 rows (x holds the row's id in column 0) with a global batch of 16,
then reads one more epoch through the same split as `fit` does and writes the ids this rank took to
OUT/ids-<rank>.json, so a test can check that the ranks' shares are disjoint and cover the dataset.
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
    ray.init(address=address, log_to_driver=False, configure_logging=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    strategy = mf.strategies.MultiWorkerMirroredStrategy()
    ids = np.arange(96)
    rows = [{"x": np.array([i, i % 5, i % 7, 1.0], np.float32), "y": int(i % 3)} for i in ids]
    dataset = ray.data.from_items(rows)
    from helpers import MLP

    with strategy.scope():
        model = mf.Model(MLP(din=4, hidden=8, dout=3), seed=7)
        model.compile(optimizer="sgd", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(dataset, batch_size=16, epochs=2, verbose=0)
    print(f"rank {strategy.process_index} trained, loss {history.history['loss']}", flush=True)

    audit = mf.data.ray_data.RayData(dataset, batch_size=16)
    audit.lay_out(strategy.batch_block, strategy.batch_multiple)
    taken = []
    for batch in audit.batches(0):
        taken.extend(batch.x[batch.mask > 0, 0].astype(int).tolist())
        assert len(batch.mask) == 8, len(batch.mask)  # 16 / 2 rows a step on each rank
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"ids-{strategy.process_index}.json"), "w") as f:
        json.dump(taken, f)
    print("finished", flush=True)


if __name__ == "__main__":
    main()
