"""What the devices hold right now: the bytes of live arrays on a device, each buffer counted once.

For checking a layout's promise (under FSDP each device holds its share of
the state, not a whole copy) and finding what holds memory: `live_bytes`
reads `jax.live_arrays()`, so it sees every array any Python object still
references, the user's own included. Reading a shard through `.data` makes a
second array over the same buffer; those are counted once.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import jax


@dataclass(frozen=True)
class LiveBytes:
    """Live arrays on one device.

    Attributes:
        total: bytes of every live buffer on the device, each counted once.
        whole: shapes of arrays the device holds entirely: on this device
            alone, or replicated over several (one copy each).
    """

    total: int
    whole: list


def live_bytes(device: jax.Device | None = None) -> LiveBytes:
    """The live arrays on `device` (default: the first device), after a garbage collection."""
    gc.collect()
    device = device or jax.devices()[0]
    arrays = [a for a in jax.live_arrays() if not a.is_deleted()]
    buffers: dict[int, int] = {}
    whole = []
    for array in arrays:
        if len(array.sharding.device_set) > 1:
            for shard in array.addressable_shards:
                if shard.device == device:
                    pointer = shard.data.unsafe_buffer_pointer()
                    if pointer not in buffers and shard.data.size == array.size:
                        whole.append(array.shape)
                    buffers[pointer] = shard.data.nbytes
    for array in arrays:
        if array.sharding.device_set == {device}:
            pointer = array.unsafe_buffer_pointer()
            if pointer not in buffers:
                buffers[pointer] = array.nbytes
                whole.append(array.shape)
    return LiveBytes(sum(buffers.values()), whole)
