"""accelerate (CPU/gloo DDP), 4 ranks: each rank reads its own shard with its own DataLoader
(not passed through accelerator.prepare, so no even_batches), and rank 0's shard is one batch short.

Fault (--mode fault): ranks 1-3 get 10 batches per epoch, rank 0 gets 9 (its shard file is
short). Only the model and optimizer are prepared (DDP). After rank 0's 9th batch it leaves the
epoch and calls accelerator.gather() for the epoch's loss sum (then wait_for_everyone), while
ranks 1-3 run their 10th batch and wait in DDP's gradient all_reduce.

Ground truth: culprit rank 0. Expected cause: uneven data - rank 0 ran out of batches
(uneven_data). Ranks 1-3 are stranded.

Healthy twin (--mode healthy): every shard holds 10 batches; must exit 0.
"""
import argparse
import time

import torch
from accelerate import Accelerator

p = argparse.ArgumentParser()
p.add_argument("--mode", default="fault", choices=("fault", "healthy"))
p.add_argument("--short-rank", type=int, default=0)
args = p.parse_args()

acc = Accelerator(cpu=True)
R = acc.process_index
BS = 8
nb = 9 if (args.mode == "fault" and R == args.short_rank) else 10
g = torch.Generator().manual_seed(10 + R)
x = torch.randn(nb * BS, 20, generator=g)
shard = torch.utils.data.TensorDataset(x, (x[:, :4].sum(1) > 0).long())
loader = torch.utils.data.DataLoader(shard, batch_size=BS, shuffle=True, generator=g)
model = torch.nn.Sequential(torch.nn.Linear(20, 40), torch.nn.ReLU(), torch.nn.Linear(40, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
model, opt = acc.prepare(model, opt)
for epoch in range(2):
    total = torch.zeros(1)
    for xb, yb in loader:
        loss = torch.nn.functional.cross_entropy(model(xb), yb)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        total += loss.detach()
    if nb == 9:
        print(f"FAULT_AT {time.time():.3f} rank {R}: shard exhausted after {nb} batches", flush=True)
    tot = acc.gather(total)
    if acc.is_main_process:
        print(f"epoch {epoch} loss sums {tot.tolist()}", flush=True)
    acc.wait_for_everyone()
print(f"DONE rank {R}", flush=True)
acc.end_training()
