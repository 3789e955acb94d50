"""The parameter server's shared pieces: per-job salts for module random streams, row splits, weighted means."""

import jax
import numpy as np
from helpers import MLP, classification_data

import meshfit as mf
from meshfit.core.batch import Batch
from meshfit.strategies.parameter_server.server import job_salt, salted, split_rows, weighted_mean


def dropout_model():
    model = mf.Model(MLP(din=4, hidden=32, dout=3, dropout=0.5))
    model.compile(optimizer="sgd", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(*classification_data(n=16), batch_size=16, epochs=1, verbose=0)  # builds the steps
    return model


def keys_of(tree):
    return [leaf for leaf in jax.tree.leaves(tree) if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)]


def test_salted_jobs_draw_their_own_dropout_masks_and_keep_the_stream_keys():
    model = dropout_model()
    state = model.session.state
    x, y = classification_data(n=8)
    batch = Batch(x, y, None, np.ones(8, np.float32))
    gradients = jax.jit(salted(model.session.steps.gradients))
    run = lambda salt: gradients(state.params, state.model_state, batch, None, job_salt(*salt))  # noqa: E731
    (g00, s00, _), (g00_again, _, _), (g01, _, _), (g10, _, _) = run((0, 0)), run((0, 0)), run((0, 1)), run((1, 0))
    leaves = lambda tree: jax.tree.leaves(tree)  # noqa: E731
    assert all(
        np.array_equal(a, b) for a, b in zip(leaves(g00), leaves(g00_again), strict=True)
    )  # a redone job: same masks
    assert not np.array_equal(leaves(g00)[0], leaves(g01)[0])  # another part of the round: other masks
    assert not np.array_equal(leaves(g00)[0], leaves(g10)[0])  # another step: other masks
    before, after = keys_of(state.model_state), keys_of(s00)
    assert before and len(before) == len(after)
    for a, b in zip(before, after, strict=True):  # the stream keys come back unsalted
        np.testing.assert_array_equal(jax.random.key_data(a), jax.random.key_data(b))


def test_split_rows_and_weighted_mean_give_the_global_batch_gradient():
    batch = Batch(np.arange(12.0).reshape(6, 2), np.arange(6), None, np.array([1, 1, 1, 1, 1, 0], np.float32))
    parts = split_rows(batch, 3)
    assert [p.x.shape for p in parts] == [(2, 2)] * 3
    np.testing.assert_array_equal(np.concatenate([p.x for p in parts]), batch.x)
    # Per-part mean gradients weighted by real rows = the mean over all real rows.
    per_row = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 100.0])
    means = [{"g": np.float32(per_row[2 * i : 2 * i + 2][p.mask > 0].mean())} for i, p in enumerate(parts)]
    weights = np.array([p.mask.sum() for p in parts], np.float32)
    np.testing.assert_allclose(weighted_mean(means, weights)["g"], per_row[:5].mean(), rtol=1e-6)
