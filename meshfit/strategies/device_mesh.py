"""DeviceMeshStrategy: the shared base of the strategies whose devices form one `jax.sharding.Mesh`.

MirroredStrategy is a one-axis mesh (`"data"`); MeshStrategy names its axes
and splits the batch over several of them. Both replicate state unless a
layout says otherwise and split each batch's rows over the batch axes: the
`NamedSharding`s for both are built here, once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshfit.strategies import placement
from meshfit.strategies.base import Strategy


def build_mesh(devices: Sequence[jax.Device], sizes: Mapping[str, int]) -> Mesh:
    """A mesh of `devices`, in order, with the named axes and sizes of `sizes` (whose product is their count)."""
    return Mesh(
        np.array(devices).reshape(tuple(sizes.values())), tuple(sizes), axis_types=(AxisType.Auto,) * len(sizes)
    )


class DeviceMeshStrategy(Strategy):
    """State replicated over a mesh (unless a subclass lays it out) and batches split over its batch axes.

    Args:
        mesh: the devices, as a `jax.sharding.Mesh`.
        batch_axes: the mesh axes the batch dimension is split over (none: every device sees the whole batch).
    """

    def __init__(self, mesh: Mesh, batch_axes: tuple[str, ...]):
        self.mesh = mesh
        self.batch_axes = batch_axes
        self.num_replicas_in_sync = int(np.prod([mesh.shape[a] for a in batch_axes])) if batch_axes else 1
        self.replicated_sharding = NamedSharding(mesh, P())
        entry = batch_axes if len(batch_axes) != 1 else batch_axes[0]
        self._batch_shardings = (NamedSharding(mesh, P(entry or None)), NamedSharding(mesh, P(None, entry or None)))

    def batch_sharding(self, stacked: bool = False) -> NamedSharding:
        """How a batch's rows lie over the devices (its second dimension when `stacked` on a steps axis)."""
        return self._batch_shardings[stacked]

    def state_shardings(self, state: Any, param_hints: Any = None) -> Any:
        return jax.tree.map(lambda _: self.replicated_sharding, state)

    def replicate(self, tree: Any) -> Any:
        return placement.put(tree, self.replicated_sharding)

    def distribute_batch(self, host_batch: Any, stacked: bool = False) -> Any:
        return placement.put_local_rows(host_batch, self.batch_sharding(stacked))
