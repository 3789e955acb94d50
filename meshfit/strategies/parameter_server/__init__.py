"""Parameter-server training: workers compute gradients, servers hold the state and apply them.

    strategy     ParameterServerStrategy: checks its arguments, picks the engine and its workers
    engines      the train functions: one asynchronous, one synchronous, each given its `Workers`
    threads      LocalWorkers: this host's devices as workers
    coordinator  server rank 0: accepts worker and server processes; RemoteWorkers hands them work
    server       where the server state lives and how gradients are applied to it
    partition    how a state is split over several server processes
    follower     server ranks 1..: replay rank 0's decisions on their part of the state
    worker       a worker process (`python -m meshfit.strategies.parameter_server.worker`)
    transport    the job's environment, control connections, wire format

`import meshfit` loads none of this; `meshfit.strategies.ParameterServerStrategy`
does, on first use.
"""

from meshfit.strategies.parameter_server.strategy import ParameterServerStrategy

__all__ = ["ParameterServerStrategy"]
