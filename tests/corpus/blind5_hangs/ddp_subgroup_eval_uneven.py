"""Two model variants trained side by side in one job, one data-parallel group each.

A small sweep packed into a single 4-rank job: ranks [0, 1] train variant A (width 64) and
ranks [2, 3] train variant B (width 128). Each variant is a DDP model over its own
process group (``dist.new_group``). After training, each group evaluates its variant on its
own validation shards, all_reducing per-batch loss/accuracy sums inside the group; then all
4 ranks all_reduce the two final scores over the WORLD group to pick the winner.

Fault (``--mode fault``, the default): rank 3's validation shard has 40 rows instead of 64,
so with batch size 16 rank 3 runs 3 eval batches while its group peer rank 2 runs 4. Rank 3
leaves the eval loop early and enters the world all_reduce (with ranks 0 and 1, who finished
evaluating); rank 2 waits forever in its 4th group all_reduce on group [2, 3].

Ground-truth culprit: rank 3 (the short rank of group [2, 3]).
Expected cause: uneven data inside the subgroup (rank 3's eval loader is shorter); rank 2 is
only the victim waiting in the group collective.
Healthy twin (``--mode healthy``): all shards have 64 rows; the job exits 0.

Run: torchrun --nproc-per-node 4 ddp_subgroup_eval_uneven.py [--mode fault|healthy]
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

IN_DIM, NUM_CLASSES = 24, 5
VARIANTS = {0: {"name": "A", "width": 64, "ranks": [0, 1]}, 1: {"name": "B", "width": 128, "ranks": [2, 3]}}


def toy_task(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, IN_DIM, generator=g)
    w = torch.randn(IN_DIM, NUM_CLASSES, generator=torch.Generator().manual_seed(7))
    return TensorDataset(x, (x @ w).argmax(1))


def eval_shard(rank, mode):
    rows = 64
    if mode == "fault" and rank == 3:
        rows = 40  # the eval shard for rank 3 was cut short by a truncated upload
    return toy_task(rows, seed=500 + rank)


def build_model(width):
    return nn.Sequential(nn.Linear(IN_DIM, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, NUM_CLASSES))


@torch.no_grad()
def evaluate(model, loader, group, rank):
    model.eval()
    totals = torch.zeros(3)  # loss sum, correct, count
    for i, (x, y) in enumerate(loader):
        logits = model(x)
        batch = torch.tensor([F.cross_entropy(logits, y, reduction="sum").item(),
                              (logits.argmax(1) == y).sum().item(), float(len(y))])
        dist.all_reduce(batch, group=group)  # running group metrics for the log
        totals += batch
        if dist.get_rank(group) == 0:
            print(f"  [group of rank {rank}] eval batch {i}: running acc {totals[1] / totals[2]:.3f}", flush=True)
    if i + 1 < 4:
        print(f"FAULT_AT {time.time():.3f} rank {rank}: eval loader exhausted after {i + 1} batches (peer has 4)", flush=True)
    model.train()
    return (totals[1] / totals[2]).item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["fault", "healthy"], default="fault")
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4, "this sweep layout needs 4 ranks"
    # every rank must create every group, in the same order
    groups = {vid: dist.new_group(v["ranks"]) for vid, v in VARIANTS.items()}
    my_vid = 0 if rank in VARIANTS[0]["ranks"] else 1
    my_group = groups[my_vid]
    cfg = VARIANTS[my_vid]

    torch.manual_seed(my_vid)
    model = DDP(build_model(cfg["width"]), process_group=my_group)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    train = toy_task(512, seed=my_vid)
    sampler = DistributedSampler(train, num_replicas=2, rank=dist.get_rank(my_group), seed=my_vid)
    loader = DataLoader(train, batch_size=32, sampler=sampler)

    step = 0
    while step < args.steps:
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if dist.get_rank(my_group) == 0:
                print(f"variant {cfg['name']} step {step} loss {loss.item():.4f}", flush=True)
            step += 1
            if step >= args.steps:
                break

    acc = evaluate(model, DataLoader(eval_shard(rank, args.mode), batch_size=16), my_group, rank)

    scores = torch.zeros(len(VARIANTS))
    if dist.get_rank(my_group) == 0:
        scores[my_vid] = acc
    print(f"rank {rank}: entering the world all_reduce of the sweep scores", flush=True)
    dist.all_reduce(scores)
    if rank == 0:
        best = max(VARIANTS, key=lambda v: scores[v].item())
        print(f"scores {scores.tolist()} -> best variant {VARIANTS[best]['name']}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
