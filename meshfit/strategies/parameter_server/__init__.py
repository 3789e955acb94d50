"""Parameter-server training: workers compute gradients, servers hold the state and apply them.

    strategy     ParameterServerStrategy: checks its arguments, picks the engine and its workers
    engines      the train functions: one asynchronous, one synchronous, each given its `Workers`
    threads      LocalWorkers: this host's devices as workers
    coordinator  server rank 0: accepts worker and server processes; RemoteWorkers hands them work
    server       where the server state lives and how gradients are applied to it
    partition    how a state is split over several server processes
    follower     server ranks 1..: replay rank 0's decisions on their part of the state
    worker       a worker process (`python -m meshfit.strategies.parameter_server.worker`)
    transport    authenticated connections and listeners, wire format
    launcher     what `meshfit launch --ps S --workers N` starts on each rank, and its MESHFIT_PS_* variables
    ray_cluster  cluster="ray": importing Ray, joining or starting a cluster
    ray_workers  RayWorkers and RayServers: worker and server actors as the driver drives them
    ray_actors   what the server and worker actors run

`import meshfit` loads none of this; `meshfit.strategies.ParameterServerStrategy`
does, on first use. `ParameterServerStrategy` loads on first use from here too,
so `meshfit launch` reads `launcher` (free of JAX) without the rest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshfit.strategies.parameter_server.strategy import ParameterServerStrategy


def __getattr__(name: str):
    if name == "ParameterServerStrategy":
        from meshfit.strategies.parameter_server.strategy import ParameterServerStrategy

        return ParameterServerStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ParameterServerStrategy"]
