"""DDP training where one rank reads its shard from a slow network mount (a straggler, not a hang).

Each step every rank fetches its next batch from "storage" and runs a DDP step. On rank 2 the
fetch takes 4 s per batch (a slow NFS mount), so ranks 0 and 1 wait about 4 s in every
gradient all_reduce. The job runs 5 steps and finishes.

This case has no hang: with ``distdiag watch --timeout-s 10`` the right outcome for
``--mode fault`` (the default, the slow reader) is exit code 0 and NO hang report, because no
rank waits anywhere near 10 s.

Ground-truth culprit: none (rank 2 is a straggler, 4 s per step, below the 10 s timeout).
Expected cause: none; the job completes (exit 0, no report).
Healthy twin (``--mode healthy``): no slow fetch; exit 0.

Run: torchrun --nproc-per-node 3 ddp_slow_reader_ok.py [--mode fault|healthy]
"""

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


class ShardReader:
    def __init__(self, rank, mode, delay_s=4.0):
        self.rank, self.g = rank, torch.Generator().manual_seed(rank)
        self.delay_s = delay_s if (mode == "fault" and rank == 2) else 0.0

    def fetch(self, step):
        if self.delay_s:
            print(f"SLOW_AT {time.time():.3f} rank {self.rank}: slow fetch of batch {step} ({self.delay_s:.0f} s)", flush=True)
            time.sleep(self.delay_s)  # stands in for a read from an overloaded NFS mount
        x = torch.randn(64, 3, 16, 16, generator=self.g)
        y = torch.randint(0, 10, (64,), generator=self.g)
        return x, y


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["fault", "healthy"], default="fault")
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                        nn.Flatten(), nn.Linear(32, 10))
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reader = ShardReader(rank, args.mode)

    for step in range(args.steps):
        t0 = time.time()
        x, y = reader.fetch(step)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f} ({time.time() - t0:.1f} s)", flush=True)

    dist.barrier()
    if rank == 0:
        print("done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
