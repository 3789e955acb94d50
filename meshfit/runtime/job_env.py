"""What `meshfit launch` tells each process it starts, through environment variables.

The launcher sets these and `cluster.initialize` reads them; a strategy that starts processes of its own
kinds names its variables in its launcher module (the parameter server's: `MESHFIT_PS_*`, in
`meshfit/strategies/parameter_server/launcher.py`). This module imports nothing of JAX, so the launcher, a
supervisor that never computes, starts in a fraction of a second instead of the seconds JAX, Flax and Orbax
take to import.
"""

from __future__ import annotations

import secrets

# Joining the jax.distributed job (read by meshfit.runtime.cluster).
ENV_COORDINATOR = "MESHFIT_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "MESHFIT_NUM_PROCESSES"
ENV_PROCESS_ID = "MESHFIT_PROCESS_ID"
ENV_HEARTBEAT = "MESHFIT_HEARTBEAT_TIMEOUT"
ENV_INIT_TIMEOUT = "MESHFIT_INIT_TIMEOUT"

#: The launch's own compilation cache, set beside `JAX_COMPILATION_CACHE_DIR` (read by
#: meshfit.compilation_cache, which treats it as a default of meshfit's, not the user's choice).
ENV_LAUNCH_CACHE = "MESHFIT_LAUNCH_COMPILATION_CACHE"


def new_authkey() -> str:
    """A fresh secret for one start of a job whose ranks' connections need one (`JobLayout.needs_authkey`)."""
    return secrets.token_hex(32)
