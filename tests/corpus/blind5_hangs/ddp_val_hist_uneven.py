"""DDP classifier with a calibration-histogram validation pass over per-rank validation shards.

Fault (``--mode fault``, the default): every rank reads its own pre-sharded validation file
(here: a seeded synthetic shard). Shard 1 was written with fewer rows (48 vs 64), so with
batch size 16 rank 1 runs 3 validation batches while ranks 0 and 2 run 4. Each validation
batch all_reduces a LARGE tensor (a 512-bin confidence histogram, float32); at the end of the
pass each rank all_reduces a single int64 sample count. After its 3rd batch rank 1 enters the
int64[1] all_reduce while ranks 0 and 2 are in the 4th float32[512] all_reduce: gloo sees the
size/type mismatch and aborts (SIGABRT, collective mismatch) or the job hangs.

Ground-truth culprit: rank 1 (the short rank).
Expected cause: uneven data (rank 1's validation loader is shorter; it left the per-batch
collective loop early).
Healthy twin (``--mode healthy``): every shard has 64 rows; the job exits 0.

Run: torchrun --nproc-per-node 3 ddp_val_hist_uneven.py [--mode fault|healthy]
"""

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

NUM_BINS = 512
NUM_CLASSES = 10
IN_DIM = 32


def make_train_set(n=384, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, IN_DIM, generator=g)
    w = torch.randn(IN_DIM, NUM_CLASSES, generator=g)
    y = (x @ w).argmax(dim=1)
    return TensorDataset(x, y)


def load_val_shard(rank, world_size, mode):
    """Stand-in for torch.load(f"val/shard_{rank:02d}.pt"): one file per rank."""
    rows = {r: 64 for r in range(world_size)}
    if mode == "fault":
        rows[1] = 48  # shard_01.pt was written by a preprocessing job that dropped a chunk
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(rows[rank], IN_DIM, generator=g)
    y = torch.randint(0, NUM_CLASSES, (rows[rank],), generator=g)
    return TensorDataset(x, y)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(IN_DIM, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(),
                                 nn.Linear(128, NUM_CLASSES))

    def forward(self, x):
        return self.net(x)


@torch.no_grad()
def validate(model, loader, rank):
    """Expected calibration error from a global confidence histogram."""
    model.eval()
    conf_hist = torch.zeros(NUM_BINS)
    acc_hist = torch.zeros(NUM_BINS)
    n_seen = torch.zeros(1, dtype=torch.int64)
    for i, (x, y) in enumerate(loader):
        probs = F.softmax(model(x), dim=1)
        conf, pred = probs.max(dim=1)
        bins = (conf * NUM_BINS).long().clamp_(max=NUM_BINS - 1)
        batch_hist = torch.zeros(NUM_BINS).index_add_(0, bins, torch.ones_like(conf))
        batch_acc = torch.zeros(NUM_BINS).index_add_(0, bins, (pred == y).float())
        # global confidence histogram for the reliability plot, reduced per batch for the live log
        dist.all_reduce(batch_hist)
        conf_hist += batch_hist
        acc_hist += batch_acc
        n_seen += x.shape[0]
        if rank == 0:
            print(f"  val batch {i}: global mass in hist {batch_hist.sum().item():.0f}", flush=True)
    print(f"rank {rank}: finished {i + 1} val batches, entering the sample-count all_reduce", flush=True)
    if i + 1 < 4:
        print(f"FAULT_AT {time.time():.3f} rank {rank}: short validation shard, left the batch loop after {i + 1} batches", flush=True)
    dist.all_reduce(n_seen)
    model.train()
    return n_seen.item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["fault", "healthy"], default="fault")
    p.add_argument("--epochs", type=int, default=2)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    model = DDP(MLP())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_set = make_train_set()
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=0)
    train_loader = DataLoader(train_set, batch_size=32, sampler=sampler)
    val_loader = DataLoader(load_val_shard(rank, world, args.mode), batch_size=16)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for step, (x, y) in enumerate(train_loader):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0 and step % 2 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)
        n = validate(model, val_loader, rank)
        if rank == 0:
            print(f"epoch {epoch}: validated on {n} samples", flush=True)

    dist.barrier()
    if rank == 0:
        print("done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
