"""Hand-written 3-stage send/recv pipeline (one stage per rank), gloo: the last stage stalls.

Fault (--mode fault): at step 4 the last stage (rank 2) sleeps 3600 s inside its loss computation
(a stand-in for a hung metric / remote call). Rank 1 waits in recv for rank 2's gradient; rank 0
waits in recv for rank 1's gradient.
Ground-truth culprit: rank 2. Expected cause: rank 2 stalled outside any collective (in its loss
code, time.sleep); ranks 0 and 1 are stranded (rank 0 through rank 1).
Healthy twin (--mode healthy): no sleep; exits 0.

    torchrun --nproc-per-node 3 pipe_last_stall.py --mode fault
"""
import argparse
import time
from datetime import timedelta

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--mode", default="fault", choices=("fault", "healthy"))
p.add_argument("--steps", type=int, default=12)
p.add_argument("--fault-step", type=int, default=4)
p.add_argument("--stall-s", type=float, default=3600)
args = p.parse_args()

dist.init_process_group("gloo", timeout=timedelta(seconds=1800))
RANK, WORLD = dist.get_rank(), dist.get_world_size()
FIRST, LAST = RANK == 0, RANK == WORLD - 1
B, H = 8, 32
torch.manual_seed(RANK)
stage = torch.nn.Sequential(torch.nn.Linear(16 if FIRST else H, H), torch.nn.ReLU()) if not LAST else torch.nn.Linear(H, 1)
opt = torch.optim.SGD(stage.parameters(), lr=0.01)


def compute_loss(out, y, step):
    if args.mode == "fault" and step == args.fault_step:
        print(f"rank {RANK}: stalling in compute_loss at step {step}", flush=True)
        time.sleep(args.stall_s)
    return torch.nn.functional.mse_loss(out, y)


for step in range(args.steps):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(B, 16, generator=g)
    y = x.sum(1, keepdim=True)
    if FIRST:
        inp = x
    else:
        inp = torch.empty(B, H)
        dist.recv(inp, src=RANK - 1)
        inp.requires_grad_()
    out = stage(inp)
    if LAST:
        loss = compute_loss(out, y, step)
        loss.backward()
    else:
        dist.send(out.detach(), dst=RANK + 1)
        grad = torch.empty_like(out)
        dist.recv(grad, src=RANK + 1)
        out.backward(grad)
    if not FIRST:
        dist.send(inp.grad, dst=RANK - 1)
    opt.step()
    opt.zero_grad()
    if LAST and step % 4 == 0:
        print(f"step {step} loss {loss.item():.4f}", flush=True)
dist.destroy_process_group()
if LAST:
    print("done")
