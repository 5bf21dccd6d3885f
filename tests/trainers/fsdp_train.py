"""FSDP2 (fully_shard per block, then the root) in a plain loop on gloo/CPU: a small MLP stack, the
rank's own pre-sharded batches, the loss all_reduced every 2 steps for logging, an evaluation
pass (sharded forward) and a torch.distributed.checkpoint save at the end of every epoch.
The cheapest trainer here: torch only.
"""
import os
import sys
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _faults as F  # noqa: E402

p = F.parser(__doc__)
p.add_argument("--bs", type=int, default=8)
args = F.parse(p)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

torch.set_num_threads(1)
inject = F.Injector(args)
dist.init_process_group("gloo", timeout=timedelta(seconds=1800))
torch.manual_seed(0)


class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


model = torch.nn.Sequential(torch.nn.Linear(16, 32), *[Block(32) for _ in range(3)], torch.nn.Linear(32, 1))
for block in list(model)[1:-1]:
    fully_shard(block)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)


class SlowWriter(dcp.FileSystemWriter):
    def write_data(self, plan, planner):
        inject.slow("ckpt")
        return super().write_data(plan, planner)


def batches():
    g = torch.Generator().manual_seed(F.RANK)
    for _ in range(F.n_batches(args)):
        x = torch.randn(args.bs, 16, generator=g)
        yield x, x.sum(1, keepdim=True).sin()


xv = torch.randn(32, 16, generator=torch.Generator().manual_seed(0))
step = 0
for epoch in range(args.epochs):
    for i, (x, y) in enumerate(batches()):  # noqa: B007 (i counts the batches, read after the loop)
        inject.compute(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 2 == 0:
            t = loss.detach().clone()
            dist.all_reduce(t)
            if F.RANK == 0:
                inject.slow("log")
                print(f"epoch {epoch} step {step} loss {t.item() / F.WORLD:.4f}", flush=True)
        step += 1
        inject.branch(step)
    F.short_done(args, i + 1)
    with torch.no_grad():
        inject.slow("val")
        v = torch.nn.functional.mse_loss(model(xv), xv.sum(1, keepdim=True).sin()).reshape(1)
        dist.all_reduce(v)
    if F.RANK == 0:
        print(f"epoch {epoch} val {v.item() / F.WORLD:.4f}", flush=True)
    dcp.save({"model": model.state_dict()}, storage_writer=SlowWriter(f"ckpt/epoch{epoch}"))
F.stamp("DONE", f"steps={step}")
dist.destroy_process_group()
