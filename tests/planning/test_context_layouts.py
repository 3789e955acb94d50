"""mf.plan proposes `context` layouts for long sequences, and they compile with less activation memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import meshfit as mf
from meshfit.planning import planner


def test_context_layouts_split_sequences_that_cut_into_2c_chunks():
    names = [layout.name for layout in planner.context_layouts(8, 4096)]
    assert names == ["context=2,data=4", "context=4,data=2", "context=8"]
    assert [layout.name for layout in planner.context_layouts(8, 12)] == ["context=2,data=4"]  # 12 % 8, 12 % 16
    assert planner.context_layouts(8, None) == []


class Attend(nnx.Module):
    """Tokens -> logits through one causal attention layer of meshfit's."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(32, 16, rngs=rngs)
        self.qkv = nnx.Linear(16, 48, use_bias=False, rngs=rngs)
        self.head = nnx.Linear(16, 32, rngs=rngs)

    def __call__(self, tokens):
        b, s = tokens.shape
        h = self.embed(tokens)
        q, k, v = jnp.split(self.qkv(h).reshape(b, s, 6, 8), 3, axis=2)
        return self.head(h + mf.layers.dot_product_attention(q, k, v).reshape(b, s, 16))


@pytest.mark.slow  # compiles four candidates
def test_a_plan_of_a_long_sequence_holds_a_context_layout_with_less_activation_memory():
    tokens = np.random.default_rng(0).integers(0, 32, size=(2, 257)).astype(np.int32)
    found = mf.plan(
        lambda: Attend(nnx.Rngs(0)),
        tokens[:, :-1],
        tokens[:, 1:],
        compile=dict(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True)),
        devices=jax.devices()[:2],
        context=True,
        verbose=0,
    )
    by_name = {c.layout.name: c for c in found.candidates}
    assert set(by_name) == {"mirrored", "fsdp=2", "tensor=2", "context=2"}
    context = by_name["context=2"]
    assert context.error is None and context.report.context.kv_bytes > 0
    assert context.report.memory["temporaries"] < 0.7 * by_name["mirrored"].report.memory["temporaries"]
    assert "context=2" in str(found)
