"""The Ray cluster a `cluster="ray"` parameter server runs on: importing Ray, joining or starting a cluster.

Ray is an optional extra (`pip install "meshfit[ray]"`); only this module and
the ones that import it (`ray_servers`, `ray_workers`) load it, and only when a
strategy asks for `cluster="ray"`. A script that initialized Ray itself
(`ray.init(address=...)`, `RAY_ADDRESS`, a Ray job) keeps its cluster; otherwise
`connect` starts a local one (the embedded default) and shuts it down when the
process exits.
"""

from __future__ import annotations

import atexit
import logging
import os
from typing import Any, NamedTuple

logger = logging.getLogger("meshfit")


def import_ray(needed_by: str = 'ParameterServerStrategy(cluster="ray")'):
    """The `ray` module, or an ImportError that says how to install it (and what `needed_by` it)."""
    try:
        import ray
    except ImportError as error:
        raise ImportError(
            f'{needed_by} needs Ray, which is not installed. Install it with `pip install "meshfit[ray]"`.'
        ) from error
    return ray


def connect(actors: int) -> bool:
    """Joins the Ray cluster this process initialized, or starts one; returns whether it started one.

    As `ray.init()` does: the cluster `RAY_ADDRESS` names, else one already
    running on this machine (`ray start --head`), else a new local one, with a
    logical CPU for each of the job's `actors` at least (a laptop's few cores
    must not leave actors waiting). Started here, it is shut down at exit.
    Logs (logger "meshfit") which cluster it joined and why; a warning when
    that is a cluster found running on this machine, which nothing named.
    """
    ray = import_ray()
    if ray.is_initialized():
        _say_which(ray, "initialized by this process before the strategy", logging.INFO)
        return False
    address = os.environ.get("RAY_ADDRESS") or None
    if address not in (None, "local"):
        ray.init()
        _say_which(ray, f"named by RAY_ADDRESS={address}", logging.INFO)
    else:
        try:
            ray.init(address=address, num_cpus=max(os.cpu_count() or 1, actors))
            _say_which(ray, "started by this process (shut down when it exits)", logging.INFO)
        except ValueError:  # a cluster already runs on this machine: join it with the resources it has
            ray.init()
            _say_which(
                ray,
                "already running on this machine, as ray.init() joins one when RAY_ADDRESS is unset; set "
                "RAY_ADDRESS=local for a new cluster of this process's own, or RAY_ADDRESS=ADDRESS to name one",
                logging.WARNING,
            )
    atexit.register(ray.shutdown)
    return True


def _say_which(ray, how: str, level: int) -> None:
    """Logs the address and live nodes of the Ray cluster this process is connected to, and `how` it came to."""
    nodes = sum(node.get("Alive", False) for node in ray.nodes())
    address = ray.get_runtime_context().gcs_address
    logger.log(
        level,
        'ParameterServerStrategy(cluster="ray") runs on the Ray cluster at %s (%d nodes): %s.',
        address,
        nodes,
        how,
    )


class Placement(NamedTuple):
    """Where an actor runs: its Ray node (id and address) and its process."""

    node_id: str
    address: str
    pid: int

    def __str__(self) -> str:
        return f"node {self.address} ({self.node_id[:12]}), pid {self.pid}"


def here() -> Placement:
    """This actor's placement (called inside an actor)."""
    ray = import_ray()
    return Placement(ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid())


def options(defaults: dict[str, Any], given: dict[str, Any] | None, name: str) -> dict[str, Any]:
    """An actor's `.options()`: meshfit's defaults, then the user's (`worker_options`, `server_options`)."""
    if given is not None and not isinstance(given, dict):
        raise TypeError(
            f"`{name}` must be a dict of Ray actor options (num_cpus, num_gpus, resources, "
            f"scheduling_strategy, ...). Received: {name}={given!r}."
        )
    return {**defaults, **(given or {})}
