"""Small models, data and assertions shared by the tests."""

import contextlib
import importlib.util
import os
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshfit.checkpointing.checkpoint import MARKER, PROBE, own_names
from meshfit.checkpointing.dirlock import LOCK_NAME


class MLP(nnx.Module):
    """A small MLP used across tests (optionally with dropout)."""

    def __init__(self, din=4, hidden=16, dout=3, *, dropout=0.0, seed=0):
        rngs = nnx.Rngs(seed)
        self.hidden = nnx.Linear(din, hidden, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs) if dropout else None
        self.out = nnx.Linear(hidden, dout, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.hidden(x))
        if self.dropout is not None:
            x = self.dropout(x)
        return self.out(x)


EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")


class ResidualBlock(nnx.Module):
    """A block for `meshfit.pipeline.Stages`: (rows, 16) -> (rows, 16); autodiff keeps 16 + 32 + 32 floats a row of
    it (its input, up's output, tanh's)."""

    def __init__(self, rngs):
        self.up = nnx.Linear(16, 32, rngs=rngs)
        self.down = nnx.Linear(32, 16, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jnp.tanh(self.up(x)))


class StagedNet(nnx.Module):
    """An embedding and a head around a `meshfit.pipeline.Stages` stack of `layers` `ResidualBlock`s:
    (rows, 8) -> (rows, 4) logits."""

    def __init__(self, layers=8, seed=0):
        from meshfit.pipeline import Stages

        rngs = nnx.Rngs(seed)
        self.embed = nnx.Linear(8, 16, rngs=rngs)
        self.body = Stages(ResidualBlock, layers, rngs=rngs)
        self.head = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.head(self.body(self.embed(x)))


def load_example(name: str, module_name: str | None = None):
    """examples/<name>.py imported as a module (under `module_name`, default `name`), without running its main."""
    spec = importlib.util.spec_from_file_location(module_name or name, os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def classification_data(n=64, din=4, classes=3, seed=0):
    """Linearly separable-ish data: labels from a fixed random projection."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, din)).astype(np.float32)
    w = rng.standard_normal((din, classes)).astype(np.float32)
    y = np.argmax(x @ w, axis=-1).astype(np.int32)
    return x, y


#: One device against a pipeline (sums over microbatches, stages in another order): float noise in a gradient
#: that Adam normalises. Keras's Adam step (meshfit's "adam") adds epsilon to the raw sqrt(v), so gradients near
#: 3e-6 (epsilon / sqrt(1 - beta_2) at the first step), common in a deep residual stack, are where a last-bit
#: difference moves a weight most: a few 1e-6 after three steps.
PIPELINE_TOLERANCE = dict(rtol=2e-5, atol=1e-5)


def assert_trees_close(a, b, rtol=1e-6, atol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def meshfit_names(pid=None) -> list[str]:
    """Every name meshfit writes into a checkpoint directory, the temporaries and probes of process `pid`
    (this one by default: the process that will save)."""
    pid = os.getpid() if pid is None else pid
    return [LOCK_NAME, MARKER, f".{MARKER}.{pid}.tmp", f"{PROBE}{pid}"]


def plant_symlinks(directory, outside, pid=None) -> dict[str, bytes]:
    """Symlinks at every meshfit name in `directory` (`meshfit_names(pid)`; in place of a file there, such as
    the marker), each to a file of its own in `outside` (created with distinct contents); returns what
    `outside` holds."""
    os.makedirs(directory, exist_ok=True)
    os.makedirs(outside, exist_ok=True)
    for i, name in enumerate(meshfit_names(pid)):
        target = os.path.join(outside, f"victim{i}")
        with open(target, "wb") as f:
            f.write(f"precious {i}\n".encode())
        if os.path.lexists(os.path.join(directory, name)):
            os.unlink(os.path.join(directory, name))
        os.symlink(target, os.path.join(directory, name))
    return read_all(outside)


def read_all(directory) -> dict[str, bytes]:
    """The bytes of every file directly in `directory`, by name (directories are skipped)."""
    found = {}
    for name in sorted(os.listdir(directory)):
        if os.path.isdir(os.path.join(directory, name)):
            continue
        with open(os.path.join(directory, name), "rb") as f:
            found[name] = f.read()
    return found


def linked_meshfit_names(directory) -> list[str]:
    """The meshfit names in `directory` that are symlinks."""
    return sorted(n for n in own_names(os.listdir(directory)) if os.path.islink(os.path.join(directory, n)))


@contextlib.contextmanager
def mounted(target, *options):
    """Mounts `target` (a bind of itself, or a tmpfs with `-t tmpfs`); skips the test where mounting is not
    allowed (mounting needs root, as on the CI machines)."""
    target.mkdir(exist_ok=True)
    source = ["tmpfs", str(target)] if "-t" in options else [str(target), str(target)]
    made = subprocess.run(["mount", *options, *source], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount here: {made.stderr.strip()}")
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], capture_output=True)


def remount_read_only(target, deadline=30.0):
    end = time.monotonic() + deadline
    while subprocess.run(["mount", "-o", "remount,bind,ro", str(target)], capture_output=True).returncode != 0:
        assert time.monotonic() < end, "could not remount read-only"  # busy while a file is open for writing
        time.sleep(0.01)
