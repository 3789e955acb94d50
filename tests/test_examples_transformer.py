"""examples/transformer_lm.py trains (loss falls) and samples on the 8 simulated devices of conftest.py."""

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import assert_trees_close, load_example
from jax.sharding import PartitionSpec as P

import meshfit as mf

pytestmark = [pytest.mark.slow, pytest.mark.examples]  # trains the example for seconds each

TINY = [
    "--epochs",
    "2",
    "--steps-per-epoch",
    "20",
    "--layers",
    "1",
    "--d-model",
    "64",
    "--heads",
    "4",
    "--context",
    "32",
    "--batch-size",
    "16",
    "--max-bytes",
    "60000",
    "--validation-steps",
    "4",
    "--sample-len",
    "24",
    "--verbose",
    "0",
]


@pytest.fixture(scope="module")
def example():
    return load_example("transformer_lm")


@pytest.mark.parametrize(
    "extra",
    [[], ["--mesh", "2,2,2", "--untied-head", "--steps-per-execution", "5", "--eager"]],
    ids=["fsdp4-tensor2-tied-factory", "data2-fsdp2-tensor2-untied-spe5-eager"],
)
def test_transformer_lm_trains_and_samples(example, extra):
    assert jax.device_count() == 8
    result = example.main(TINY + extra)
    losses = result["history"]["loss"]
    assert len(losses) == 2
    assert losses[-1] < losses[0] - 0.5, losses  # starts near ln(256) = 5.5
    assert result["val_loss"] < 4.5, result["history"]["val_loss"]
    assert isinstance(result["sample"], str) and len(result["sample"]) > len("def ")
    assert result["sample"].startswith("def ")

    model = result["model"]
    compiles = model.session.executables.compilations()
    assert max(compiles["staged"], compiles["execution"]) == 1  # the step compiled once across both epochs
    specs = jax.tree.map(lambda a: a.sharding.spec, model.params)
    attn, mlp = specs["blocks"][0]["attn"], specs["blocks"][0]["mlp"]
    assert attn["query"]["kernel"] == P("fsdp", "tensor")
    assert attn["out"]["kernel"] == P("tensor", None, "fsdp")
    assert mlp["up"]["kernel"] == P("fsdp", "tensor")
    assert mlp["down"]["kernel"] == P("tensor", "fsdp")
    assert specs["tok_embed"]["embedding"] == P("fsdp")
    assert ("lm_head" in specs) == ("--untied-head" in extra)


def test_default_mesh_and_rules(example):
    assert example.parse_mesh(None) == {"data": 1, "fsdp": 4, "tensor": 2}
    assert example.parse_mesh("-1,1,1") == {"data": -1, "fsdp": 1, "tensor": 1}
    assert len(example.sharding_rules(tied=False)) == len(example.sharding_rules(tied=True)) + 1


def test_report_only_compares_a_rematerialised_step(example, capsys):
    """`--report-only --remat`: the step compiled with and without nnx.remat, nothing trained."""
    result = example.main(TINY + ["--report-only", "--remat"])
    report, without = result["report"], result["report_without_remat"]
    assert report.flops > without.flops  # the backward pass recomputes each block's forward
    assert result["model"].session.step == 0
    out = capsys.readouterr().out
    assert "temporaries per device with --remat" in out and "on device 0" in out


def test_pipeline_trains_the_decoder_on_stages(example, capsys):
    """`--pipeline 2`: the blocks on Stages, split over stage=2 x data=4; the loss falls, the report shows the stage."""
    quick = ["--steps-per-epoch", "8", "--validation-steps", "1", "--sample-len", "4"]
    result = example.main(TINY + ["--layers", "2", "--pipeline", "2", "--schedule", "1f1b"] + quick)
    losses = result["history"]["loss"]
    assert np.isfinite(losses).all() and losses[-1] < losses[0] - 0.3, losses
    model = result["model"]
    assert model.strategy.stages == 2 and model.strategy.pipeline == mf.strategies.Pipeline(2, "1f1b")
    specs = jax.tree.map(lambda a: a.sharding.spec, model.params)
    assert specs["blocks"]["blocks"]["mlp"]["up"]["kernel"][0] == "stage"  # each stage holds its block
    assert "stage" not in specs["tok_embed"]["embedding"]
    assert "Pipeline (2 stages, 2 microbatches, 1f1b" in capsys.readouterr().out


def test_the_pipelined_decoder_equals_one_device(example):
    """The same Stages decoder, 1f1b over stage=2 x data=4 and on one device: the same losses and parameters."""
    x, y = example.synthetic_tokens(32, 16, 64, seed=0)

    def train(strategy):
        with strategy.scope():
            model = mf.Model(
                lambda: example.TransformerLM(
                    vocab=64, context=16, layers=2, d_model=32, heads=2, stages=True, rngs=nnx.Rngs(0)
                )
            )
            model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
        history = model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        return model, history.history["loss"]

    args = example.parse_args(["--pipeline", "2", "--microbatches", "2", "--schedule", "1f1b"])
    piped, piped_loss = train(example.make_strategy(args, tied=True))
    one, one_loss = train(mf.strategies.OneDeviceStrategy())
    np.testing.assert_allclose(piped_loss, one_loss, rtol=1e-5)
    assert_trees_close(one.params, piped.params, rtol=1e-4, atol=1e-5)


def test_pipeline_takes_only_a_context_axis_from_mesh(example):
    with pytest.raises(SystemExit, match="may add only a context axis.*Received: --mesh 2,2,2"):
        example.make_strategy(example.parse_args(["--pipeline", "2", "--mesh", "2,2,2"]), tied=True)
    strategy = example.make_strategy(example.parse_args(["--pipeline", "2", "--mesh", "context=2"]), tied=True)
    assert dict(strategy.mesh.shape) == {"stage": 2, "context": 2, "data": 2, "fsdp": 1, "tensor": 1}
