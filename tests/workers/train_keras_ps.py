"""A Keras model trained by ParameterServerStrategy, for `meshfit launch --ps 1 --workers N` (or alone, on
threads); writes the History as JSON.

    python train_keras_ps.py OUT.json [--mode async|sync]

The worker processes run `meshfit.strategies.parameter_server.worker`, not this script: they compute the Keras
model's gradients with the program rank 0 exports (`jax.export`).
"""

import argparse
import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import meshfit as mf  # noqa: E402


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(64, 6)).astype(np.float32), rng.integers(0, 3, 64).astype(np.int32)


def build():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--mode", default="sync")
    args = parser.parse_args()
    x, y = data()
    with mf.strategies.ParameterServerStrategy(mode=args.mode).scope():
        model = mf.Model(build())
        model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    with open(args.out, "w") as f:
        json.dump(history.history, f)


if __name__ == "__main__":
    sys.exit(main())
