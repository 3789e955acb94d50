"""Worker for launch tests: rank 1 exits with the given status; the others sleep."""

import os
import sys
import time

rank = int(os.environ["MESHFIT_PROCESS_ID"])
print(
    f"rank {rank} of {os.environ['MESHFIT_NUM_PROCESSES']} at {os.environ['MESHFIT_COORDINATOR_ADDRESS']} "
    f"xla={os.environ.get('XLA_FLAGS', '')} gpus={os.environ.get('CUDA_VISIBLE_DEVICES', '-')}",
    flush=True,
)
if rank == 1:
    time.sleep(1.5)  # let the others print first (they import nothing heavy: well under a second)
    sys.exit(int(sys.argv[1]))
time.sleep(120)
