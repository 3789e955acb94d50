"""Array data: shuffle orders shared across fits and computed ahead."""

import numpy as np
from helpers import MLP, classification_data

import meshfit as mf
from meshfit.data import ArrayData, ShuffleOrders


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
    first_batch = next(data.epoch(2))
    assert data._order(2) is prepared
    np.testing.assert_array_equal(first_batch.x, x[prepared[:16]])


def test_unshuffled_data_prepares_nothing():
    x, y = classification_data(n=64)
    data = ArrayData(x, y, batch_size=16, shuffle=False)
    data.prepare(3)
    assert data._orders._orders == {}
