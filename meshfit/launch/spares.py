"""Warm spares: each rank's next process, started and importing while the current start runs.

A job with restarts left gets, beside each running rank, a spare process
(`meshfit.launch.spare_process`) with the environment that rank's next
start will have, which imports JAX, Flax, Optax, Orbax and meshfit and
waits. When the job restarts, the launcher hands each rank's start to its
spare (one line on its stdin: the start's variables and the script) instead
of starting Python anew: the seconds of imports are spent before the
failure, not after it. A spare is used only when its environment differs
from the start's in meshfit's own variables alone (`PER_START`: read when the
job joins, not at import); otherwise (an elastic restart moved the rank to
other devices, a spare that died) the rank is started from scratch, as
without spares.

Spares cost memory (a process with its libraries imported, a few hundred
MiB each) and their imports take CPU time from the running job (seconds per
rank and start), so they are asked for: `meshfit launch --spares`. Where the
CPUs are few (the 2-core test machine) they slow the job they wait beside.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Mapping

#: What a spare may be started without knowing: meshfit's own variables (the coordinator, the exit report, the
#: restart count; read when the job joins) and JAX's coordinator addresses (read by `jax.distributed`).
PER_START = ("MESHFIT_", "JAX_COORDINATOR_")


def usable(command: list[str]) -> bool:
    """Whether a spare can run `command` (a rank's argv after the interpreter): a script or `-m module`."""
    if not command:
        return False
    if command[0] == "-m":
        return len(command) > 1
    return not command[0].startswith("-")


def _same_but_per_start(a: Mapping[str, str], b: Mapping[str, str]) -> bool:
    return all(a.get(key) == b.get(key) for key in set(a) | set(b) if not key.startswith(PER_START))


class Spare:
    """One rank's spare process, started with `env` (the next start's environment, up to `PER_START`)."""

    def __init__(self, env: Mapping[str, str], preexec_fn=None):
        self.env = dict(env)
        self.proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "meshfit.launch.spare_process"],
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            preexec_fn=preexec_fn,
        )

    def take(self, env: Mapping[str, str], command: list[str]) -> subprocess.Popen | None:
        """Hands this spare the start `env` and `command`; its process, now the rank's, or None when it cannot
        be (it died, or `env` differs beyond `PER_START`: the spare is then ended)."""
        if self.proc.poll() is not None or not _same_but_per_start(self.env, env):
            self.close()
            return None
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"env": dict(env), "argv": list(command)}) + "\n")
            self.proc.stdin.close()
        except OSError:  # it died meanwhile
            self.close()
            return None
        return self.proc

    def close(self) -> None:
        """Ends a spare that was not used."""
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()  # it exits at once once its imports are done
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class Spares:
    """The spares of the next start, by rank."""

    def __init__(self):
        self._by_rank: dict[int, Spare] = {}

    def prepare(self, envs: Mapping[int, Mapping[str, str]], preexec_fn=None) -> None:
        """Starts a spare for each rank of `envs` (its next start's environment), ending any left over."""
        self.close()
        self._by_rank = {rank: Spare(env, preexec_fn) for rank, env in envs.items()}

    def take(self, rank: int, env: Mapping[str, str], command: list[str]) -> subprocess.Popen | None:
        """Rank `rank`'s process for this start from its spare, or None (start it from scratch)."""
        spare = self._by_rank.pop(rank, None)
        if spare is None:
            return None
        if not usable(command):
            spare.close()
            return None
        return spare.take(env, command)

    def close(self) -> None:
        """Ends every spare not used."""
        for spare in self._by_rank.values():
            spare.close()
        self._by_rank = {}
