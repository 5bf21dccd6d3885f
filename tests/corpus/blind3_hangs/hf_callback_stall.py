"""Hugging Face Trainer (tiny random GPT-2, CPU/gloo DDP), 3 ranks: one rank stalls in a callback.

Fault (default, --sleep 3600): a custom TrainerCallback's on_step_end, on rank 2 only, at global
step 5, blocks in time.sleep(--sleep) (think: a synchronous upload of a sample to a dead
endpoint). Ranks 0 and 1 go on to step 6 and wait in DDP's gradient all_reduce.

Ground truth: culprit rank 2. Expected cause: a stall - rank 2 is outside any collective, its
stack in the callback's on_step_end / time.sleep; NOT uneven data. Ranks 0 and 1 stranded.

Healthy twin (--sleep 6): the callback sleeps 6 s under a 10 s watchdog timeout; must exit 0
with no hang report.
"""
import argparse
import os
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

p = argparse.ArgumentParser()
p.add_argument("--sleep", type=float, default=3600)
p.add_argument("--rank", type=int, default=2)
p.add_argument("--step", type=int, default=5)
p.add_argument("--steps", type=int, default=16)
p.add_argument("--out", default="hf_out")
args = p.parse_args()
RANK = int(os.environ.get("RANK", 0))


class Seqs(torch.utils.data.Dataset):
    def __len__(self):
        return 2048

    def __getitem__(self, i):
        ids = (torch.arange(12) * (i % 5 + 1) + i) % 50
        return {"input_ids": ids, "labels": ids}


class Upload(TrainerCallback):
    def on_step_end(self, a, state, control, **kw):
        if state.global_step == args.step and RANK == args.rank:
            print(f"FAULT_AT {time.time():.3f} rank {RANK}: on_step_end sleeps {args.sleep}s", flush=True)
            time.sleep(args.sleep)


model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=32, n_embd=32, n_layer=2, n_head=2))
targs = TrainingArguments(output_dir=args.out, per_device_train_batch_size=4, max_steps=args.steps, logging_steps=4,
                          report_to=[], ddp_backend="gloo", use_cpu=True, save_strategy="no", disable_tqdm=True,
                          dataloader_num_workers=0, learning_rate=1e-3)
trainer = Trainer(model=model, args=targs, train_dataset=Seqs(), callbacks=[Upload()])
trainer.train()
print(f"DONE rank {RANK} steps {trainer.state.global_step}", flush=True)
