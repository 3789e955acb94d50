"""The places meshfit reaches into JAX's implementation (`meshfit.core.compat`) still find what they rely on."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from meshfit.core import compat


def test_vjp_residuals_keeps_apart_the_parameters_jax_vjp_holds():
    def layer(params, x):
        return jnp.tanh(x @ params["kernel"]) * params["scale"]

    params = {"kernel": jnp.arange(12.0).reshape(3, 4) / 10, "scale": jnp.full((4,), 2.0)}
    x = jnp.linspace(-1, 1, 6).reshape(2, 3)
    residuals = compat.vjp_residuals(layer, params, x)
    assert 0 in residuals.primal  # the kernel (leaf 0) is a residual, held as the array passed in
    y, vjp = jax.vjp(layer, params, x)
    kept = residuals.kept(vjp)
    assert len(kept) == len(residuals.kept_shapes) < len(jax.tree.leaves(vjp))
    assert all(not any(leaf is p for p in jax.tree.leaves(params)) for leaf in kept)
    cotangent = jnp.ones_like(y)
    for got, expected in zip(
        jax.tree.leaves(residuals.rebuild(params, kept)(cotangent)), jax.tree.leaves(vjp(cotangent)), strict=True
    ):
        np.testing.assert_array_equal(got, expected)


def test_a_shard_map_nested_in_a_scanned_manual_region_differentiates_once_fixed():
    """An inner map over 'context' (a roll of the sequence by one device) inside a scan inside an outer map over
    'stage': its gradient compiles with the fix and equals the same computation written without maps."""
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    assert compat.fix_nested_shard_map_residuals()
    mesh = jax.make_mesh((2, 4), ("stage", "context"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    ring = [(i, (i + 1) % 4) for i in range(4)]

    def inner(h):  # the next device's block and a nonlinearity: residuals that vary over 'context'
        return jnp.tanh(lax.ppermute(h, "context", ring) * lax.axis_index("context"))

    def body(w, x):
        roll = jax.shard_map(inner, in_specs=P(None, "context"), out_specs=P(None, "context"), axis_names={"context"})
        x = lax.pcast(x, ("stage",), to="varying")
        h = lax.scan(lambda h, _: (roll(h * w[0]), None), x, length=3)[0]
        return lax.psum(h, "stage")

    outer = jax.shard_map(body, mesh=mesh, in_specs=(P("stage"), P()), out_specs=P(), axis_names={"stage"})
    w = jax.device_put(jnp.array([[1.5], [0.5]]), NamedSharding(mesh, P("stage")))
    x = jnp.linspace(-1, 1, 16).reshape(2, 8)

    def plain(w, x):  # the same on whole arrays: a block of 2 from the previous device, scaled by its index
        scale = jnp.repeat(jnp.arange(4.0), 2)
        return sum(
            functools.reduce(lambda h, _: jnp.tanh(jnp.roll(h * ws, 2, axis=1) * scale), range(3), x) for ws in w[:, 0]
        )

    got = jax.jit(jax.grad(lambda w, x: (outer(w, x) ** 2).sum(), argnums=(0, 1)))(w, x)
    expected = jax.grad(lambda w, x: (plain(w, x) ** 2).sum(), argnums=(0, 1))(np.asarray(w), x)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
