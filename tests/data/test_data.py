"""Array data: shuffle orders shared across fits and computed ahead; iterables read ahead on a thread."""

import threading
import time

import jax
import numpy as np
import pytest
from helpers import MLP, classification_data

import meshfit as mf
from meshfit.data import sources
from meshfit.data.sources import ArrayData, IterableData, ShuffleOrders


def test_orders_are_the_seeded_permutation_and_only_the_newest_are_kept():
    orders = ShuffleOrders(keep=2)
    first = orders.get(7, 0, 10)
    np.testing.assert_array_equal(first, np.random.default_rng([7, 0]).permutation(10))
    assert orders.get(7, 0, 10) is first  # computed once
    orders.get(7, 1, 10)
    orders.get(7, 2, 10)
    assert (7, 0, 10) not in orders._orders and len(orders._orders) == 2
    assert not first.flags.writeable  # shared by every batch of a pass: no one may change it


def test_a_fit_prepares_the_next_fits_first_shuffle():
    x, y = classification_data(n=64)
    model = mf.Model(MLP())
    model.compile(optimizer="sgd", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    prepared = model._shuffle_orders._orders[(model.seed, 2, 64)]  # the pass the next fit starts with
    np.testing.assert_array_equal(prepared, np.random.default_rng([model.seed, 2]).permutation(64))

    data = ArrayData(x, y, batch_size=16, shuffle=True, seed=model.seed, orders=model._shuffle_orders)
    first_batch = next(data.batches(2))
    assert data._order(2) is prepared
    np.testing.assert_array_equal(first_batch.x, x[prepared[:16]])


def test_groups_of_shuffled_batches_are_gathered_into_aligned_arrays_with_the_same_rows():
    """A stage (a group gathered `aligned`) goes straight into arrays aligned to HOST_ALIGNMENT bytes (a
    transfer that need not copy first); their rows are those of the unaligned gather and of the batches one
    by one, partial batch included. A group that goes into a compiled call is gathered as it is: the same rows."""
    import ml_dtypes

    from meshfit.data.sources import HOST_ALIGNMENT

    rng = np.random.default_rng(0)
    x = {"a": rng.standard_normal((70, 3)).astype(np.float32), "b": rng.standard_normal(70).astype(ml_dtypes.bfloat16)}
    y, weight = rng.integers(0, 4, 70).astype(np.int32), rng.random(70)
    data = ArrayData(x, y, weight, batch_size=16, shuffle=True, seed=3)
    batches = list(data.batches(0))
    groups = [range(0, 2), range(2, 4), range(4, 5)]  # 2 + 2 + the partial batch
    for steps in groups:
        group = data.gather(0, steps, aligned=True)
        for leaf in (group.x["a"], group.x["b"], group.y, group.sample_weight, group.mask):
            assert leaf.__array_interface__["data"][0] % HOST_ALIGNMENT == 0
        assert group.mask.shape[0] == len(steps)
        jax.tree.map(np.testing.assert_array_equal, data.gather(0, steps), group)
        for j, step in enumerate(steps):
            batch = batches[step]
            for got, want in zip(
                (group.x["a"][j], group.x["b"][j], group.y[j], group.sample_weight[j], group.mask[j]),
                (batch.x["a"], batch.x["b"], batch.y, batch.sample_weight, batch.mask),
                strict=True,
            ):
                np.testing.assert_array_equal(got, want)


def test_unshuffled_data_prepares_nothing():
    x, y = classification_data(n=64)
    data = ArrayData(x, y, batch_size=16, shuffle=False)
    data.prepare(3)
    assert data._orders._orders == {}


# -- iterables read ahead on a thread ------------------------------------------------------------


def numbered_batches(count, rows=4, seen=None):
    """A generator of batches whose x holds the batch number; `seen` records the reading thread."""
    for i in range(count):
        if seen is not None:
            seen.append(threading.current_thread().name)
        yield np.full((rows, 2), i, np.float32), np.zeros(rows, np.int32)


def taken_numbers(data, epoch=0, limit=None):
    out = []
    batches = data.batches(epoch)
    for batch in batches:
        out.append(int(batch.x[0, 0]))
        if limit is not None and len(out) == limit:
            batches.close()  # the loop stops taking (an early stop)
            break
    return out


def test_batches_are_read_on_a_thread_and_come_in_order():
    seen = []
    data = IterableData(numbered_batches(6, seen=seen), prefetch=2)
    assert taken_numbers(data) == list(range(6))
    assert set(seen) == {"meshfit-prefetch"}
    seen.clear()
    data = IterableData(numbered_batches(3, seen=seen), prefetch=0)
    assert taken_numbers(data) == [0, 1, 2] and set(seen) == {threading.current_thread().name}


def test_batches_read_ahead_and_not_taken_come_first_next_time():
    data = IterableData(numbered_batches(10), prefetch=3)
    assert taken_numbers(data, limit=2) == [0, 1]  # the thread had read up to 3 more
    assert taken_numbers(data, epoch=1) == list(range(2, 10))  # none lost, none repeated


def test_the_position_is_the_next_batch_not_taken_although_more_were_read():
    reads = []

    class Source:  # re-iterable: a continuing stream with steps_per_epoch
        def __iter__(self):
            for i in range(100):
                reads.append(i)
                yield np.full((4, 2), i, np.float32), np.zeros(4, np.int32)

    data = IterableData(Source(), steps_per_epoch=10, prefetch=2)
    batches = data.batches(0)
    for _ in range(4):
        next(batches)
    time.sleep(0.2)  # let the thread run ahead
    assert len(reads) > 4 and data.get_state() == {"consumed": 4}
    batches.close()
    restored = IterableData(Source(), steps_per_epoch=10, prefetch=2)
    restored.set_state(data.get_state())
    assert taken_numbers(restored)[:2] == [4, 5]


def test_an_error_in_the_input_reaches_the_loop():
    def broken():
        yield np.zeros((4, 2), np.float32), np.zeros(4, np.int32)
        raise RuntimeError("the input broke")

    data = IterableData(broken(), prefetch=2)
    with pytest.raises(RuntimeError, match="the input broke"):
        taken_numbers(data)


def test_a_fit_from_a_generator_trains_the_same_with_and_without_read_ahead(monkeypatch):
    x, y = classification_data(n=96)

    def batches():
        for i in range(0, 96, 16):
            yield x[i : i + 16], y[i : i + 16]

    def weights(prefetch):
        monkeypatch.setattr(sources, "PREFETCH_BATCHES", prefetch)
        model = mf.Model(MLP())
        model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(batches(), epochs=1, verbose=0)
        model.fit((b for b in [(x[:10], y[:10])]), epochs=1, verbose=0)  # a short batch after full ones
        return model.get_weights()

    for a, b in zip(weights(0), weights(2), strict=True):
        np.testing.assert_array_equal(a, b)


class Rows(mf.data.DataSource):
    """Array rows in order, `rows` at a time: the smallest source a user might write."""

    def __init__(self, x, y, rows):
        self.x, self.y, self.rows = x, y, rows
        self.steps_per_epoch = -(-len(x) // rows)

    def _batch(self, i):
        part = slice(i * self.rows, (i + 1) * self.rows)
        return mf.data.make_batch(self.x[part], self.y[part], None, self.rows)

    def peek(self):
        return self._batch(0)

    def batches(self, epoch, start_step=0):
        for i in range(start_step, self.steps_per_epoch):
            yield self._batch(i)

    def get_state(self):
        return {}

    def set_state(self, state):
        del state


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
@pytest.mark.parametrize("steps_per_execution", [1, 3])
def test_a_users_own_data_source_trains_evaluates_and_predicts_as_the_same_arrays_do(steps_per_execution):
    """Keras takes a user's own DataAdapter likewise: fit (validation too), evaluate and predict."""
    x, y = classification_data(n=36)  # 4 full batches of 8 and a partial one
    assert Rows(x, y, rows=8).batch_nbytes == 8 * (4 * 4 + 4 + 4)  # x, y and mask of one batch, by the contract
    results = []
    for data in (Rows(x, y, rows=8), None):
        model = mf.Model(MLP())
        model.compile(
            optimizer="adam",
            loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            steps_per_execution=steps_per_execution,
        )
        if data is None:  # the same rows as arrays, in the same order
            history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, validation_data=(x, y), verbose=0)
            logs = model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
            predictions = model.predict(x, batch_size=8, verbose=0)
        else:
            history = model.fit(data, epochs=2, validation_data=data, verbose=0)
            logs = model.evaluate(data, verbose=0, return_dict=True)
            predictions = model.predict(Rows(x, np.zeros(len(x)), rows=8), verbose=0)
        results.append((model.get_weights(), history.history, logs, predictions))
    (weights, history, logs, predictions), (weights_, history_, logs_, predictions_) = results
    for a, b in zip(weights, weights_, strict=True):
        np.testing.assert_array_equal(a, b)
    assert history == history_ and logs == logs_
    np.testing.assert_array_equal(predictions, predictions_)


class PositionedRows(Rows):
    """Rows whose batches depend on their position alone: staged on the devices, groups from `gather`."""

    random_access = True


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
@pytest.mark.parametrize("steps_per_execution", [1, 3])
def test_a_users_own_random_access_source_is_staged_and_trains_as_it_does_batch_by_batch(steps_per_execution):
    x, y = classification_data(n=36)  # 4 full batches of 8 and a partial one
    weights = []
    for source in (Rows, PositionedRows):
        model = mf.Model(MLP())
        model.compile(
            optimizer="adam",
            loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=steps_per_execution,
        )
        model.fit(source(x, y, rows=8), epochs=2, verbose=0)
        weights.append(model.get_weights())
        if steps_per_execution == 1:
            staged = model.session.executables.compilations()["staged"]
            assert staged == (1 if source is PositionedRows else 0)
    # The same batches in the same order, through two programs (one slices the staged rows): equal to rounding.
    for a, b in zip(*weights, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)


def test_a_source_written_for_executions_is_refused_where_it_is_defined():
    """A source that groups and places batches itself (`executions`) names the method to write instead."""
    with pytest.raises(TypeError, match=r"`Grouped` defines `executions.*Rename it to `batches` and yield single"):

        class Grouped(mf.data.DataSource):
            def peek(self):
                pass

            def executions(self, epoch, size, start_step=0, pad_last=True, place=None):
                yield from ()

            def get_state(self):
                return {}

            def set_state(self, state):
                pass


def test_a_users_own_data_source_is_refused_with_what_only_arrays_take_or_with_a_wrong_batch():
    x, y = classification_data(n=16)
    model = mf.Model(MLP())
    model.compile(optimizer="sgd", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match=r"`y` and `sample_weight` must be None .* x=Rows"):
        model.fit(Rows(x, y, rows=8), y, verbose=0)
    with pytest.raises(ValueError, match=r"`batch_size` must be None .* batch_size=8"):
        model.evaluate(Rows(x, y, rows=8), batch_size=8, verbose=0)
    with pytest.raises(ValueError, match=r"must be None or equal to its `steps_per_epoch` \(2\)"):
        model.fit(Rows(x, y, rows=8), steps_per_epoch=5, verbose=0)

    class Tuples(Rows):
        def peek(self):
            return tuple(self._batch(0))

    with pytest.raises(TypeError, match=r"`Tuples.peek\(\)` must return a meshfit.core.batch.Batch.* Received: tuple"):
        model.fit(Tuples(x, y, rows=8), verbose=0)

    class Unmasked(Rows):
        def peek(self):
            return self._batch(0)._replace(mask=None)

    with pytest.raises(ValueError, match=r"`mask` is a 1-D array.* Received: mask=None"):
        model.fit(Unmasked(x, y, rows=8), verbose=0)

    class NotASubclass:
        peek, batches = Rows.peek, Rows.batches

    with pytest.raises(TypeError, match="or a meshfit.data.DataSource.*make it a subclass of meshfit.data.DataSource"):
        model.fit(NotASubclass(), verbose=0)
