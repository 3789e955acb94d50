"""How a partitioned server state is split over server processes, and put back together by a worker."""

import jax
import numpy as np
import pytest

from meshfit.strategies.parameter_server.partition import Partition
from meshfit.strategies.parameter_server.server import ServerLayout


def leaves():
    rng = np.random.default_rng(0)
    return [
        rng.normal(size=(4, 6)).astype(np.float32),
        rng.normal(size=(3,)).astype(np.float32),
        rng.normal(size=(2, 8)).astype(np.float32),
    ]


@pytest.mark.parametrize("count", [2, 4])
def test_a_worker_assembles_each_leaf_from_every_servers_part(count):
    whole = [jax.numpy.asarray(leaf) for leaf in leaves()]
    partition = Partition([0 if count == 2 else None, None, 1], count)
    offered = [partition.parts(whole, server) for server in range(count)]
    split = sum(dim is not None for dim in partition.dims)
    assert [len(parts) for parts in offered] == [3] + [split] * (count - 1)  # whole leaves come from server 0
    for server, parts in enumerate(offered):  # the shapes a worker expects are the shapes served
        avals = partition.part_avals([jax.ShapeDtypeStruct(a.shape, a.dtype) for a in whole], server)
        assert avals == [(p.shape, p.dtype) for p in parts]
    for got, expected in zip(partition.assemble(offered), whole, strict=True):
        np.testing.assert_array_equal(got, expected)


def test_only_server_zero_offers_whole_leaves_but_every_server_takes_a_copy_of_a_gradient():
    whole = [jax.numpy.asarray(leaf) for leaf in leaves()]
    partition = Partition([0, None, 1], 2)
    assert [p.shape for p in partition.parts(whole, 1)] == [(2, 6), (2, 4)]
    assert [p.shape for p in partition.parts(whole, 1, whole_everywhere=True)] == [(2, 6), (3,), (2, 4)]
    np.testing.assert_array_equal(partition.parts(whole, 1)[1], whole[2][:, 4:])


def test_the_split_follows_the_server_layout_and_nothing_is_split_for_one_server_process():
    layout = ServerLayout(jax.devices()[:2], min_shard_size=16)
    params = {"big": np.zeros((8, 32), np.float32), "small": np.zeros((3,), np.float32)}
    split = jax.sharding.NamedSharding(layout.mesh, jax.sharding.PartitionSpec(None, "ps"))
    placed = jax.device_put(params, {"big": split, "small": layout.replicated})
    assert Partition.of(placed, 2).dims == [1, None]
    assert Partition.of(placed, 1).dims == [None, None]


def test_state_partitions_split_large_parameters_and_their_optimizer_moments_alike():
    """Ray's server actors share no mesh: the split comes from the same rule as ServerLayout's mesh layout."""
    import optax

    from meshfit.strategies.parameter_server.partition import state_partitions

    params = {"big": np.zeros((8, 64), np.float32), "small": np.zeros((3,), np.float32)}
    opt_state = optax.adam(1e-3).init(params)
    params_split, opt_split = state_partitions(params, opt_state, count=4, min_shard_size=16)
    assert params_split.dims == [1, None]  # the largest dimension dividing by 4; the bias stays whole
    by_name = dict(
        zip(
            [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(opt_state)],
            opt_split.dims,
            strict=True,
        )
    )
    assert [d for name, d in by_name.items() if "big" in name] == [1, 1]  # adam's mu and nu follow the kernel
    assert [d for name, d in by_name.items() if "big" not in name] == [None] * 3  # count, the bias's moments
    # Every server holds parts of one shape, so one exported update program serves them all.
    leaves_ = jax.tree.leaves(opt_state)
    avals = [jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype) for a in leaves_]
    shapes = {tuple(opt_split.part_avals(avals, k, whole_everywhere=True)) for k in range(4)}
    assert len(shapes) == 1
