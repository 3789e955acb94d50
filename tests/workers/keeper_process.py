"""A snapshot keeper in a process of its own, as a Ray node's keeper actor is: a test can stop or kill it.

    python keeper_process.py [KEY_HEX [PEER_ADDRESS,...]]

With KEY_HEX it uses that key (the one key of a launch's keepers; default: a fresh one); PEER_ADDRESS are
the other keepers it sends replicas on to (`Keeper.set_peers`, as `ray_keepers` tells them). Prints one
JSON line: the variables that point ranks at it (`Keeper.env`) and its TCP address ("tcp"), then serves
until killed.
"""

import json
import os
import signal
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from meshfit.launch.keeper import Keeper  # noqa: E402


def main():
    key = bytes.fromhex(sys.argv[1]) if len(sys.argv) > 1 else None
    keeper = Keeper(sys.stderr, key=key)
    if len(sys.argv) > 2:
        keeper.set_peers(sys.argv[2].split(","))
    print(json.dumps({**keeper.env(), "tcp": keeper.address}), flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    keeper.close()


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    main()
