"""DDP training that gathers per-rank data-quality stats with all_gather_object every few steps.

Each rank's data pipeline drops corrupt samples (NaN features) and counts them. Every
``--stats-every`` steps every rank sends a stats dict to all others with
``dist.all_gather_object`` so rank 0 can log the global picture.

Fault (``--mode fault``, the default): rank 1's shard contains corrupt samples from step 5 on.
When it first meets one, its pipeline creates the per-reason counter lazily as
``collections.defaultdict(lambda: 0)``; at the next stats gather (step 6) that lambda is in
rank 1's payload, pickling it raises (``Can't pickle local object ... <lambda>``) inside
all_gather_object, and rank 1 dies with the traceback while ranks 0 and 2 wait in the
all_gather_object collective. torchrun then tears the job down.

Ground-truth culprit: rank 1 (it raised).
Expected cause: a Python exception on rank 1 (raised, pickling error in all_gather_object);
the others are only waiting for it.
Healthy twin (``--mode healthy``): no corrupt samples, no defaultdict; exit 0.

Run: torchrun --nproc-per-node 3 ddp_gather_obj_pickle.py [--mode fault|healthy]
"""

import argparse
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

FEAT = 20


class CleaningStream:
    """Yields clean (x, y) batches from this rank's shard and tracks what it dropped."""

    def __init__(self, rank, mode, bs=32):
        self.rank, self.mode, self.bs = rank, mode, bs
        self.g = torch.Generator().manual_seed(rank)
        self.w = torch.randn(FEAT, 1, generator=torch.Generator().manual_seed(99))
        self.dropped = {}  # reason -> count; replaced by a defaultdict on first drop
        self.step = 0

    def next_batch(self):
        self.step += 1
        x = torch.randn(self.bs, FEAT, generator=self.g)
        if self.mode == "fault" and self.rank == 1 and self.step >= 5:
            x[:3, 0] = float("nan")  # a bad parquet chunk on this rank's shard
        bad = torch.isnan(x).any(1)
        if bad.any():
            if not self.dropped:
                self.dropped = defaultdict(lambda: 0)
            self.dropped["nan_feature"] += int(bad.sum())
            x = x[~bad]
        y = x @ self.w + 0.05 * torch.randn(len(x), 1, generator=self.g)
        return x, y


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["fault", "healthy"], default="fault")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--stats-every", type=int, default=3)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(FEAT, 64), nn.SiLU(), nn.Linear(64, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    stream = CleaningStream(rank, args.mode)

    for step in range(1, args.steps + 1):
        x, y = stream.next_batch()
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % args.stats_every == 0:
            stats = {"rank": rank, "step": step, "loss": loss.item(), "batch": len(x), "dropped": stream.dropped}
            if isinstance(stream.dropped, defaultdict):
                print(f"FAULT_AT {time.time():.3f} rank {rank}: all_gather_object payload holds a lambda", flush=True)
            gathered = [None] * world
            dist.all_gather_object(gathered, stats)
            if rank == 0:
                total_drop = sum(sum(s["dropped"].values()) for s in gathered)
                mean_loss = sum(s["loss"] for s in gathered) / world
                print(f"step {step}: mean loss {mean_loss:.4f}, dropped so far {total_drop}", flush=True)

    dist.barrier()
    if rank == 0:
        print("done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
