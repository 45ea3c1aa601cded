"""No torch: prints torchrun's restart variables; argv[1] picks when rank 1 fails.

fail-once    rank 1 exits with code 7 on the first attempt (TORCHELASTIC_RESTART_COUNT=0),
             the others sleep until stopped; on a restart every rank exits 0
fail-always  rank 1 exits with code 7 on every attempt
"""

import json
import os
import sys
import time

mode, rank = sys.argv[1], os.environ["RANK"]
count = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
print(json.dumps({"count": count, "max": int(os.environ["TORCHELASTIC_MAX_RESTARTS"]),
                  "port": os.environ["MASTER_PORT"]}), flush=True)
failing = mode == "fail-always" or count == 0
if failing and rank == "1":
    time.sleep(0.3)  # let the others print first
    sys.exit(7)
if failing:
    time.sleep(60)
