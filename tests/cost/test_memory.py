"""`meshfit.cost.memory.live_bytes`: each buffer on a device counted once, whole arrays named."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshfit.cost.memory import live_bytes


@pytest.mark.slow
def test_shards_replicas_and_views_are_counted_once():
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("i",))
    before, before_1 = live_bytes().total, live_bytes(jax.devices()[1]).total
    sharded = jax.device_put(np.ones((800, 100), np.float32), NamedSharding(mesh, P("i")))  # 40,000 B per device
    replicated = jax.device_put(np.ones((300, 100), np.float32), NamedSharding(mesh, P()))  # 120,000 B each
    alone = jax.device_put(np.ones((50, 100), np.float32), jax.devices()[0])  # 20,000 B on device 0
    views = [shard.data for shard in sharded.addressable_shards]  # the same buffers, read as arrays
    live = live_bytes()
    assert live.total - before == 40_000 + 120_000 + 20_000
    assert (300, 100) in live.whole and (50, 100) in live.whole and (800, 100) not in live.whole
    assert live_bytes(jax.devices()[1]).total - before_1 == 40_000 + 120_000  # not device 0's own array
    del sharded, replicated, alone, views
    assert live_bytes().total == before
