"""Worker for the background-save crash test: saves numbered states into one directory with
`CheckpointDir(async_save=True)`, each array filled with the save's number, printing a line once each
save is started (written in meshfit's background thread), until it is killed."""

import sys

import jax.numpy as jnp

from meshfit.checkpointing.checkpoint import CheckpointDir

ckpt = CheckpointDir(sys.argv[1], "backup", max_to_keep=2, async_save=True)
for number in range(1, 1000):
    state = {"w": jnp.full((2048, 2048), number, jnp.float32), "b": jnp.full((2048,), number, jnp.float32)}
    ckpt.save(number, state, {"number": number})  # waits for the previous write first
    print(f"started {number}", flush=True)
