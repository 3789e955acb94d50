"""What a backup belongs to: the fingerprint of a fit's compile, and what it tells apart."""

import optax
from helpers import MLP

import meshfit as mf
from meshfit.checkpointing import job_fingerprint


def compiled(optimizer, **compile_kwargs):
    model = mf.Model(MLP(), seed=3)
    model.compile(optimizer=optimizer, loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True), **compile_kwargs)
    return job_fingerprint.of(model)


def test_the_same_compile_gives_the_same_fingerprint_and_no_differences():
    a, b = compiled(optax.adam(0.5)), compiled(optax.adam(0.5))  # two transformations built alike
    assert a == b and job_fingerprint.differences(a, b) == []


def test_what_differs_is_named_with_both_values():
    base = compiled("adam")
    assert job_fingerprint.differences(compiled("adam", steps_per_execution=2), base) == [
        "steps_per_execution: saved 2, now 1"
    ]
    (said,) = job_fingerprint.differences(compiled(mf.optimizers.Adam(0.5)), compiled(mf.optimizers.Adam(1e-3)))
    assert said.startswith("optimizer: saved ") and '"learning_rate": 0.5' in said and '"learning_rate": 0.001' in said
    (said,) = job_fingerprint.differences(compiled(optax.sgd(0.1)), compiled(optax.sgd(0.2)))
    assert said.startswith("optimizer_constants: saved ")
    assert job_fingerprint.differences(compiled("adam", loss_weights=None), compiled("sgd")) == [
        'optimizer: saved "adam", now "sgd"'
    ]


def test_a_backup_without_a_fingerprint_is_taken_as_it_was():
    """Backups written before fingerprints were recorded restore as they always did."""
    assert job_fingerprint.differences(None, compiled("adam")) == []
