"""Worker for elastic-launch tests: a process on any of the GPU sets `BAD` (CUDA_VISIBLE_DEVICES) exits with
status 3 at once, as a rank on a lost device would; in the first start it does so after a second, the others
then sleep until stopped; in a restart the others exit 0 after a second.

    python bad_slot.py BAD...     e.g. 2,3 4,5
"""

import os
import sys
import time

rank, restart = int(os.environ["MESHFIT_PROCESS_ID"]), int(os.environ["MESHFIT_RESTART_COUNT"])
gpus = os.environ.get("CUDA_VISIBLE_DEVICES", "-")
print(f"start {restart}: rank {rank} of {os.environ['MESHFIT_NUM_PROCESSES']} gpus={gpus}", flush=True)
if gpus in sys.argv[1:]:
    if restart == 0:
        time.sleep(1.0)
    sys.exit(3)
time.sleep(1.0 if restart else 120)
