"""A user's training script, unchanged, for the zero-code wrapper's torchrun tests.

    torchrun --nproc-per-node 2 -m distdiag.watch --timeout-s 3 -- tests/faults/watchdog_script.py fault=block
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.faults.watchdog_workers import train  # noqa: E402

if __name__ == "__main__":
    sys.exit(train(sys.argv[1:] + ["nowd=1"]))
