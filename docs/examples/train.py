"""A small training script to try the zero-code wrapper on (`-m distdiag.watch -- train.py`):
DDP on gloo (CPU) or NCCL (GPU), 40 steps, any arguments accepted and ignored.

    torchrun --nproc-per-node 2 -m distdiag.watch --timeout-s 300 -- docs/examples/train.py
"""

import os

import torch
import torch.distributed as dist


def main() -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).to(device)
    model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(40):
        x = torch.randn(16, 8, device=device)
        loss = torch.nn.functional.mse_loss(model(x), torch.sin(x[:, :1]))
        loss.backward()
        opt.step()
        opt.zero_grad()
    if dist.get_rank() == 0:
        print(f"final loss {loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
