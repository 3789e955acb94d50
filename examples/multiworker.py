"""Data-parallel training across processes: the digits MLP under MultiWorkerMirroredStrategy.

On one machine (2 processes x 2 simulated CPU devices, CPU collectives over gloo):

    meshfit launch --nprocs 2 --devices-per-proc 2 examples/multiworker.py

On a cluster, start one process per host (SLURM `srun`, Open MPI `mpirun`, a TPU
pod's `--worker=all`); `jax.distributed` finds the coordinator by itself.
"""

from __future__ import annotations

import argparse

from flax import nnx

import meshfit as mf


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    args = parser.parse_args(argv)

    # The strategy joins the multi-process job; create it before any other JAX work.
    strategy = mf.strategies.MultiWorkerMirroredStrategy()
    from digits import MLP, load_data  # the model and data of examples/digits.py

    x_train, x_test, y_train, y_test = load_data()  # every process loads the same arrays ...
    with strategy.scope():
        model = mf.Model(MLP(64, 128, 10, rngs=nnx.Rngs(0)))
        model.compile(
            optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"]
        )
    # ... and feeds only its own rows of each global batch.
    model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs, validation_split=0.1, verbose=2)
    result = model.evaluate(x_test, y_test, verbose=0, return_dict=True)
    if strategy.is_chief:
        print(
            f"test accuracy: {result['accuracy']:.4f} on {strategy.process_count} processes, "
            f"{strategy.num_replicas_in_sync} replicas"
        )
    return result["accuracy"]


if __name__ == "__main__":
    main()
