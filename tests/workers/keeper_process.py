"""A snapshot keeper in a process of its own, as a Ray node's keeper actor is: a test can stop or kill it.

    python keeper_process.py

Prints one JSON line: the variables that point ranks at it (`Keeper.env`) and its TCP address ("tcp"),
then serves until killed.
"""

import json
import os
import signal
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from meshfit.launch.keeper import Keeper  # noqa: E402


def main():
    keeper = Keeper(sys.stderr)
    print(json.dumps({**keeper.env(), "tcp": keeper.address}), flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    keeper.close()


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    main()
