"""The explicit data-parallel step: each replica's gradients on its rows, summed by meshfit with `lax.psum`.

Under `jax.shard_map` over the data axis every device runs
`StepFunctions.gradients` on its own rows of the batch, with `DataReplicas` as
the collectives: one `psum` of the gradients (cast to a narrower dtype first
when compressed), one of the loss totals, row counts and metric increments,
and a `pmean` of the module state (BatchNorm statistics). The optimizer
update then runs on the summed gradients, replicated, as on one device.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

#: Names `gradient_compression` takes, and the dtype gradients cross the all-reduce in.
COMPRESSIONS = {"bf16": jnp.bfloat16, "fp16": jnp.float16}
#: Ways a data-parallel strategy reduces gradients: XLA's (GSPMD) or meshfit's own collectives.
REDUCTIONS = ("auto", "explicit")
_FP16_MAX = float(np.finfo(np.float16).max)


def check_options(reduction: str | None, gradient_compression: str | None) -> str:
    """The reduction to use for these arguments, or a `ValueError` naming the accepted values."""
    if gradient_compression is not None and gradient_compression not in COMPRESSIONS:
        raise ValueError(
            f"Unknown gradient_compression {gradient_compression!r}. Expected None or one of {sorted(COMPRESSIONS)}."
        )
    if reduction is None:
        return "explicit" if gradient_compression else "auto"
    if reduction not in REDUCTIONS:
        raise ValueError(f"Unknown reduction {reduction!r}. Expected one of {list(REDUCTIONS)} (or None).")
    if gradient_compression and reduction != "explicit":
        raise ValueError(
            f"gradient_compression={gradient_compression!r} casts the gradients before meshfit's own all-reduce, "
            f"which reduction={reduction!r} leaves to XLA. Use reduction='explicit' (or leave reduction unset)."
        )
    return reduction


class DataReplicas:
    """`meshfit.steps.builtin.Replicas` for the devices of one mesh axis, inside `shard_map`.

    Args:
        axis: the mesh axis the batch is split over.
        compression: None, "bf16" or "fp16": the dtype the gradients cross the
            all-reduce in. fp16 is scaled first by a power of two chosen from
            the largest gradient of all replicas (one scalar `pmax`), so that no
            partial sum of the all-reduce can exceed float16's range; the scale
            is divided out afterwards, in float32.
    """

    def __init__(self, axis: str, compression: str | None = None):
        self.axis = axis
        self.compression = compression

    def sum(self, tree):
        return jax.lax.psum(tree, self.axis)

    def sum_gradients(self, grads):
        if self.compression is None:
            return self.sum(grads)
        dtype = COMPRESSIONS[self.compression]
        scale = self._fp16_scale(grads) if self.compression == "fp16" else None
        sent = jax.tree.map(lambda g: (g if scale is None else g * scale).astype(dtype), grads)
        summed = self.sum(sent)
        return jax.tree.map(
            lambda s, g: s.astype(g.dtype) if scale is None else s.astype(g.dtype) / scale, summed, grads
        )

    def _fp16_scale(self, grads):
        """A power of two that brings every replica's gradients to at most float16's max / replicas.

        Non-finite gradients keep the scale 1, so they reach a loss scale's finite check as they are.
        """
        largest = jnp.max(jnp.stack([jnp.max(jnp.abs(g)).astype(jnp.float32) for g in jax.tree.leaves(grads)]))
        largest = jax.lax.pmax(largest, self.axis)
        replicas = jax.lax.axis_size(self.axis)
        exponent = jnp.floor(jnp.log2(_FP16_MAX / (replicas * largest)))
        usable = jnp.isfinite(largest) & (largest > 0)
        return jnp.where(usable, jnp.exp2(jnp.clip(exponent, -126, 126)), 1.0).astype(jnp.float32)

    def mean_state(self, model_state):
        return jax.tree.map(self._mean_leaf, model_state)

    def _mean_leaf(self, leaf):
        if jnp.issubdtype(leaf.dtype, jnp.inexact):
            return jax.lax.pmean(leaf, self.axis)
        return jax.lax.pmax(leaf, self.axis)  # counters: equal on every replica

    def rng(self, key):
        return jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(key), jax.lax.axis_index(self.axis)))


def replica_gradients(steps, mesh, axis: str, compression: str | None = None) -> Callable:
    """`steps.gradients` run per replica under `jax.shard_map`, reduced with `DataReplicas`.

    Parameters, module state, the key and the loss scale enter replicated;
    the batch is split on `axis`. The parameters are marked as varying over
    the axis before the backward pass, so their gradients stay per replica
    until `DataReplicas` sums them (without it, JAX would sum them itself).
    """
    replicas = DataReplicas(axis, compression)

    def per_replica(params, model_state, batch, rng, loss_scale):
        params = jax.lax.pcast(params, axis, to="varying")
        return steps.gradients(params, model_state, batch, rng, loss_scale, replicas=replicas)

    return jax.shard_map(per_replica, mesh=mesh, in_specs=(P(), P(), P(axis), P(), P()), out_specs=(P(), P(), P()))
