"""Steps compiled on the state's leaves: the same steps as on the whole state, the tree rebuilt only when read."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshfit.core.state import TrainState
from meshfit.strategies.leaf_programs import LeafProgram
from meshfit.training.in_flight import InFlight
from meshfit.training.state_store import StateStore


def initial_state() -> TrainState:
    params = {"dense": {"kernel": jnp.ones((3, 2)), "bias": jnp.zeros((2,))}, "scale": {0: jnp.ones(())}}
    return TrainState(
        params=params,
        model_state={"rngs": {}, "weights": {}},
        opt_state=(jnp.zeros(()),),
        metrics=(jnp.zeros((2,)),),
        step=jnp.zeros((), jnp.int32),
        rng=None,
    )


def step(state: TrainState, x):
    params = jax.tree.map(lambda p: p - 0.1 * x * p, state.params)
    metrics = (state.metrics[0] + jnp.stack([x, 1.0]),)
    new = state._replace(params=params, metrics=metrics, step=state.step + 1)
    return new, {"loss": metrics[0][0] / metrics[0][1]}


def fresh(state):
    return jax.tree.map(jnp.copy, state)


def test_a_leaf_program_runs_the_same_step_as_the_tree():
    xs = [jnp.float32(v) for v in (0.5, 1.0, 2.0)]
    expected = fresh(initial_state())
    tree_step = jax.jit(step, donate_argnums=0)
    for x in xs:
        expected, expected_logs = tree_step(expected, x)

    store = StateStore(fresh(initial_state()))
    program = LeafProgram(jax.jit, step)
    logs = store.advance([(program, (x,)) for x in xs], InFlight(2))
    got = store.latest
    assert isinstance(got, TrainState) and jax.tree.structure(got) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(logs["loss"]), np.asarray(expected_logs["loss"]))
    assert program._cache_size() == 1  # one compilation for the three calls


def test_leaf_and_tree_programs_mix_and_reads_in_between_see_every_step():
    store = StateStore(fresh(initial_state()))
    leaf, tree = LeafProgram(jax.jit, step), jax.jit(step, donate_argnums=0)
    in_flight = InFlight(2)
    store.advance([(leaf, (jnp.float32(1.0),)), (leaf, (jnp.float32(1.0),))], in_flight)
    assert int(store.latest.step) == 2  # rebuilt from the leaves
    store.advance([(tree, (jnp.float32(1.0),)), (leaf, (jnp.float32(1.0),))], in_flight)
    store.replace_metrics((jnp.zeros((2,)),))
    store.advance([(leaf, (jnp.float32(3.0),))], in_flight)
    state = store.latest
    assert int(state.step) == 5
    np.testing.assert_allclose(np.asarray(state.metrics[0]), [3.0, 1.0])
    np.testing.assert_allclose(np.asarray(state.params["dense"]["kernel"]), np.full((3, 2), 0.9**4 * 0.7), rtol=1e-6)


def test_a_step_that_changes_the_state_structure_is_refused_naming_both():
    def grows(state, x):
        new, logs = step(state, x)
        return new._replace(rng=jnp.zeros((2,), jnp.uint32)), logs

    store = StateStore(fresh(initial_state()))
    with pytest.raises(ValueError, match="structured as the one it received.*Expected.*Received"):
        store.advance([(LeafProgram(jax.jit, grows), (jnp.float32(1.0),))], InFlight(2))
    assert int(store.latest.step) == 0  # the state kept is the one before
