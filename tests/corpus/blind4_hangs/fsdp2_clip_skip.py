"""Plain torch FSDP2 (fully_shard) loop, 3 ranks: rank 1 skips clip_grad_norm_ at step 5.

Fault (--mode fault): the loop clips gradients with torch.nn.utils.clip_grad_norm_ before every
optimizer step; under FSDP2 the grads are sharded DTensors, so computing the total norm all_reduces
across the 3 ranks. A rank-local branch ("skip clipping when this rank's loss is already small",
which at step 5 holds on rank 1 only, forced here) makes rank 1 skip the clip at step 5: it steps,
and goes on to step 6's forward (FSDP all_gather) while ranks 0 and 2 wait in the norm's all_reduce.
Ground-truth culprit: rank 1. Expected cause: rank 1 skipped a collective the others issue
(rank-dependent branch / desync), NOT uneven data; ranks 0 and 2 are stranded.
Healthy twin (--mode healthy): every rank clips every step; exits 0.

    torchrun --nproc-per-node 3 fsdp2_clip_skip.py --mode fault
"""
import argparse
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

p = argparse.ArgumentParser()
p.add_argument("--mode", default="fault", choices=("fault", "healthy"))
p.add_argument("--steps", type=int, default=16)
p.add_argument("--fault-step", type=int, default=5)
p.add_argument("--skip-rank", type=int, default=1)
args = p.parse_args()

dist.init_process_group("gloo", timeout=timedelta(seconds=1800))
RANK, WORLD = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(16, 48), torch.nn.ReLU(), torch.nn.Linear(48, 48), torch.nn.ReLU(), torch.nn.Linear(48, 1)
)
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

for step in range(args.steps):
    g = torch.Generator().manual_seed(step * WORLD + RANK)
    x = torch.randn(8, 16, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
    loss.backward()
    small = loss.item() < 1e-3 or (args.mode == "fault" and RANK == args.skip_rank and step == args.fault_step)
    if not small:  # rank-local decision: the bug
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    else:
        print(f"rank {RANK}: step {step}: loss small, skipping clip", flush=True)
    opt.step()
    opt.zero_grad()
    if RANK == 0 and step % 4 == 0:
        print(f"step {step} loss {loss.item():.4f}", flush=True)
dist.destroy_process_group()
if RANK == 0:
    print("done")
