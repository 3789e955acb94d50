"""Worker for the custom-step resume test: a `train_step` of the user's own, with BackupAndRestore.

    python train_custom_resumable.py OUT_DIR BACKUP_DIR [--slow SECONDS]
Prints "step <global step>" after every batch (flushed), so a test can kill it at a known step; writes the
final weights and History.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import meshfit as mf  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("backup")
    parser.add_argument("--slow", type=float, default=0.0, help="seconds to sleep after each batch")
    args = parser.parse_args()

    import numpy as np
    from custom_models import OwnGradients
    from helpers import MLP, classification_data

    x, y = classification_data(n=72)
    model = OwnGradients(MLP(hidden=16, dropout=0.2), seed=7)
    model.compile(optimizer="adam")

    def on_batch_end(batch, logs):
        print(f"step {model.session.step}", flush=True)
        if args.slow:
            time.sleep(args.slow)

    callbacks = [
        mf.callbacks.LambdaCallback(on_train_batch_end=on_batch_end),
        mf.callbacks.BackupAndRestore(args.backup, save_freq=3),
    ]
    history = model.fit(x, y, batch_size=16, epochs=3, callbacks=callbacks, verbose=0)
    os.makedirs(args.out, exist_ok=True)
    np.savez(os.path.join(args.out, "weights.npz"), *model.get_weights())
    with open(os.path.join(args.out, "history.json"), "w") as f:
        json.dump({"history": history.history, "epoch": history.epoch}, f)
    print("finished", flush=True)


if __name__ == "__main__":
    main()
