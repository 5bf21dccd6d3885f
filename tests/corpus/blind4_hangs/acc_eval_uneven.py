"""accelerate, 4 ranks: uneven EVALUATION data, each rank with its own (unprepared) eval DataLoader.

Fault (--mode fault): after training, each rank evaluates its own shard of a held-out file through a
DataLoader it builds itself (not passed to accelerator.prepare, so no even_batches padding); rank 3's
shard has 3 batches, ranks 0-2 have 4. Every eval batch calls accelerator.gather_for_metrics, so
ranks 0-2 wait in a 4th gather that rank 3 never joins (rank 3 has left the eval loop and waits in
wait_for_everyone before the save).
Ground-truth culprit: rank 3. Expected cause: uneven data (rank 3 ran out of eval batches).
Healthy twin (--mode healthy): every rank has 4 eval batches; exits 0.

    torchrun --nproc-per-node 4 acc_eval_uneven.py --mode fault
"""
import argparse
import os

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("--mode", default="fault", choices=("fault", "healthy"))
p.add_argument("--short-rank", type=int, default=3)
p.add_argument("--epochs", type=int, default=2)
args = p.parse_args()

acc = Accelerator(cpu=True)
RANK, WORLD = acc.process_index, acc.num_processes
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x = torch.randn(WORLD * 32, 16)
train = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, shuffle=True)
model, opt, train = acc.prepare(model, opt, train)

for _epoch in range(args.epochs):
    model.train()
    for xb, yb in train:
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()

# held-out data, sharded by hand: 16 rows per rank (4 batches of 4), the short rank gets 12
n = 12 if (args.mode == "fault" and RANK == args.short_rank) else 16
g = torch.Generator().manual_seed(100 + RANK)
ex = torch.randn(n, 16, generator=g)
evl = DataLoader(TensorDataset(ex, ex.sum(1, keepdim=True)), batch_size=4)
model.eval()
errs = []
with torch.no_grad():
    for xb, yb in evl:
        err = (model(xb) - yb).pow(2).mean(1)
        errs.append(acc.gather_for_metrics(err))
if n < 16:
    print(f"rank {RANK}: eval loop done after {len(errs)} batches", flush=True)
mse = torch.cat(errs).mean().item()
acc.print(f"eval mse {mse:.4f} over {sum(e.numel() for e in errs)} rows")
acc.wait_for_everyone()
if acc.is_main_process:
    torch.save(acc.unwrap_model(model).state_dict(), os.path.join(os.getcwd(), "model.pt"))
acc.end_training()
acc.print("done")
