"""HF Trainer, 3 ranks: every rank raises the same ValueError in compute_loss at step 4.

Fault (--mode fault): `compute_loss` validates the batch's targets and, at global step 4, finds them
bad on every rank (the same data bug everywhere) and raises
`ValueError("targets out of range at step 4")` on ranks 0, 1 and 2.
Ground-truth culprits: ranks 0, 1, 2 (all). Expected cause: raised (the same ValueError on every rank).
Healthy twin (--mode healthy): no raise; exits 0.

    torchrun --nproc-per-node 3 hf_raise_all.py --mode fault
"""
import argparse

import torch
from transformers import Trainer, TrainingArguments

p = argparse.ArgumentParser()
p.add_argument("--mode", default="fault", choices=("fault", "healthy"))
p.add_argument("--fault-step", type=int, default=4)
p.add_argument("--steps", type=int, default=12)
p.add_argument("--out", default="out")
args = p.parse_args()


class Regressor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def forward(self, x, y=None):
        return {"pred": self.net(x)}


class Rows(torch.utils.data.Dataset):
    def __init__(self, n=256):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 16, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.x[i].sum(0, keepdim=True)}


class CheckedTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if args.mode == "fault" and self.state.global_step == args.fault_step:
            raise ValueError(f"targets out of range at step {self.state.global_step}")
        out = model(x=inputs["x"])
        loss = torch.nn.functional.mse_loss(out["pred"], inputs["y"])
        return (loss, out) if return_outputs else loss


targs = TrainingArguments(
    output_dir=args.out, per_device_train_batch_size=4, max_steps=args.steps, logging_steps=4,
    report_to="none", ddp_backend="gloo", use_cpu=True, save_strategy="no", disable_tqdm=True,
    dataloader_num_workers=0, remove_unused_columns=False, learning_rate=1e-3,
)
trainer = CheckedTrainer(model=Regressor(), args=targs, train_dataset=Rows())
trainer.train()
if trainer.is_world_process_zero():
    print("done", trainer.state.global_step)
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
