"""Plain torch DDP (CPU/gloo), 4 ranks: one rank raises mid-training.

Fault (--mode fault): at step 3, rank 2 raises RuntimeError("corrupt record ...") from its data
decoding, before its forward; ranks 0, 1, 3 enter step 3's DDP gradient all_reduce and are
stranded there (under plain torchrun the agent then tears the job down).

Ground truth: culprit rank 2. Expected cause: rank 2 raised (its exception, RuntimeError
corrupt record). Ranks 0, 1, 3 are stranded, never the lead.

Healthy twin (--mode healthy): no raise; must exit 0.
"""
import argparse
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--mode", default="fault", choices=("fault", "healthy"))
p.add_argument("--steps", type=int, default=12)
args = p.parse_args()

dist.init_process_group("gloo")
R = dist.get_rank()
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4)))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)


def decode(step):
    if args.mode == "fault" and R == 2 and step == 3:
        print(f"FAULT_AT {time.time():.3f} rank {R}: raising", flush=True)
        raise RuntimeError(f"corrupt record at offset {step * 4096} in shard-{R:05d}")
    g = torch.Generator().manual_seed(step * 97 + R)
    x = torch.randn(32, 16, generator=g)
    return x, (x[:, :4] > 0).long().argmax(1)


for step in range(args.steps):
    x, y = decode(step)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    if R == 0 and step % 4 == 0:
        print(f"step {step} loss {loss.item():.4f}", flush=True)
dist.barrier()
print(f"DONE rank {R}", flush=True)
dist.destroy_process_group()
