"""Train an MLP on scikit-learn's bundled 8x8 digits and print the test accuracy.

python examples/digits.py                      # one device
python examples/digits.py --epochs 30 --batch-size 64
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from flax import nnx

import meshfit as mf


class MLP(nnx.Module):
    def __init__(self, din: int, hidden: int, dout: int, *, rngs: nnx.Rngs):
        self.hidden1 = nnx.Linear(din, hidden, rngs=rngs)
        self.hidden2 = nnx.Linear(hidden, hidden, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.out = nnx.Linear(hidden, dout, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.hidden1(x))
        x = self.dropout(nnx.relu(self.hidden2(x)))
        return self.out(x)


def load_data(seed: int = 0):
    """(x_train, x_test, y_train, y_test): scikit-learn's digits, scaled to [0, 1], a stratified 80/20 split.

    scikit-learn is imported here, not with the module: a process that only builds the MLP skips its second
    of start-up."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    return train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)


def make_strategy(name: str):
    if name == "one_device":
        return mf.strategies.OneDeviceStrategy()
    factory = getattr(
        mf.strategies,
        {
            "mirrored": "MirroredStrategy",
            "multi_worker": "MultiWorkerMirroredStrategy",
            "mesh": "MeshStrategy",
            "parameter_server": "ParameterServerStrategy",
            "parameter_server_sync": "ParameterServerStrategy",
        }.get(name, name),
        None,
    )
    if factory is None:
        raise SystemExit(f"Unknown --strategy {name!r}.")
    if name == "parameter_server_sync":
        return factory(mode="sync")
    return factory()


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument(
        "--strategy",
        default="one_device",
        help="one_device (default), mirrored, multi_worker, mesh, parameter_server (async) or parameter_server_sync",
    )
    parser.add_argument("--verbose", type=int, default=2)
    args = parser.parse_args(argv)

    x_train, x_test, y_train, y_test = load_data()
    start = time.perf_counter()
    with make_strategy(args.strategy).scope():
        model = mf.Model(MLP(64, 128, 10, rngs=nnx.Rngs(0)))
        model.compile(
            optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"]
        )
    model.fit(
        x_train, y_train, batch_size=args.batch_size, epochs=args.epochs, validation_split=0.1, verbose=args.verbose
    )
    result = model.evaluate(x_test, y_test, verbose=0, return_dict=True)
    elapsed = time.perf_counter() - start
    if model.strategy.is_chief:
        print(
            f"test accuracy: {result['accuracy']:.4f}  test loss: {result['loss']:.4f}  "
            f"({elapsed:.1f} s, {model.strategy!r})"
        )
    return result["accuracy"]


if __name__ == "__main__":
    main()
