"""accelerate (CPU/gloo DDP), 4 ranks: accelerator.gather() called only on the main process.

Fault (--mode fault): at step --step, to print a global loss, the loop does
`if accelerator.is_main_process: losses = accelerator.gather(loss)`. Only rank 0 enters the
all_gather; ranks 1-3 go on to the next step and wait in DDP's gradient all_reduce.

Ground truth: culprit rank 0. Expected cause: a rank-dependent collective (only the main
process calls gather) / desync on rank 0 - NOT uneven data (all ranks have the same batches).
Ranks 1-3 are stranded.

--mode healthy: gather on every rank, print on the main process; must exit 0.
"""
import argparse
import time

import torch
from accelerate import Accelerator

p = argparse.ArgumentParser()
p.add_argument("--mode", default="fault", choices=("fault", "healthy"))
p.add_argument("--step", type=int, default=6)
args = p.parse_args()

acc = Accelerator(cpu=True)
x = torch.randn(4 * 12 * 8, 12, generator=torch.Generator().manual_seed(3))
ds = torch.utils.data.TensorDataset(x, x @ torch.linspace(-1, 1, 12).unsqueeze(1))
loader = torch.utils.data.DataLoader(ds, batch_size=8, shuffle=True)
model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.SiLU(), torch.nn.Linear(32, 1))
opt = torch.optim.Adam(model.parameters(), lr=3e-3)
model, opt, loader = acc.prepare(model, opt, loader)
step = 0
for _epoch in range(2):
    for xb, yb in loader:
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        if step % args.step == 0 and step > 0:
            if args.mode == "healthy":
                losses = acc.gather(loss.detach().reshape(1))
                if acc.is_main_process:
                    print(f"step {step} mean loss {losses.mean().item():.4f}", flush=True)
            elif acc.is_main_process:
                print(f"FAULT_AT {time.time():.3f} rank 0: gather only on the main process", flush=True)
                losses = acc.gather(loss.detach().reshape(1))
                print(f"step {step} mean loss {losses.mean().item():.4f}", flush=True)
        step += 1
acc.wait_for_everyone()
print(f"DONE rank {acc.process_index} steps {step}", flush=True)
acc.end_training()
