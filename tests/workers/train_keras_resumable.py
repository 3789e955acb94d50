"""Worker for the Keras resume test: a Keras BatchNormalization + Dropout model trained by meshfit with
BackupAndRestore (every step); writes the final weights, the model state and the History.

    python train_keras_resumable.py OUT_DIR BACKUP_DIR [--slow SECONDS] [--save-freq N] [--memory-freq K]
                                    [--die-at-step S]

Prints "step <global step>" after every batch (flushed), so a test can kill it at a known step.
"""

import argparse
import json
import os
import signal
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import meshfit as mf  # noqa: E402


class PrintStep(mf.callbacks.Callback):
    def __init__(self, slow, die_at=None):
        super().__init__()
        self.slow, self.die_at = slow, die_at

    def on_train_batch_end(self, batch, logs=None):
        print(f"step {self.context.step}", flush=True)
        if self.context.step == self.die_at and os.environ.get("MESHFIT_RESTART_COUNT", "0") == "0":
            os.kill(os.getpid(), signal.SIGKILL)  # in the first start only, under meshfit launch
        time.sleep(self.slow)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("backup")
    parser.add_argument("--slow", type=float, default=0.0, help="seconds to sleep after each batch")
    parser.add_argument("--save-freq", type=int, default=1, help="BackupAndRestore's save_freq (steps)")
    parser.add_argument("--memory-freq", type=int, default=None, help="BackupAndRestore's memory_freq (steps)")
    parser.add_argument("--die-at-step", type=int, default=None, help="SIGKILL itself there, in the first start")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 6)).astype(np.float32), rng.integers(0, 3, 64).astype(np.int32)
    keras.utils.set_random_seed(0)
    net = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.Dropout(0.3),
            keras.layers.Dense(3),
        ]
    )
    model = mf.Model(net, seed=1)
    model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["acc"])
    backup = mf.callbacks.BackupAndRestore(args.backup, save_freq=args.save_freq, memory_freq=args.memory_freq)
    callbacks = [PrintStep(args.slow, args.die_at_step), backup]
    history = model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=callbacks)
    os.makedirs(args.out, exist_ok=True)
    state = [np.asarray(a) for a in jax.tree.leaves(model.session.state.model_state)]
    np.savez(os.path.join(args.out, "weights.npz"), *model.get_weights(), *state)
    with open(os.path.join(args.out, "history.json"), "w") as f:
        json.dump(history.history, f)


if __name__ == "__main__":
    sys.exit(main())
