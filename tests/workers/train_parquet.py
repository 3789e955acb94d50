"""Worker for the Parquet exactly-once tests: trains one epoch from Parquet shards with BackupAndRestore.

    python train_parquet.py SHARDS OUT BACKUP [--save-freq N] [--memory-freq K] [--die-at-step S]
                            [--rank1-fails-to-restart] [--batch-size B]

Every batch the trainer takes is appended by `tap` to OUT/tap-<attempt>-<rank>.jsonl as
`{"epoch", "step", "ids"}` (flushed), so a test can count each id across attempts and processes. Under
`meshfit launch` the strategy is MultiWorkerMirroredStrategy; run plainly, one process on one device.

With `--die-at-step S`, after step S of the first attempt every rank waits until its backups and snapshots
in flight are complete (`BackupAndRestore.wait_until_finished`) and says so in OUT/flushed-<rank>; rank 1
then waits for rank 0's word and SIGKILLs itself. So the restart resumes from the newest backup before S,
whatever the machine's speed (no collective: the ranks may have started the next step).
"""

import argparse
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import meshfit as mf  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("shards")
    parser.add_argument("out")
    parser.add_argument("backup")
    parser.add_argument("--save-freq", type=int, default=10)
    parser.add_argument("--memory-freq", type=int, default=None)
    parser.add_argument("--die-at-step", type=int, default=None, help="rank 1 SIGKILLs itself after this step")
    parser.add_argument("--rank1-fails-to-restart", action="store_true")
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    attempt = os.environ.get("MESHFIT_RESTART_COUNT", "0")
    launched = "MESHFIT_PROCESS_ID" in os.environ
    if args.rank1_fails_to_restart and attempt != "0" and os.environ.get("MESHFIT_PROCESS_ID") == "1":
        sys.exit(3)
    strategy = mf.strategies.MultiWorkerMirroredStrategy() if launched else mf.strategies.OneDeviceStrategy()
    from helpers import MLP

    os.makedirs(args.out, exist_ok=True)
    log = open(os.path.join(args.out, f"tap-{attempt if launched else 'plain'}-{strategy.process_index}.jsonl"), "a")

    def tap(epoch, step, rows):
        log.write(json.dumps({"epoch": epoch, "step": step, "ids": rows["id"].tolist()}) + "\n")
        log.flush()

    data = mf.data.parquet(
        args.shards, x=["f0", "f1", "f2", "f3"], y="label", columns=["id"], batch_size=args.batch_size, tap=tap
    )
    with strategy.scope():
        model = mf.Model(MLP(din=4, hidden=8, dout=3), seed=7)
        model.compile(optimizer="sgd", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))

    def on_batch_end(batch, logs):
        print(f"step {model.session.step}", flush=True)
        if args.die_at_step == model.session.step and attempt == "0":
            backup.wait_until_finished()
            open(os.path.join(args.out, f"flushed-{strategy.process_index}"), "w").close()
            if strategy.process_index == 1:
                deadline = time.monotonic() + 120
                while not os.path.exists(os.path.join(args.out, "flushed-0")) and time.monotonic() < deadline:
                    time.sleep(0.02)
                os.kill(os.getpid(), signal.SIGKILL)

    backup = mf.callbacks.BackupAndRestore(
        args.backup,
        save_freq=args.save_freq,
        memory_freq=args.memory_freq,
        delete_checkpoint=False,
        max_to_keep=100,
    )
    model.fit(
        data, epochs=1, verbose=0, callbacks=[mf.callbacks.LambdaCallback(on_train_batch_end=on_batch_end), backup]
    )
    print("finished", flush=True)


if __name__ == "__main__":
    main()
