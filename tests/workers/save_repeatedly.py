"""Worker for the overwrite test: saves a model into one directory again and again, each time with every
weight set to the save's number, printing a line before and after each save, until it is killed."""

import sys
import time

sys.path.insert(0, __file__.rsplit("/", 2)[0])  # tests/, for helpers

import numpy as np  # noqa: E402
from helpers import MLP  # noqa: E402

import meshfit as mf  # noqa: E402

path, kind = sys.argv[1], sys.argv[2]
with mf.strategies.OneDeviceStrategy().scope():
    model = mf.Model(MLP(din=4, hidden=256, dout=3))
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
for number in range(1000):
    model.set_weights([np.full(w.shape, number, w.dtype) for w in model.get_weights()])
    start = time.monotonic()
    print(f"saving {number}", flush=True)
    (model.save if kind == "model" else model.save_weights)(path)
    print(f"saved {number} in {time.monotonic() - start:.3f}", flush=True)
