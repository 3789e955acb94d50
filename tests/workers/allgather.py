"""Worker for launch tests: joins the job and gathers one number from every process (gloo connects them)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import meshfit as mf  # noqa: E402

strategy = mf.strategies.MultiWorkerMirroredStrategy()
gathered = multihost_utils.process_allgather(np.array([strategy.process_index]))
print(f"gathered {np.asarray(gathered).ravel().tolist()}", flush=True)  # one write (gloo logs interleave)
