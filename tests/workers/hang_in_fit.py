"""Worker for the signal-deadline tests: a fit with backups after every batch that hangs after step 3.

    python hang_in_fit.py BACKUP_DIR HOW FIFO [--timeout SECONDS]

HOW: "input" (the generator opens FIFO, which no one writes, for its 4th batch), "step" (the 4th step's host
callback waits in C, in `sigwait` for a signal that never comes: a main thread stuck in C, where no Python
signal handler runs, as in a hung collective or compile), "none" (no hang: resumes from the backups and
trains 6 batches). Prints "step <global step>" after every batch and "hanging" as the hang begins (flushed).
"""

import argparse
import os
import signal
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
from flax import nnx  # noqa: E402
from helpers import classification_data  # noqa: E402

import meshfit as mf  # noqa: E402

HANG = [False]  # set after step 3 in "step" mode


def main():
    # SIGINT as a process started from a terminal has it, even when the suite itself runs in the background (a
    # shell starts background jobs with SIGINT ignored, and the processes they start inherit that).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    parser = argparse.ArgumentParser()
    parser.add_argument("backup")
    parser.add_argument("how", choices=["input", "step", "none"])
    parser.add_argument("fifo")
    parser.add_argument("--timeout", type=float, default=2.0)
    args = parser.parse_args()

    def block(x):
        if HANG[0]:
            print("hanging", flush=True)
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
            signal.sigwait({signal.SIGUSR2})  # never sent: the main thread waits in C for good

    class Net(nnx.Module):
        def __init__(self):
            self.dense = nnx.Linear(4, 3, rngs=nnx.Rngs(0))

        def __call__(self, x):
            if args.how == "step":
                jax.debug.callback(block, x.sum())
            return self.dense(x)

    x, y = classification_data(n=16)

    def batches():
        count = 0
        while True:
            if args.how == "input" and count == 3:
                print("hanging", flush=True)
                open(args.fifo).read()
            count += 1
            yield x, y

    model = mf.Model(Net(), seed=0)
    model.compile(optimizer="sgd", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))

    def on_batch_end(batch, logs):
        print(f"step {model.session.step}", flush=True)
        if model.session.step == 3:
            HANG[0] = True

    backup = mf.callbacks.BackupAndRestore(args.backup, save_freq=1, preemption_timeout=args.timeout)
    model.fit(
        batches(),
        epochs=1,
        steps_per_epoch=6 if args.how == "none" else 100,
        verbose=0,
        callbacks=[mf.callbacks.LambdaCallback(on_train_batch_end=on_batch_end), backup],
    )
    print("finished", flush=True)


if __name__ == "__main__":
    main()
