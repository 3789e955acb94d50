"""Layers whose computation depends on how the strategy lays activations out.

`dot_product_attention` is `jax.nn.dot_product_attention` that also runs when a
`MeshStrategy`'s `context` axis splits the sequence over devices (ring or
all-gather attention). Model code calls it the same way on every strategy.
"""

from __future__ import annotations

from meshfit.layers.attention import CONTEXT_PARALLEL_CHOICES, dot_product_attention

__all__ = ["dot_product_attention", "CONTEXT_PARALLEL_CHOICES"]
