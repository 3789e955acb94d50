"""examples/transformer_lm.py's fast-decoder options, each shown equal to the plain computation it replaces.

Scanned layers against unrolled ones, chunked cross-entropy against whole logits, every remat policy against
none, XLA attention against an einsum reference; rotary embeddings are position-dependent and relative;
cuDNN on the CPU is a clear error; the scanned stack's program does not grow with depth; a tiny preset
trains through `fit` under MeshStrategy on the 8 simulated devices.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import load_example
from jax.sharding import PartitionSpec as P

pytestmark = pytest.mark.examples

SMALL = {"vocab": 64, "context": 16, "layers": 3, "d_model": 32, "heads": 4}


@pytest.fixture(scope="module")
def lm():
    return load_example("transformer_lm", "transformer_lm_options")


def tokens(batch=2, time=16, vocab=64, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (batch, time)), jnp.int32)


def loss_and_grads(module, x, y):
    """Mean next-token cross-entropy of the module's logits and its gradients, as a pure dict."""
    graphdef, params = nnx.split(module)

    def loss_fn(params):
        logits = nnx.merge(graphdef, params)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params)
    return loss, nnx.to_pure_dict(grads)


def stack_blocks(unrolled: dict) -> dict:
    """An unrolled model's pure parameters with blocks 0..L-1 stacked on a leading axis (the scanned layout)."""
    blocks = unrolled["blocks"]
    stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *[blocks[i] for i in sorted(blocks)])
    return {**unrolled, "blocks": stacked}


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


@pytest.mark.slow
@pytest.mark.parametrize("position", ["learned", "rope"])
def test_scanned_layers_equal_unrolled(lm, position):
    """The same parameters, stacked, give the same loss and gradients under nnx.scan."""
    unrolled = lm.TransformerLM(**SMALL, position=position, rngs=nnx.Rngs(0))
    scanned = lm.TransformerLM(**SMALL, position=position, scan_layers=True, rngs=nnx.Rngs(1))
    params = stack_blocks(nnx.to_pure_dict(nnx.state(unrolled, nnx.Param)))
    nnx.replace_by_pure_dict(state := nnx.state(scanned, nnx.Param), params)
    nnx.update(scanned, state)
    x, y = tokens(), tokens(seed=1)
    loss_u, grads_u = loss_and_grads(unrolled, x, y)
    loss_s, grads_s = loss_and_grads(scanned, x, y)
    np.testing.assert_allclose(loss_s, loss_u, rtol=1e-6)
    assert_trees_close(grads_s, stack_blocks(grads_u))


@pytest.mark.slow
def test_chunked_cross_entropy_equals_whole_logits(lm):
    """Per-token losses and gradients of the chunked projection equal those of the whole logits."""
    module = lm.TransformerLM(**SMALL, output="hidden", rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(module)
    x, y = tokens(), tokens(seed=1)

    def plain(params):
        logits = nnx.merge(graphdef, params).logits(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def chunked(params):
        out = nnx.merge(graphdef, params)(x)
        return lm.chunked_cross_entropy(out["hidden"], out["head"], y, chunk=4).mean()

    loss_p, grads_p = jax.jit(jax.value_and_grad(plain))(params)
    loss_c, grads_c = jax.jit(jax.value_and_grad(chunked))(params)
    np.testing.assert_allclose(loss_c, loss_p, rtol=1e-6)
    assert_trees_close(nnx.to_pure_dict(grads_c), nnx.to_pure_dict(grads_p))


def test_chunked_cross_entropy_refuses_a_chunk_that_does_not_divide(lm):
    hidden, head = jnp.zeros((2, 16, 8)), jnp.zeros((8, 32))
    with pytest.raises(ValueError, match=r"positive divisor of the sequence length 16. Received: chunk=5"):
        lm.chunked_cross_entropy(hidden, head, jnp.zeros((2, 16), jnp.int32), chunk=5)


@pytest.fixture(scope="module")
def without_remat(lm):
    """The scanned model's loss and gradients without remat: what every policy must give."""
    return loss_and_grads(lm.TransformerLM(**SMALL, scan_layers=True, rngs=nnx.Rngs(0)), tokens(), tokens(seed=1))


@pytest.mark.slow
@pytest.mark.parametrize(
    "remat", [True, "nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable", "minimal"]
)
def test_remat_policy_gives_the_gradients_of_none(lm, without_remat, remat):
    x, y = tokens(), tokens(seed=1)
    loss_0, grads_0 = without_remat
    module = lm.TransformerLM(**SMALL, scan_layers=True, remat=remat, rngs=nnx.Rngs(0))
    loss, grads = loss_and_grads(module, x, y)
    np.testing.assert_allclose(loss, loss_0, rtol=1e-6)
    assert_trees_close(grads, grads_0)


@pytest.mark.slow
def test_minimal_remat_keeps_the_named_projections(lm, capsys):
    """What the backward pass keeps (print_saved_residuals): "minimal" the projections by name, "full" none."""
    x = tokens()
    for remat in ("minimal", True):
        graphdef, params = nnx.split(lm.TransformerLM(**{**SMALL, "layers": 1}, remat=remat, rngs=nnx.Rngs(0)))

        def loss_fn(params, graphdef=graphdef):
            return optax.softmax_cross_entropy_with_integer_labels(nnx.merge(graphdef, params)(x), x).mean()

        jax.ad_checkpoint.print_saved_residuals(loss_fn, params)
        saved = capsys.readouterr().out
        named = {name for name in lm.PROJECTIONS if f"named '{name}'" in saved}
        # (mlp_down's output is never needed by the backward pass, so no policy keeps it)
        if remat == "minimal":
            assert {"query_proj", "key_proj", "value_proj", "mlp_up"} <= named, named
        else:
            assert not named, named


def test_remat_names(lm):
    assert lm.remat_policy_name(False) is None and lm.remat_policy_name("none") is None
    assert lm.remat_policy_name(True) == "full"
    assert lm.remat_policy_name("minimal") == "minimal"
    with pytest.raises(ValueError, match=r"Received: remat='everything'"):
        lm.remat_policy_name("everything")


def test_rotary_is_relative_and_position_dependent(lm):
    """q.k after rotation depends on the positions only through their difference, and it does depend on it."""
    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32) for _ in range(2))

    def score(m, n):
        return float(jnp.sum(lm.rotary(q, jnp.array([m])) * lm.rotary(k, jnp.array([n]))))

    np.testing.assert_allclose(score(3, 1), score(12, 10), rtol=1e-5)
    assert abs(score(3, 1) - score(3, 2)) > 1e-3
    np.testing.assert_allclose(lm.rotary(q, jnp.array([0])), q)  # position 0: no rotation


@pytest.mark.slow
def test_rope_model_sees_the_order_of_earlier_tokens(lm):
    """Swapping two earlier tokens changes the last position's output (attention alone is order-blind)."""
    module = lm.TransformerLM(**SMALL, position="rope", rngs=nnx.Rngs(0))
    assert module.pos_embed is None
    x = tokens(batch=1)
    swapped = x.at[0, 2].set(x[0, 5]).at[0, 5].set(x[0, 2])
    assert x[0, 2] != x[0, 5]
    last, last_swapped = module(x)[0, -1], module(swapped)[0, -1]
    assert float(jnp.max(jnp.abs(last - last_swapped))) > 1e-4


def reference_attention(q, k, v):
    """Causal softmax attention written out with einsums: (batch, time, heads, head_dim)."""
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


@pytest.mark.slow
def test_xla_attention_equals_an_einsum_reference(lm):
    attn = lm.CausalSelfAttention(32, 4, attention="xla", rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 16, 32)), jnp.float32)
    expected = attn.out(reference_attention(attn.query(x), attn.key(x), attn.value(x)))
    np.testing.assert_allclose(attn(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(jax.devices()[0].platform == "gpu", reason="cuDNN may run on a GPU")
def test_cudnn_attention_off_a_gpu_is_a_clear_error_and_auto_falls_back(lm):
    x = jnp.ones((1, 8, 32), jnp.float32)
    with pytest.raises(ValueError, match=r"attention='cudnn' needs cuDNN flash attention.*Received: the platform"):
        lm.CausalSelfAttention(32, 4, attention="cudnn", rngs=nnx.Rngs(0))(x)
    assert lm.attention_implementation("auto", jnp.bfloat16, 64) == "xla"
    with pytest.raises(ValueError, match=r"Received: attention='flash'"):
        lm.CausalSelfAttention(32, 4, attention="flash", rngs=nnx.Rngs(0))


def train_step_equations(lm, layers, scan_layers):
    """Top-level equations in the jaxpr of one loss-and-gradient computation."""
    module = lm.TransformerLM(**{**SMALL, "layers": layers}, scan_layers=scan_layers, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(module)
    x = tokens()

    def loss_fn(params):
        logits = nnx.merge(graphdef, params)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, x).mean()

    return len(jax.make_jaxpr(jax.grad(loss_fn))(params).jaxpr.eqns)


@pytest.mark.slow
def test_scanned_program_does_not_grow_with_depth(lm):
    """With scan_layers the traced program is the same size at depth 2 and 8; unrolled it grows."""
    assert train_step_equations(lm, 2, scan_layers=True) == train_step_equations(lm, 8, scan_layers=True)
    assert train_step_equations(lm, 8, scan_layers=False) > 2 * train_step_equations(lm, 2, scan_layers=False)


def test_sharding_rules_for_stacked_blocks(lm):
    unrolled, scanned = lm.sharding_rules(tied=True), lm.sharding_rules(tied=True, scan_layers=True)
    assert [pattern for pattern, _ in unrolled] == [pattern for pattern, _ in scanned]
    for (_, spec), (_, stacked) in zip(unrolled, scanned, strict=True):
        assert stacked in (spec, (None, *spec))  # block rules gain the layer axis; embeddings do not
    assert dict(scanned)[r"attn/out/kernel"] == (None, "tensor", None, "fsdp")


def test_presets_fill_sizes_and_flags_override_them(lm):
    args = lm.parse_args(["--preset", "1b", "--layers", "4"])
    assert (args.layers, args.d_model, args.heads, args.context, args.vocab) == (4, 2048, 16, 2048, 32768)
    assert lm.parse_args([]).d_model == 128 and lm.parse_args([]).remat is None
    assert lm.parse_args(["--remat"]).remat == "full"
    assert lm.parse_args(["--remat", "minimal"]).remat == "minimal"


@pytest.mark.slow
def test_tiny_preset_trains_scanned_under_mesh_strategy(lm, capsys):
    """--preset tiny (vocab 1024, synthetic tokens) with every option on: fit on a 1x4x2 mesh, loss falls."""
    assert jax.device_count() == 8
    argv = ["--preset", "tiny", "--scan-layers", "--position", "rope", "--remat", "minimal", "--loss-chunk", "8"]
    argv += ["--epochs", "2", "--steps-per-epoch", "15", "--batch-size", "16", "--validation-steps", "2"]
    result = lm.main(argv + ["--verbose", "0", "--learning-rate", "1e-2"])
    losses = result["history"]["loss"]
    assert losses[-1] < losses[0] - 0.5, losses  # starts near ln(1024) = 6.9
    assert result["sample"] is None  # no byte text to sample from synthetic tokens
    specs = jax.tree.map(lambda a: a.sharding.spec, result["model"].params)
    assert specs["blocks"]["attn"]["query"]["kernel"] == P(None, "fsdp", "tensor")
    assert specs["blocks"]["mlp"]["down"]["kernel"] == P(None, "tensor", "fsdp")
    assert result["model"].params["blocks"]["attn"]["query"]["kernel"].shape == (2, 64, 4, 16)
    assert result["model"].step_report().flops > 0  # a compute_loss override without a compiled loss trains too
    out = capsys.readouterr().out
    assert "blocks/attn/query/kernel" in out  # the summary lists the stacked parameters
