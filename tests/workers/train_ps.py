"""Training script for parameter-server fault tests (run under `meshfit launch --ps S --workers N`).

    python train_ps.py BACKUP_DIR|none [--epochs E] [--mode async|sync] [--die-at-step S] [--die-rank R]
                       [--worker-timeout T] [--weights OUT.npz] [--dropout RATE] [--servers N] [--halve-lr]
                       [--save DIR] [--data DIGITS.npz]
In the first attempt of the job, parameter server R (rank 0 by default) SIGKILLs itself at step S.
With --weights, the servers save the final weights (get_weights order) there (rank 0 writes);
with --save, the whole model (`model.save`, every server writing its part). With --data, the digits split as
`np.savez(path, *load_data())` wrote it (a test's processes then skip scikit-learn's start-up).
"""

import argparse
import os
import signal
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))

import meshfit as mf  # noqa: E402


def halved(epoch, lr):
    """Halves the learning rate at each epoch after the first."""
    return lr / 2 if epoch else lr


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("backup")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--die-at-step", type=int, default=None)
    parser.add_argument("--die-rank", type=int, default=0)
    parser.add_argument("--worker-timeout", type=float, default=60.0)
    parser.add_argument("--mode", default="async")
    parser.add_argument("--weights", default=None)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--save", default=None)
    parser.add_argument("--halve-lr", action="store_true", help="halve the learning rate at each epoch start")
    parser.add_argument("--servers", type=int, default=1, help="server devices of rank 0 to partition over")
    parser.add_argument("--data", default=None, help="load_data()'s four arrays, saved by np.savez")
    args = parser.parse_args()
    import jax

    server_device = jax.local_devices()[: args.servers] if args.servers > 1 else None
    strategy = mf.strategies.ParameterServerStrategy(
        mode=args.mode, worker_timeout=args.worker_timeout, server_device=server_device
    )
    from digits import MLP, load_data
    from flax import nnx

    if args.data:
        import numpy as np

        with np.load(args.data) as saved:
            x_train, x_test, y_train, y_test = (saved[f"arr_{i}"] for i in range(4))
    else:
        x_train, x_test, y_train, y_test = load_data()
    with strategy.scope():
        module = MLP(64, 128, 10, rngs=nnx.Rngs(0))
        module.dropout.rate = args.dropout
        model = mf.Model(module)
        model.compile(
            optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"]
        )
    first_attempt = os.environ.get("MESHFIT_RESTART_COUNT") == "0"

    def maybe_die(batch, logs):
        if first_attempt and model.session.step == args.die_at_step and jax.process_index() == args.die_rank:
            os.kill(os.getpid(), signal.SIGKILL)

    callbacks = [mf.callbacks.LambdaCallback(on_train_batch_end=maybe_die)]
    if args.halve_lr:
        callbacks.append(mf.callbacks.LearningRateScheduler(halved))
    if args.backup != "none":
        callbacks.append(mf.callbacks.BackupAndRestore(args.backup, save_freq=10))
    history = model.fit(x_train, y_train, batch_size=64, epochs=args.epochs, callbacks=callbacks, verbose=2)
    kernel = model.session.state.params["hidden1"]["kernel"]
    print(
        f"hidden1/kernel {getattr(kernel.sharding, 'spec', 'whole')} on {len(kernel.sharding.device_set)} server devices "  # noqa: E501
        f"of {len({d.process_index for d in kernel.sharding.device_set})} process(es)",
        flush=True,
    )
    if args.weights:
        import numpy as np

        weights = model.get_weights()  # on every server: a collective when the state is partitioned
        if jax.process_index() == 0:
            np.savez(args.weights, *weights)
    if args.save:
        model.save(args.save)
        shards = [s.data.shape for s in kernel.addressable_shards]
        print(f"rank {jax.process_index()} saved; its hidden1/kernel shards {shards}", flush=True)
    result = model.evaluate(x_test, y_test, verbose=0, return_dict=True)
    print(f"epochs {len(history.epoch)} last {history.epoch[-1]} test accuracy: {result['accuracy']:.4f}", flush=True)


if __name__ == "__main__":
    main()
