"""A healthy DDP loop under the watchdog with no step marks (entry for tests/harness.py)."""

from __future__ import annotations

import time
from datetime import timedelta


def main(argv: list[str]) -> int:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from distdiag import HangWatchdog

    dist.init_process_group("gloo")
    model = DDP(torch.nn.Linear(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with HangWatchdog(timeout=timedelta(seconds=float(argv[0])), dump_dir="hang-report"):
        for _ in range(int(argv[1])):
            opt.zero_grad()
            model(torch.randn(4, 8)).sum().backward()  # DDP's all-reduce runs in C++: untracked
            opt.step()
            time.sleep(0.05)
    dist.destroy_process_group()
    return 0
