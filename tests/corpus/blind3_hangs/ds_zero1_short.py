"""DeepSpeed ZeRO stage 1 (CPU accelerator, gloo), 3 ranks: rank 1 has one batch fewer.

Fault (--mode fault): each rank iterates its own shard; ranks 0 and 2 have 12 micro-batches,
rank 1 has 11. After its loop, rank 1 computes a validation loss and all_reduces it with
deepspeed.comm (then a barrier); ranks 0 and 2 run their 12th step and wait in ZeRO-1's
gradient reduction / parameter all_gather collectives.

Ground truth: culprit rank 1. Expected cause: uneven data - rank 1 ran out of batches
(uneven_data). Ranks 0 and 2 are stranded.

Healthy twin (--mode healthy): 12 batches on every rank; must exit 0.
"""
import argparse
import os
import time

import deepspeed
import deepspeed.comm as ddist
import torch

p = argparse.ArgumentParser()
p.add_argument("--mode", default="fault", choices=("fault", "healthy"))
p.add_argument("--local_rank", type=int, default=-1)
args = p.parse_args()

deepspeed.init_distributed(dist_backend="gloo")
R = int(os.environ["RANK"])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.ReLU(), torch.nn.Linear(48, 48), torch.nn.ReLU(),
                            torch.nn.Linear(48, 3))
cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
       "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
       "zero_optimization": {"stage": 1}, "steps_per_print": 10000}
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
nb = 11 if (args.mode == "fault" and R == 1) else 12
g = torch.Generator().manual_seed(R)
xs = torch.randn(nb, 8, 24, generator=g)
for i in range(nb):
    x = xs[i]
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    loss = torch.nn.functional.cross_entropy(engine(x), y)
    engine.backward(loss)
    engine.step()
    if R == 0 and i % 4 == 0:
        print(f"step {i} loss {loss.item():.4f}", flush=True)
if nb == 11:
    print(f"FAULT_AT {time.time():.3f} rank {R}: data exhausted after {nb} batches", flush=True)
with torch.no_grad():
    xv = torch.randn(16, 24, generator=torch.Generator().manual_seed(99))
    vl = torch.nn.functional.cross_entropy(engine(xv), (xv[:, 0] > 0).long()).reshape(1)
ddist.all_reduce(vl)
ddist.barrier()
if R == 0:
    print(f"val loss {vl.item() / ddist.get_world_size():.4f}", flush=True)
print(f"DONE rank {R}", flush=True)
