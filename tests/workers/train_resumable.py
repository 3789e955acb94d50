"""Worker for resume tests: trains with BackupAndRestore and writes the final weights and History.

    python train_resumable.py OUT_DIR BACKUP_DIR [--save-freq N] [--spe K] [--epochs E] [--strategy S]
                              [--slow SECONDS] [--pause-at-step STEP FILE] [--die-at-step S] [--hidden H]
                              [--goodput FILE] [--hang-at-step STEP FIFO] [--hang-rank R]
                              [--preemption-timeout SECONDS] [--memory-freq K] [--keep-backups]
                              [--rank1-fails-to-restart] [--rank1-loses-its-keeper] [--learning-rate LR]
                              [--restart-learning-rate LR] [--memory-replicas R]
                              [--raise-at-step S]
Prints "step <global step>" after every batch (flushed), so a test can kill it at a known step.
"""

import argparse
import json
import os
import signal
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import meshfit as mf  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("backup")
    parser.add_argument("--save-freq", default="3")
    parser.add_argument("--spe", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--strategy", default="one_device", choices=["one_device", "multi_worker"])
    parser.add_argument("--slow", type=float, default=0.0, help="seconds to sleep after each batch")
    parser.add_argument(
        "--pause-at-step",
        nargs=2,
        metavar=("STEP", "FILE"),
        default=None,
        help="after this step, wait until FILE exists (a test does something meanwhile) before training on",
    )
    parser.add_argument(
        "--die-at-step",
        type=int,
        default=None,
        help="in the first attempt of a launched job, rank 1 SIGKILLs itself at this step",
    )
    parser.add_argument("--hidden", type=int, default=32, help="width of the hidden layer (another model)")
    parser.add_argument("--bad-label", type=int, default=None, help="give this sample the label 7 (of 3 classes)")
    parser.add_argument(
        "--sigterm-in-setup",
        action="store_true",
        help="send this process SIGTERM while fit sets up, before any step or restore",
    )
    parser.add_argument(
        "--goodput",
        default=None,
        metavar="FILE",
        help="add a Goodput callback (a record after every batch); write its ledger and the time fit returned "
        "to FILE as JSON",
    )
    parser.add_argument(
        "--hang-at-step",
        nargs=2,
        metavar=("STEP", "FIFO"),
        default=None,
        help='after this step, print "hanging at step STEP" and open FIFO (no one writes it): a callback that '
        "never returns",
    )
    parser.add_argument(
        "--hang-rank",
        type=int,
        default=None,
        help="only this rank hangs at --hang-at-step (the others block in the next collective); default: every rank",
    )
    parser.add_argument("--preemption-timeout", type=float, default=None, help="BackupAndRestore's (default: its own)")
    parser.add_argument("--memory-freq", type=int, default=None, help="BackupAndRestore's (snapshots in the launcher)")
    parser.add_argument("--keep-backups", action="store_true", help="BackupAndRestore(delete_checkpoint=False)")
    parser.add_argument(
        "--rank1-fails-to-restart",
        action="store_true",
        help="in every restart of a launched job, rank 1 exits with status 3 at once (a rank that cannot start)",
    )
    parser.add_argument(
        "--rank1-loses-its-keeper",
        action="store_true",
        help="in every restart of a launched job, rank 1's keeper address names a socket that is not there (its "
        "fetch of the memory snapshot fails while rank 0's succeeds)",
    )
    parser.add_argument("--learning-rate", type=float, default=None, help="Adam's (default: the name 'adam')")
    parser.add_argument("--memory-replicas", type=int, default=None, help="BackupAndRestore's")
    parser.add_argument(
        "--raise-at-step", type=int, default=None, help="in the first attempt, every rank raises at this step"
    )
    parser.add_argument(
        "--restart-learning-rate", type=float, default=None, help="Adam's in a restart of a launched job (another job)"
    )
    args = parser.parse_args()
    restarted = os.environ.get("MESHFIT_RESTART_COUNT", "0") != "0"
    if args.restart_learning_rate is not None and restarted:
        args.learning_rate = args.restart_learning_rate
    if args.rank1_loses_its_keeper and restarted and os.environ.get("MESHFIT_PROCESS_ID") == "1":
        os.environ["MESHFIT_KEEPER_ADDRESS"] = "unix:" + os.path.join(args.backup, "no-keeper-here.sock")
    if args.rank1_fails_to_restart and restarted and os.environ.get("MESHFIT_PROCESS_ID") == "1":
        print("rank 1 cannot start", flush=True)
        sys.exit(3)
    strategy = (
        mf.strategies.MultiWorkerMirroredStrategy()
        if args.strategy == "multi_worker"
        else mf.strategies.OneDeviceStrategy()
    )
    import time

    import numpy as np
    from helpers import MLP, classification_data

    x, y = classification_data(n=200)
    if args.bad_label is not None:
        y[args.bad_label] = 7
    with strategy.scope():
        model = mf.Model(MLP(din=4, hidden=args.hidden, dout=3, dropout=0.2), seed=7)
        model.compile(
            optimizer="adam" if args.learning_rate is None else mf.optimizers.Adam(args.learning_rate),
            loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            steps_per_execution=args.spe,
        )

    first_attempt = os.environ.get("MESHFIT_RESTART_COUNT", "0") == "0"

    def on_batch_end(batch, logs):
        print(f"step {model.session.step}", flush=True)
        if args.die_at_step == model.session.step and first_attempt and strategy.process_index == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if args.raise_at_step == model.session.step and first_attempt:
            raise RuntimeError(f"raised at step {model.session.step}")
        if args.slow:
            time.sleep(args.slow)
        hangs_here = args.hang_rank is None or args.hang_rank == strategy.process_index
        if args.hang_at_step and model.session.step == int(args.hang_at_step[0]) and hangs_here:
            print(f"hanging at step {model.session.step}", flush=True)
            open(args.hang_at_step[1]).read()
        if args.pause_at_step and model.session.step == int(args.pause_at_step[0]):
            backup.wait_until_finished()  # what it took before this step is committed while paused
            print(f"paused at step {model.session.step}", flush=True)
            deadline = time.monotonic() + 120
            while not os.path.exists(args.pause_at_step[1]) and time.monotonic() < deadline:
                time.sleep(0.05)

    class SigtermInSetup(mf.callbacks.Callback):
        def set_model(self, model):  # called by fit before on_train_begin (the restore) and the first step
            super().set_model(model)
            os.kill(os.getpid(), signal.SIGTERM)
            print("sent SIGTERM in setup", flush=True)

    save_freq = "epoch" if args.save_freq == "epoch" else int(args.save_freq)
    backup = mf.callbacks.BackupAndRestore(
        args.backup,
        save_freq=save_freq,
        **({} if args.preemption_timeout is None else {"preemption_timeout": args.preemption_timeout}),
        memory_freq=args.memory_freq,
        memory_replicas=args.memory_replicas,
        delete_checkpoint=not args.keep_backups,
    )
    callbacks = [
        mf.callbacks.LambdaCallback(on_train_batch_end=on_batch_end),
        mf.callbacks.EarlyStopping(monitor="val_loss", patience=10, restore_best_weights=True),
        mf.callbacks.ReduceLROnPlateau(monitor="loss", patience=1, factor=0.5, min_delta=0.05),
        backup,
    ]
    if args.sigterm_in_setup:
        callbacks.insert(0, SigtermInSetup())
    goodput = mf.callbacks.Goodput(record_every=0) if args.goodput else None
    if goodput is not None:
        callbacks.append(goodput)
    print(f"pid {os.getpid()} fitting", flush=True)
    history = model.fit(x, y, batch_size=16, epochs=args.epochs, validation_split=0.2, callbacks=callbacks, verbose=0)
    if goodput is not None:
        finished_at = time.time()
        print(goodput.ledger, flush=True)
        with open(args.goodput, "w") as f:
            json.dump({"ledger": goodput.ledger.to_dict(), "finished_at": finished_at}, f)
    if strategy.process_index == 0:
        os.makedirs(args.out, exist_ok=True)
        np.savez(os.path.join(args.out, "weights.npz"), *model.get_weights())
        with open(os.path.join(args.out, "history.json"), "w") as f:
            json.dump({"history": history.history, "epoch": history.epoch, "lr": model.optimizer.learning_rate}, f)
    print("finished", flush=True)


if __name__ == "__main__":
    main()
