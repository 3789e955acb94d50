"""mf.layers.dot_product_attention: plain attention without a `context` axis, and ring and all-gather attention
under one, equal to plain attention in values and gradients (causal and not, grouped-query heads, odd axes)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import meshfit as mf
from meshfit.layers import load_balance

B, S, HEADS, KV_HEADS, D = 4, 48, 4, 2, 8


def qkv(seq=S, heads=HEADS, kv_heads=KV_HEADS):
    keys = jax.random.split(jax.random.key(0), 3)
    return (
        jax.random.normal(keys[0], (B, seq, heads, D)),
        jax.random.normal(keys[1], (B, seq, kv_heads, D)),
        jax.random.normal(keys[2], (B, seq, kv_heads, D)),
    )


def loss_and_grads(causal, context_parallel):
    """The attention's output and the gradients of a loss of it, for q, k and v."""

    def loss(q, k, v):
        out = mf.layers.dot_product_attention(q, k, v, causal=causal, context_parallel=context_parallel)
        return jnp.sum(jnp.sin(out)), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def assert_equal_to_plain(strategy, causal, context_parallel, q, k, v):
    (_, expected), expected_grads = loss_and_grads(causal, context_parallel)(q, k, v)  # no strategy: plain
    np.testing.assert_allclose(expected, jax.nn.dot_product_attention(q, k, v, is_causal=causal), atol=1e-6)
    with strategy.scope():
        (_, out), grads = loss_and_grads(causal, context_parallel)(q, k, v)
    np.testing.assert_allclose(out, expected, atol=2e-6)
    for got, want in zip(grads, expected_grads, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize(
    "context_parallel, causal",
    [
        pytest.param("ring", True, marks=pytest.mark.slow),  # the balanced layout, 3 conds: ~5 CPU-s to compile
        ("ring", False),
        ("all_gather", True),
        ("all_gather", False),
    ],
)
def test_context_parallel_equals_plain_attention_and_its_gradients(context_parallel, causal):
    strategy = mf.strategies.MeshStrategy(axes={"context": 4, "data": 2})
    assert_equal_to_plain(strategy, causal, context_parallel, *qkv())


@pytest.mark.slow
def test_an_odd_context_axis_with_heads_over_tensor():
    strategy = mf.strategies.MeshStrategy(axes={"context": 3, "tensor": 2}, devices=jax.devices()[:6])
    assert_equal_to_plain(strategy, True, "ring", *qkv())


def test_the_balanced_layout_holds_chunks_i_and_2c_minus_1_minus_i_and_comes_back():
    size = 4
    mesh = jax.make_mesh((size,), ("context",), axis_types=(AxisType.Auto,), devices=jax.devices()[:size])
    x = jnp.arange(2 * 2 * size * 3).reshape(2, 2 * size * 3)[..., None]  # (rows, seq 24, 1): chunks of 3

    def there_and_back(x):
        balanced = load_balance.to_balanced(x, "context", size)
        pos = load_balance.positions("context", size, x.shape[1] // 2)
        return balanced, pos[None, :, None], load_balance.from_balanced(balanced, "context", size)

    spec = P(None, "context")
    balanced, positions, back = jax.shard_map(there_and_back, mesh=mesh, in_specs=spec, out_specs=(spec,) * 3)(x)
    np.testing.assert_array_equal(back, x)
    np.testing.assert_array_equal(balanced[0, :, 0], positions[0, :, 0])  # x[0] holds its positions
    device_1 = np.asarray(balanced[0, 6:12, 0])
    np.testing.assert_array_equal(device_1, [3, 4, 5, 18, 19, 20])  # chunk 1 and chunk 2 * 4 - 1 - 1 = 6


def test_a_mesh_without_a_context_axis_gives_plain_attention():
    q, k, v = qkv(seq=8)
    with mf.strategies.MeshStrategy(axes={"data": 8}).scope():
        out = jax.jit(lambda q, k, v: mf.layers.dot_product_attention(q, k, v, causal=False))(q, k, v)
    np.testing.assert_allclose(out, jax.nn.dot_product_attention(q, k, v), atol=1e-6)


def test_shapes_that_do_not_fit_are_errors_naming_them():
    q, k, v = qkv(seq=8)
    with pytest.raises(ValueError, match=r"\(batch, seq, heads, head_dim\).*Received shapes"):
        mf.layers.dot_product_attention(q[0], k, v)
    with pytest.raises(ValueError, match=r"query heads a multiple of key heads.*\(4, 8, 3, 8\)"):
        mf.layers.dot_product_attention(q, q[:, :, :3], q[:, :, :3])
    with mf.strategies.MeshStrategy(axes={"context": 4, "data": 2}).scope():
        with pytest.raises(ValueError, match=r"sequence of 10 does not split over context=4 .*multiple of 4"):
            mf.layers.dot_product_attention(*qkv(seq=10), causal=False, context_parallel="all_gather")
