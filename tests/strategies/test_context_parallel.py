"""The `context` mesh axis: a causal LM trained with sequences split over devices equals one device.

The LM is tiny (sequence 32, width 16, one block) and attends through
`mf.layers.dot_product_attention`; each training takes a few steps on 8 simulated
devices. Ring and all-gather attention, `fsdp` beside `context`, a resume from
BackupAndRestore, how batches lie on the devices, and the errors.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import PIPELINE_TOLERANCE, assert_trees_close
from jax.sharding import PartitionSpec as P

import meshfit as mf

SEQ, WIDTH, VOCAB, HEADS = 32, 16, 32, 4


class TinyLM(nnx.Module):
    """Token and position embeddings, one pre-norm causal attention block with grouped-query heads, a head."""

    def __init__(self, context_parallel="ring", attention=None, seed=0):
        rngs = nnx.Rngs(seed)
        self.tokens = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.positions = nnx.Embed(SEQ, WIDTH, rngs=rngs)
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        # No key bias: softmax ignores it, so its gradient is rounding noise that Adam would scale up to steps.
        self.q = nnx.Linear(WIDTH, WIDTH, use_bias=False, rngs=rngs)
        self.kv = nnx.Linear(WIDTH, WIDTH, use_bias=False, rngs=rngs)  # 2 key/value heads of 4: grouped-query
        self.out = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.up = nnx.Linear(WIDTH, 2 * WIDTH, rngs=rngs)
        self.down = nnx.Linear(2 * WIDTH, WIDTH, rngs=rngs)
        self.head = nnx.Linear(WIDTH, VOCAB, rngs=rngs)
        self.context_parallel = context_parallel
        self.attention = attention or mf.layers.dot_product_attention

    def __call__(self, tokens):
        b, s = tokens.shape
        h = self.tokens(tokens) + self.positions(jnp.arange(s))[None]  # global positions: the natural order
        x = self.norm(h)
        d = WIDTH // HEADS
        q = self.q(x).reshape(b, s, HEADS, d)
        k, v = jnp.split(self.kv(x).reshape(b, s, HEADS, d), 2, axis=2)
        if self.attention is mf.layers.dot_product_attention:
            a = self.attention(q, k, v, causal=True, context_parallel=self.context_parallel)
        else:
            a = self.attention(q, k, v)
        h = h + self.out(a.reshape(b, s, WIDTH))
        h = h + self.down(nnx.gelu(self.up(self.norm(h))))
        return self.head(h)


def lm_data(n=32):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, size=(n, SEQ + 1)).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]


def train(strategy, context_parallel="ring", epochs=1, callbacks=(), steps_per_execution=1):
    x, y = lm_data()
    with strategy.scope():
        model = mf.Model(TinyLM(context_parallel))
        model.compile(
            optimizer="adam",
            loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=steps_per_execution,
        )
    history = model.fit(x, y, batch_size=8, epochs=epochs, verbose=0, shuffle=False, callbacks=list(callbacks))
    return model, history


@pytest.fixture(scope="module")
def one_device():
    return train(mf.strategies.OneDeviceStrategy(), epochs=2)


def assert_same(reference, model, history, epochs=2):
    one, h_one = reference
    np.testing.assert_allclose(history.history["loss"], h_one.history["loss"][:epochs], rtol=1e-5)
    assert_trees_close(one.params, model.params, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("context_parallel", ["ring", "all_gather"])
def test_context_and_data_equal_one_device(one_device, context_parallel):
    strategy = mf.strategies.MeshStrategy(axes={"context": 4, "data": 2})
    model, history = train(strategy, context_parallel, epochs=2)
    assert int(model.session.state.step) == 8
    assert_same(one_device, model, history)


@pytest.mark.slow
def test_context_beside_fsdp_equals_one_device(one_device):
    strategy = mf.strategies.MeshStrategy(axes={"context": 2, "fsdp": 2, "data": 2}, min_shard_size=256)
    model, history = train(strategy, "ring", epochs=2, steps_per_execution=2)
    assert model.params["up"]["kernel"].sharding.spec == P(None, "fsdp")  # the parameters really are split
    assert_same(one_device, model, history)


@pytest.mark.slow
def test_resumed_from_backup_and_restore_equals_one_device(one_device, tmp_path):
    strategy = mf.strategies.MeshStrategy(axes={"context": 4, "data": 2})

    class Crash(mf.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.model.session.step == 6:
                raise RuntimeError("simulated crash")

    backup = tmp_path / "backup"
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(strategy, epochs=2, callbacks=[Crash(), mf.callbacks.BackupAndRestore(backup, save_freq=3)])
    model, history = train(strategy, epochs=2, callbacks=[mf.callbacks.BackupAndRestore(backup, save_freq=3)])
    assert int(model.session.state.step) == 8
    one, _ = one_device
    assert_trees_close(one.params, model.params, rtol=1e-5, atol=1e-6)


class AttentionBlock(nnx.Module):
    """TinyLM's block as a `Stages` block: pre-norm causal attention through meshfit, then an MLP."""

    def __init__(self, *, rngs, context_parallel="ring"):
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.q = nnx.Linear(WIDTH, WIDTH, use_bias=False, rngs=rngs)
        self.kv = nnx.Linear(WIDTH, WIDTH, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.up = nnx.Linear(WIDTH, 2 * WIDTH, rngs=rngs)
        self.down = nnx.Linear(2 * WIDTH, WIDTH, rngs=rngs)
        self.context_parallel = context_parallel

    def __call__(self, h):
        b, s, _ = h.shape
        d = WIDTH // HEADS
        x = self.norm(h)
        q = self.q(x).reshape(b, s, HEADS, d)
        k, v = jnp.split(self.kv(x).reshape(b, s, HEADS, d), 2, axis=2)
        a = mf.layers.dot_product_attention(q, k, v, causal=True, context_parallel=self.context_parallel)
        h = h + self.out(a.reshape(b, s, WIDTH))
        return h + self.down(nnx.gelu(self.up(h)))


class StagedLM(nnx.Module):
    """Embeddings (global positions), 4 attention blocks in `meshfit.pipeline.Stages`, a head."""

    def __init__(self, context_parallel="ring"):
        rngs = nnx.Rngs(0)
        self.tokens = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.positions = nnx.Embed(SEQ, WIDTH, rngs=rngs)
        make_block = functools.partial(AttentionBlock, context_parallel=context_parallel)
        self.body = mf.pipeline.Stages(make_block, 4, rngs=rngs)
        self.head = nnx.Linear(WIDTH, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        h = self.tokens(tokens) + self.positions(jnp.arange(tokens.shape[1]))[None]
        return self.head(self.body(h))


def train_staged(strategy, context_parallel="ring"):
    x, y = lm_data()
    with strategy.scope():
        model = mf.Model(lambda: StagedLM(context_parallel))
        model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model, model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)


@pytest.fixture(scope="module")
def staged_one_device():
    return train_staged(mf.strategies.OneDeviceStrategy())


@pytest.mark.slow
@pytest.mark.parametrize("schedule, repeats, context_parallel", [("circular", 2, "all_gather"), ("1f1b", 1, "ring")])
def test_context_beside_pipeline_stages_equals_one_device(staged_one_device, schedule, repeats, context_parallel):
    """Each stage's attention splits its microbatch's sequence over `context` (a shard_map nested in the
    pipeline loop's; the circular loop's rounds are rematerialised, the fused 1F1B step keeps its residuals in
    the stash): the losses and parameters are one device's."""
    one, one_history = staged_one_device
    pipeline = mf.strategies.Pipeline(microbatches=2, schedule=schedule, repeats=repeats)
    strategy = mf.strategies.MeshStrategy(axes={"stage": 2, "context": 2, "data": 2}, pipeline=pipeline)
    model, history = train_staged(strategy, context_parallel)
    assert model.params["body"]["blocks"]["up"]["kernel"].sharding.spec == P("stage")
    np.testing.assert_allclose(history.history["loss"], one_history.history["loss"], rtol=1e-5)
    assert_trees_close(one.params, model.params, **PIPELINE_TOLERANCE)


def test_batches_split_their_sequence_over_context():
    strategy = mf.strategies.MeshStrategy(axes={"context": 4, "data": 2})
    x, y = lm_data(8)
    placed = strategy.distribute_batch(mf.core.batch.Batch(x, y, None, np.ones(8, np.float32)))
    assert placed.x.sharding.spec == P("data", "context")
    assert placed.y.sharding.spec == P("data", "context")
    assert placed.mask.sharding.spec == P("data")
    assert placed.x.addressable_shards[0].data.shape == (4, SEQ // 4)
    stacked = strategy.distribute_batch(mf.core.batch.Batch(x[None], y[None]), stacked=True)
    assert stacked.x.sharding.spec == P(None, "data", "context")


# -- errors, before any step ------------------------------------------------------------------------


def test_an_axis_meshfit_does_not_know_is_an_error_unless_a_rule_names_it():
    with pytest.raises(ValueError, match=r"does not know mesh axis 'seq'.*Known axes: data, fsdp, tensor, stage"):
        mf.strategies.MeshStrategy(axes={"seq": 4, "data": 2})
    strategy = mf.strategies.MeshStrategy(axes={"expert": 2, "data": 4}, rules=[("kernel", (None, "expert"))])
    assert strategy.mesh.shape["expert"] == 2


def test_a_sequence_not_divisible_by_twice_the_axis_is_an_error_naming_the_numbers():
    strategy = mf.strategies.MeshStrategy(axes={"context": 4, "data": 2})
    q = jnp.zeros((2, 12, 2, 4))
    with strategy.scope(), pytest.raises(ValueError, match=r"sequence of 12 .*context=4.*multiple of 8.*Pad"):
        mf.layers.dot_product_attention(q, q, q, causal=True, context_parallel="ring")


def test_an_unknown_strategy_name_is_an_error():
    q = jnp.zeros((2, 8, 2, 4))
    with pytest.raises(ValueError, match=r"`context_parallel` must be one of .*Received: context_parallel='ulysses'"):
        mf.layers.dot_product_attention(q, q, q, context_parallel="ulysses")


def test_a_model_whose_attention_is_not_meshfits_is_an_error_saying_how_to_switch():
    x, y = lm_data(8)
    with mf.strategies.MeshStrategy(axes={"context": 4, "data": 2}).scope():
        model = mf.Model(TinyLM(attention=lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)))
        model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match=r"calls no meshfit attention.*meshfit.layers.dot_product_attention"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert int(model.session.state.step) == 0


def test_an_input_without_a_sequence_dimension_is_an_error_naming_the_fix():
    strategy = mf.strategies.MeshStrategy(axes={"context": 4, "data": 2})
    x, _ = lm_data(8)
    with pytest.raises(ValueError, match=r"'y' has shape \(8,\).*sequence_axis=\{'y': None\}"):
        strategy.distribute_batch(mf.core.batch.Batch(x, np.zeros(8, np.int32)))
    kept = mf.strategies.MeshStrategy(axes={"context": 4, "data": 2}, sequence_axis={"y": None})
    assert kept.distribute_batch(mf.core.batch.Batch(x, np.zeros(8, np.int32))).y.sharding.spec == P("data")


def test_sequence_axis_names_another_dimension():
    strategy = mf.strategies.MeshStrategy(axes={"context": 4, "data": 2}, sequence_axis=2)
    features_first = np.zeros((8, 3, SEQ), np.float32)
    placed = strategy.distribute_batch(mf.core.batch.Batch(features_first, features_first[:, :1]))
    assert placed.x.sharding.spec == P("data", None, "context")
    with pytest.raises(TypeError, match="sequence_axis"):
        mf.strategies.MeshStrategy(axes={"context": 4, "data": 2}, sequence_axis="seq")


# -- what it costs, and the example -------------------------------------------------------------------


@pytest.mark.slow  # compiles two steps
def test_step_report_shows_a_quarter_of_the_activation_memory_of_data_parallel_on_one_global_batch():
    """Two long sequences a batch: data=8 gives each device a whole one (6 of them padding), context=4 a quarter."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, size=(2, 257)).astype(np.int32)

    def report(axes):
        class Long(TinyLM):
            def __init__(self):
                super().__init__()
                self.positions = nnx.Embed(256, WIDTH, rngs=nnx.Rngs(1))

        with mf.strategies.MeshStrategy(axes=axes).scope():
            model = mf.Model(Long())
            model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model.step_report(tokens[:, :-1], tokens[:, 1:])

    data, context = report({"data": 8}), report({"context": 4, "data": 2})
    assert data.context is None and context.context.size == 4
    assert context.memory["temporaries"] < 0.35 * data.memory["temporaries"]
    # Ring attention sends each K/V block (256 / 4 tokens x 2 heads x 4 x float32, per row) around the ring
    # 3 times forward and its gradient 3 times backward, plus the balanced layout's moves of q, k, v, out and
    # their gradients: more than the 6 K/V passes alone.
    kv_block = 64 * 2 * 4 * 4 * 2  # K and V
    assert context.context.kv_bytes >= 6 * kv_block
    assert context.context.collectives.get("collective-permute", 0) == context.context.kv_bytes


@pytest.mark.slow  # trains the example for a few steps
@pytest.mark.examples
@pytest.mark.parametrize(
    "context_parallel, layout, context",
    [("ring", "--layers 1 --mesh context=4,data=2", 4), ("all_gather", "--layers 2 --pipeline 2 --mesh context=2", 2)],
)
def test_the_example_trains_with_context_parallelism(context_parallel, layout, context):
    from helpers import load_example

    example = load_example("transformer_lm")
    flags = "--d-model 32 --heads 4 --context 32 --batch-size 8 --epochs 1 --steps-per-epoch 3"
    flags += f" --validation-steps 1 --max-bytes 20000 --sample-len 4 --verbose 0 {layout}"
    result = example.main([*flags.split(), "--context-parallel", context_parallel])
    assert np.isfinite(result["history"]["loss"]).all()
    assert result["model"].step_report().context.size == context  # the step it trained split sequences
