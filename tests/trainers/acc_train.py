"""accelerate (CPU, gloo): a plain loop over the rank's own pre-sharded data, the loss gathered every
step for logging, an evaluation pass (gather_for_metrics) and a checkpoint (main process writes,
after wait_for_everyone) at the end of every epoch. In mode branch the fault rank alone calls
accelerator.wait_for_everyone().
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _faults as F  # noqa: E402

p = F.parser(__doc__)
p.add_argument("--bs", type=int, default=8)
args = F.parse(p)

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402

torch.set_num_threads(1)
inject = F.Injector(args)
accelerator = Accelerator(cpu=True)
n = F.n_batches(args) * args.bs
g = torch.Generator().manual_seed(F.RANK)
x = torch.randn(n, 16, generator=g)
train = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=args.bs)
xv = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
val = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xv, xv.sum(1, keepdim=True).sin()), batch_size=16)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, opt, val = accelerator.prepare(model, opt, val)  # train is the rank's own shard already

step = 0
for epoch in range(args.epochs):
    for i, (xb, yb) in enumerate(train):  # noqa: B007 (i counts the batches, read after the loop)
        inject.compute(step)
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses = accelerator.gather(loss.detach().reshape(1))
        if accelerator.is_main_process and step % 2 == 0:
            inject.slow("log")
            accelerator.print(f"epoch {epoch} step {step} loss {losses.mean().item():.4f}")
        step += 1
        inject.branch(step, accelerator.wait_for_everyone)
    F.short_done(args, i + 1)
    model.eval()
    total = 0.0
    with torch.no_grad():
        for j, (xb, yb) in enumerate(val):
            if j == 0:
                inject.slow("val")
            total += accelerator.gather_for_metrics(torch.nn.functional.mse_loss(model(xb), yb).reshape(1)).sum().item()
    model.train()
    accelerator.print(f"epoch {epoch} val {total:.4f}")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        inject.slow("ckpt")
        accelerator.save(accelerator.unwrap_model(model).state_dict(), f"model-{epoch}.pt")
accelerator.wait_for_everyone()
F.stamp("DONE", f"steps={step}")
accelerator.end_training()
