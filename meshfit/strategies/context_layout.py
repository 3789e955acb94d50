"""The `context` mesh axis: each batch's sequence dimension split over devices (context parallelism).

A `MeshStrategy` with a `context` axis of size C > 1 has a `ContextLayout`. It
answers two questions:
  * how a batch lies on the devices (`batch_shardings`): the rows over the
    batch axes as always, and the sequence dimension of every input and target
    (dimension 1 of a `(batch, seq, ...)` array unless `sequence_axis` says
    otherwise) split in C contiguous blocks over `context`. Arrays keep their
    natural order: positions (for RoPE and masks) are the global ones;
  * whether a step's model attends through meshfit (`expect_attention`):
    `meshfit.layers.dot_product_attention` notes each call it traces
    (`note_attention`); a step traced under a context axis without one is a
    ValueError, since another attention would gather every sequence whole.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshfit.core.batch import Batch
from meshfit.core.trees import path_name

CONTEXT_AXIS = "context"

#: How a strategy says which dimension of an input or target is its sequence: one dimension for all, or one
#: per input/target name (its path in the batch, e.g. "x", "y" or "x/tokens"; None keeps it whole).
SequenceAxis = int | Mapping[str, int | None]

_CALLS: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("meshfit_attention_calls", default=None)


@dataclasses.dataclass(frozen=True)
class ContextLayout:
    """Where a context-parallel attention runs: the mesh, its `context` axis, and what else splits its arrays.

    Args:
        mesh: the device mesh; its `context` axis splits the sequence.
        batch_axes: the mesh axes the batch dimension is split over.
        head_axis: a mesh axis the heads may be split over (tensor parallelism), or None.
        sequence_axis: which dimension of each input and target is the sequence (`SequenceAxis`).
    """

    mesh: Mesh
    batch_axes: tuple[str, ...]
    head_axis: str | None = None
    sequence_axis: Any = 1

    @property
    def size(self) -> int:
        """C, the number of devices a sequence is split over."""
        return int(self.mesh.shape[CONTEXT_AXIS])

    def axis_size(self, axes: tuple[str, ...] | str | None) -> int:
        """The number of devices along `axes` (one name, several, or none)."""
        names = (axes,) if isinstance(axes, str) else tuple(axes or ())
        size = 1
        for name in names:
            size *= int(self.mesh.shape[name])
        return size

    def batch_shardings(self, host_batch: Any, rows: NamedSharding, stacked: bool = False) -> Any:
        """A sharding per leaf of `host_batch`: `rows`' split of the batch dimension, and each input's and
        target's sequence dimension over `context`. Raises a ValueError naming the input and the fix when an
        input or target has no sequence dimension, or one that does not split into C blocks."""
        lead = 1 if stacked else 0
        row_entry = rows.spec[lead] if len(rows.spec) > lead else None
        sequence_leaves = {"x", "y"}

        def sharding(path, leaf) -> NamedSharding:
            name = path_name(path)
            role = name.split("/")[0]
            if isinstance(host_batch, Batch) and role not in sequence_leaves and role != "sample_weight":
                return rows
            axis = self._axis_of(name)
            shape = tuple(getattr(leaf, "shape", ()))[lead:]
            if role == "sample_weight":  # per-token weights follow the tokens; per-row weights stay whole
                if axis is None or len(shape) <= axis or shape[axis] % self.size:
                    return rows
            elif axis is None:
                return rows
            else:
                self._check(name, shape, axis)
            spec = [None] * (lead + axis + 1)
            spec[lead], spec[lead + axis] = row_entry, CONTEXT_AXIS
            return NamedSharding(self.mesh, P(*spec))

        return jax.tree_util.tree_map_with_path(sharding, host_batch)

    def _axis_of(self, name: str) -> int | None:
        if isinstance(self.sequence_axis, Mapping):
            for key in (name, name.split("/", 1)[-1]):
                if key in self.sequence_axis:
                    return self.sequence_axis[key]
            return 1
        return self.sequence_axis

    def _check(self, name: str, shape: tuple[int, ...], axis: int) -> None:
        if axis < 1 or len(shape) <= axis:
            raise ValueError(
                f"MeshStrategy's '{CONTEXT_AXIS}' axis (size {self.size}) splits each input's and target's sequence "
                f"dimension ({axis}); '{name}' has shape {shape}, with no dimension {axis} after the batch. "
                f"Say which is the sequence, or keep it whole: MeshStrategy(..., sequence_axis={{'{name}': None}})."
            )
        if shape[axis] % self.size:
            raise ValueError(
                f"'{name}' has a sequence of {shape[axis]} (shape {shape}), which does not split over "
                f"{CONTEXT_AXIS}={self.size} devices. Use a sequence length divisible by {self.size} "
                f"(2 x {self.size} = {2 * self.size} for causal attention), or a smaller '{CONTEXT_AXIS}' axis."
            )


def note_attention() -> None:
    """Records that a meshfit attention was traced in the step being compiled (`expect_attention`)."""
    calls = _CALLS.get()
    if calls is not None:
        calls.append(1)


@contextlib.contextmanager
def expect_attention(layout: ContextLayout | None) -> Iterator[None]:
    """Raises a ValueError at the end of the block if `layout` splits sequences and no meshfit attention was
    traced inside it (the model attends its own way, which cannot see a sequence split over devices)."""
    if layout is None:
        yield
        return
    calls: list[int] = []
    token = _CALLS.set(calls)
    try:
        yield
    finally:
        _CALLS.reset(token)
    if not calls:
        raise ValueError(
            f"MeshStrategy has a '{CONTEXT_AXIS}' axis of size {layout.size}, but the model's step calls no "
            "meshfit attention. Compute attention with meshfit.layers.dot_product_attention(q, k, v, causal=...) "
            "(shaped like jax.nn.dot_product_attention), or drop the 'context' axis."
        )
