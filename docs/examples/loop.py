"""Toy stand-ins for the names the loop snippets in these docs leave to you (`model`, `opt`,
`loader`, `train_step`, `save_checkpoint`, `aux`, `router_indices`, `num_experts`), so that each snippet runs
as shown when pasted after this file:

    cat docs/examples/loop.py snippet.py > try.py && torchrun --nproc-per-node 2 try.py

Under torchrun it starts the default process group (gloo) and wraps the model in DDP, as your
script does before its loop. tests/docs runs every snippet of the docs this way.
"""

import atexit
import os
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: F401 - the monitor's snippet uses F.cross_entropy

if "RANK" in os.environ and not dist.is_initialized():
    dist.init_process_group("gloo")
    # as your script should at its end (torch warns when a job ends without it). It does not
    # stop gloo's worker threads: docs/facts.md says why a script's last collective can still
    # abort at exit on a loaded machine, and what prevents it
    atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
torch.manual_seed(0)
VOCAB, num_experts = 16, 4
model = torch.nn.Sequential(
    torch.nn.Embedding(VOCAB, 32), torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32), torch.nn.Linear(32, VOCAB)
)
if dist.is_initialized():
    model = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = [SimpleNamespace(inputs=torch.randint(VOCAB, (4, 8)), labels=torch.randint(VOCAB, (4, 8))) for _ in range(30)]
aux = torch.tensor(0.0)  # an auxiliary loss term (a MoE's load-balancing loss)
router_indices = torch.randint(num_experts, (32,))  # the experts a MoE router chose


def train_step(batch: SimpleNamespace) -> None:
    logits = model(batch.inputs)
    F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten()).backward()  # DDP's all_reduce
    opt.step()
    opt.zero_grad()


def save_checkpoint() -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(model.state_dict(), "checkpoint.pt")
