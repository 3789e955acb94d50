"""examples/transformer_lm.py trains (loss falls) and samples on the 8 simulated devices of conftest.py."""

import jax
import pytest
from helpers import load_example
from jax.sharding import PartitionSpec as P

pytestmark = pytest.mark.slow  # trains the examples for seconds each (the fast tier leaves these out)

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
