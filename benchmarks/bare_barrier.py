"""The baseline: torchrun + init_process_group("gloo") + barrier, nothing else.

Usage: torchrun --nproc-per-node N benchmarks/bare_barrier.py (the time-to-verdict benchmarks
time it beside distdiag's check). It takes no options: anything it is given prints this.
"""

import os
import sys

if __name__ == "__main__" and (sys.argv[1:] or "RANK" not in os.environ):
    print(__doc__.strip())
    sys.exit(0 if sys.argv[1:] in (["-h"], ["--help"]) else 2)

import torch.distributed as dist  # noqa: E402  (after the usage check: --help needs no torch)

dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
