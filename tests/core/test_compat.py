"""The places meshfit reaches into JAX's implementation (`meshfit.core.compat`) still find what they rely on."""

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
