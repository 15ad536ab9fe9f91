"""Run an unmodified training script, then print this rank's blink_horovod.stats() (for the tests).

    python with_stats.py SCRIPT [ARGS...]
"""

import atexit
import json
import os
import runpy
import sys


def report() -> None:
    import blink_horovod

    rank = os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "?"))
    print(f"STATS {rank} {json.dumps(blink_horovod.stats())}", flush=True)


atexit.register(report)
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
