"""Asynchronous parameter-server training of the digits MLP with worker processes.

    meshfit launch --ps 1 --workers 3 examples/parameter_server.py
    meshfit launch --ps 2 --workers 3 examples/parameter_server.py   # state split over 2 servers

Rank 0 holds the parameters, applies gradients as they arrive and runs `fit`;
the workers compute gradients (they run `meshfit.strategies.parameter_server.worker`,
not this script). With `--ps 2`, ranks 0 and 1 each hold half of every large
parameter and run `fit` together; rank 0 coordinates. A worker can die
mid-epoch: its batch is redone by another and training goes on. On one host
without `meshfit launch`, the same script trains with the local devices as
workers (threads).
"""

from __future__ import annotations

import argparse

from digits import MLP, load_data
from flax import nnx

import meshfit as mf


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args(argv)

    strategy = mf.strategies.ParameterServerStrategy(mode="async")
    x_train, x_test, y_train, y_test = load_data()
    with strategy.scope():
        model = mf.Model(MLP(64, 128, 10, rngs=nnx.Rngs(0)))
        model.compile(
            optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"]
        )
    model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs, verbose=2)
    result = model.evaluate(x_test, y_test, verbose=0, return_dict=True)
    print(f"test accuracy: {result['accuracy']:.4f}")
    return result["accuracy"]


if __name__ == "__main__":
    main()
