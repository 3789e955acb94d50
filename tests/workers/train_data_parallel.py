"""Worker for launch tests: trains the test MLP under a strategy and saves what it got.

    python train_data_parallel.py OUT_DIR [--strategy multi_worker|mirrored|mesh] [--epochs N] [--batch-size B]
                                  [--steps-per-execution K] [--compression bf16|fp16] [--hang]
                                  [--stall S [--stall-process P]] [--custom-step] [--keras]
    python train_data_parallel.py OUT_DIR --each NAME "ARGS" [--each NAME "ARGS" ...]
Process 0 writes OUT_DIR/params.npz; every process writes OUT_DIR/history_<rank>.json.
With --each, the processes train one fresh model after the other, each with its own ARGS (the options
above), into OUT_DIR/NAME: one job (and one start-up of its processes) for several trainings.
"""

import argparse
import ctypes
import json
import os
import shlex
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import meshfit as mf  # noqa: E402  (no JAX computation may run before the strategy joins the job)


def mesh_strategy(devices=None):
    """FSDP over 2 x 2 devices: parameters sharded across processes too."""
    return mf.strategies.MeshStrategy(axes={"data": 2, "fsdp": 2, "tensor": 1}, min_shard_size=16, devices=devices)


def stall(epoch, strategy, seconds, process):
    """After epoch 0, `process` blocks for `seconds` in C code that holds the GIL: no Python thread runs."""
    if epoch == 0 and strategy.process_index == process:
        print(f"stalling {seconds:g} s", flush=True)
        ctypes.PyDLL(None).sleep(int(seconds))  # PyDLL: the GIL is held through the call
        print("stall over", flush=True)


def parser_():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--strategy", default="multi_worker", choices=["multi_worker", "mirrored", "mesh"])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--n", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=15)
    parser.add_argument("--steps-per-execution", type=int, default=1)
    parser.add_argument("--compression", default=None, help="gradient_compression of the data-parallel strategies")
    parser.add_argument("--hang", action="store_true", help="train for a long time (for kill tests)")
    parser.add_argument(
        "--stall",
        type=float,
        default=0.0,
        help="seconds a process stalls at the end of epoch 0, holding the GIL (as a long compilation might)",
    )
    parser.add_argument("--stall-process", type=int, default=1, help="the process that stalls")
    parser.add_argument(
        "--custom-step",
        action="store_true",
        help="train tests/custom_models.OwnGradients (its own train_step); first try a fit with a partial "
        "batch, which must be refused before any step, and save the refusal",
    )
    parser.add_argument("--keras", action="store_true", help="train a Keras 3 Sequential MLP (keras_mlp) instead")
    parser.add_argument(
        "--each",
        nargs=2,
        action="append",
        metavar=("NAME", "ARGS"),
        help="train once more, with these options, into OUT_DIR/NAME (repeatable; the others are ignored)",
    )
    return parser


def main():
    parser = parser_()
    args = parser.parse_args()
    if not args.each:
        train(args)
    for name, options in args.each or []:
        print(f"training {name}", flush=True)  # what follows, up to the next such line, is this training's
        train(parser.parse_args([os.path.join(args.out, name), *shlex.split(options)]))


def keras_mlp():
    """The test MLP's shape as a Keras 3 Sequential model, from Keras's seed 0 in a fresh session."""
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras

    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(3)])


def train(args):
    """Trains a fresh model under the strategy `args` name and saves what it got into `args.out`."""
    if args.strategy == "multi_worker":
        strategy = mf.strategies.MultiWorkerMirroredStrategy(gradient_compression=args.compression)
    elif args.strategy == "mesh":
        strategy = mesh_strategy()
    else:
        import jax

        strategy = mf.strategies.MirroredStrategy(jax.devices()[:4], gradient_compression=args.compression)
    import numpy as np
    from helpers import MLP, classification_data

    x, y = classification_data(n=args.n)
    with strategy.scope():
        if args.custom_step:
            from custom_models import OwnGradients

            model = OwnGradients(MLP(din=4, hidden=32, dout=3))
            model.compile(optimizer="adam", steps_per_execution=args.steps_per_execution)
        else:
            model = mf.Model(keras_mlp() if args.keras else MLP(din=4, hidden=32, dout=3))
            model.compile(
                optimizer="adam",
                loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"],
                steps_per_execution=args.steps_per_execution,
            )
    refusal = None
    if args.custom_step:  # batches of 12 rows: a partial last batch
        try:
            model.fit(x, y, batch_size=12, epochs=1, validation_split=0.2, verbose=0)
        except ValueError as error:
            refusal = {"message": str(error), "steps": int(model.session.state.step)}
    print(
        f"pid {os.getpid()} rank {strategy.process_index} of {strategy.process_count} "
        f"replicas {strategy.num_replicas_in_sync}",
        flush=True,
    )
    epochs = 10_000 if args.hang else args.epochs
    callbacks = []
    if args.hang:
        callbacks.append(
            mf.callbacks.LambdaCallback(
                on_epoch_end=lambda e, logs: (print(f"epoch {e}", flush=True), time.sleep(0.05))
            )
        )
    if args.stall:
        callbacks.append(
            mf.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: stall(e, strategy, args.stall, args.stall_process))
        )
    history = model.fit(
        x, y, batch_size=args.batch_size, epochs=epochs, validation_split=0.2, verbose=2, callbacks=callbacks
    )
    evaluation = model.evaluate(x, y, batch_size=args.batch_size, verbose=0, return_dict=True)
    predictions = model.predict(x[:23], batch_size=args.batch_size, verbose=0)
    os.makedirs(args.out, exist_ok=True)
    rank = strategy.process_index
    report = model.step_report()
    collectives = {"compiled": report.collectives, "lowered": report.lowered_collectives}
    with open(os.path.join(args.out, f"history_{rank}.json"), "w") as f:
        json.dump(
            {"history": history.history, "evaluate": evaluation, "collectives": collectives, "refusal": refusal}, f
        )
    if rank == 0:
        np.savez(os.path.join(args.out, "params.npz"), *model.get_weights(), predictions=predictions)


if __name__ == "__main__":
    main()
