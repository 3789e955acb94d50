"""The asynchronous engine's rules, with `Workers` whose results come back when the test says."""

from types import SimpleNamespace

import jax.numpy as jnp

from meshfit.core.state import TrainState
from meshfit.strategies.parameter_server.engines import AsyncEngine


class Steps:
    """`apply_gradients` subtracts the gradient and counts the step; the logs are the step count."""

    adapter = SimpleNamespace(uses_rng=False)

    def apply_gradients(self, state, grads, model_state, increments, rng):
        return state._replace(params=state.params - grads, step=state.step + 1)

    def logs(self, metrics):
        return {"loss": metrics}


class ScriptedWorkers:
    """Each job computes on the version published when it was queued; `finish(n)` completes the oldest n.

    A blocking `collect` (timeout > 0) finishes one job, as a worker would within the wait.
    """

    encoded = False
    applies_updates = False

    def __init__(self, count: int):
        self.count = count
        self.version = 0
        self.submitted, self.queued, self.done, self.timeouts = [], [], [], []

    def prepare(self, state, task):
        pass

    def publish(self, state, version):
        self.version = version

    def submit(self, task):
        self.submitted.append(task)
        self.queued.append((task, self.version))

    def finish(self, n: int):
        self.done += self.queued[:n]
        del self.queued[:n]

    def collect(self, timeout):
        self.timeouts.append(timeout)
        if timeout and not self.done:
            self.finish(1)
        done, self.done = self.done, []
        return [(task, version, (jnp.float32(1.0), (), jnp.float32(0.0))) for task, version in done]

    def take(self, state, result, staleness):
        return result

    def end_call(self):
        pass

    def close(self):
        pass


def state():
    return TrainState(jnp.float32(0.0), (), (), jnp.float32(0.0), jnp.int32(0), None)


def engine(workers, max_staleness=None):
    return AsyncEngine(SimpleNamespace(max_staleness=max_staleness), Steps(), workers)


def test_a_gradient_older_than_max_staleness_is_dropped_and_its_batch_redone_on_fresh_parameters():
    workers = ScriptedWorkers(count=4)
    train = engine(workers, max_staleness=1)
    current = state()
    for batch in ("b0", "b1", "b2"):  # all computed on version 0
        current, _ = train(current, batch)
    workers.finish(3)
    current, logs = train(current, "b3")
    assert train.version == 2 and train.staleness == [0, 1]  # b2 came 2 versions late: dropped
    redo = workers.submitted[-1]
    assert redo.batch == "b2" and not (redo.salt == workers.submitted[2].salt).all()  # its own dropout masks
    assert logs["max_staleness"] == 1.0
    current, logs = train.drain()  # b3 (version 0) is dropped too; both redone on fresh parameters
    assert train.outstanding == 0 and int(current.step) == 4 and float(current.params) == -4.0
    assert [task.batch for task in workers.submitted] == ["b0", "b1", "b2", "b3", "b2", "b3"]
    assert max(train.staleness) == 1 and logs["staleness"] == 0.5


def test_at_most_two_batches_per_worker_are_outstanding():
    workers = ScriptedWorkers(count=1)
    train = engine(workers)
    current = state()
    for batch in ("b0", "b1"):
        current, _ = train(current, batch)
    assert workers.timeouts == [0, 0] and train.outstanding == 2  # nothing waited for
    current, _ = train(current, "b2")
    assert workers.timeouts == [0, 0, 0, 1.0] and train.outstanding == 2  # waited for one gradient


def test_a_state_set_from_outside_is_adopted_and_published():
    workers = ScriptedWorkers(count=2)
    train = engine(workers)
    current, _ = train(state(), "b0")
    current, _ = train.drain()
    assert train.staleness == [0]
    restored = state()._replace(params=jnp.float32(5.0))  # e.g. set_weights or a restore: another object
    current, logs = train(restored, "b1")
    assert train.staleness == [] and "staleness" not in logs  # an epoch's statistics start again
    workers.finish(1)
    current, _ = train.drain()
    assert float(current.params) == 4.0  # applied to the adopted state
