"""An `accelerate` training script, unchanged but for the two opt-in lines marked STEP MARKS (without them a hang
whose ranks all wait where the watchdog cannot see, DDP's all-reduce, is left to torch's timeout), for
`torchrun --nproc-per-node 2 -m distdiag.watch --timeout-s 8 -- accelerate_script.py [sleep_rank=R]`.

A rank sleeps at step 3 when sleep_rank= names it (a hang the wrapper must name)."""

import sys
import time

import torch
from accelerate import Accelerator

from distdiag.integrations import mark_step  # STEP MARKS


def main(argv: list[str]) -> int:
    words = dict(w.split("=", 1) for w in argv)
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.utils.data.TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    for step, (x, y) in enumerate(loader):
        mark_step(step)  # STEP MARKS
        if str(accelerator.process_index) == words.get("sleep_rank") and step == 3:
            time.sleep(120)  # FAULT:sleep
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
    accelerator.wait_for_everyone()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
