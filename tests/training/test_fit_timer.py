"""FitTimer: nested phases count once, JAX's compile spans move into "compile", other threads are ignored."""

import threading
import time

import jax
import jax.numpy as jnp
import pytest

from meshfit.training.fit_timer import PHASES, FitTimer


def test_nested_phases_are_exclusive_and_add_up_to_the_elapsed_time():
    timer = FitTimer()
    began = time.perf_counter()
    with timer:
        with timer.phase("callbacks"):
            time.sleep(0.05)
            with timer.phase("checkpoint"):
                time.sleep(0.1)
            time.sleep(0.05)
        time.sleep(0.02)
    elapsed = time.perf_counter() - began
    totals = timer.totals()
    assert set(totals) == set(PHASES)
    late = elapsed - 0.22  # how much later than asked the sleeps woke, all together (a loaded machine: more)
    assert 0.1 <= totals["checkpoint"] <= 0.1 + late
    assert 0.1 <= totals["callbacks"] <= 0.1 + late  # without the nested checkpoint's 0.1
    assert 0.02 <= totals["other"] <= 0.02 + late
    assert sum(totals.values()) == pytest.approx(elapsed, abs=1e-3)  # nothing counted twice
    assert not timer.running


def test_a_compile_moves_from_the_phase_it_interrupted_into_compile():
    timer = FitTimer()

    def program(x):  # a new function: traced, lowered and compiled here
        return jnp.tanh(x @ x.T).sum() + jax.jit(lambda y: y * 2)(x).sum()  # a nested jit traces inside

    x = jnp.ones((64, 64))
    with timer:
        with timer.phase("steps"):
            began = time.perf_counter()
            jax.jit(program)(x).block_until_ready()
            took = time.perf_counter() - began
    totals = timer.totals()
    assert 0.3 * took < totals["compile"] <= took  # nested trace spans are counted once
    assert totals["steps"] >= 0 and totals["steps"] + totals["compile"] == pytest.approx(took, abs=5e-3)
    with timer:
        with timer.phase("steps"):
            jax.jit(program)(x).block_until_ready()  # cached: nothing compiles
    assert timer.totals()["compile"] == 0


def test_marks_and_compiles_on_other_threads_are_not_counted():
    timer = FitTimer()

    def elsewhere():
        with timer.phase("input"):
            jax.jit(lambda v: v + 1.5)(jnp.ones(3)).block_until_ready()

    with timer:
        worker = threading.Thread(target=elsewhere)
        worker.start()
        worker.join()
    totals = timer.totals()
    assert totals["input"] == 0 and totals["compile"] == 0 and totals["other"] > 0


def test_a_timer_that_is_not_running_records_nothing():
    timer = FitTimer()
    with timer.phase("steps"):
        jax.jit(lambda v: v - 0.5)(jnp.ones(2)).block_until_ready()
    assert timer.totals() == dict.fromkeys(PHASES, 0.0) and timer.started_at is None
