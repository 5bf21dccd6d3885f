"""The Hugging Face Trainer on a tiny random Llama (built from a config, nothing downloaded), gloo.

Evaluation and checkpoint saves every --every steps, logging every 2 steps. In mode short the
training set is sharded by rank ahead of time (get_train_dataloader returns the rank's own shard)
and the short rank's shard has fewer batches: with num_train_epochs=1 it leaves the loop early.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _faults as F  # noqa: E402

p = F.parser(__doc__)
p.add_argument("--every", type=int, default=8, help="evaluate and save every this many steps")
p.add_argument("--bs", type=int, default=4)
args = F.parse(p)

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

torch.set_num_threads(1)
inject = F.Injector(args)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i * 1000 + F.RANK)
        ids = torch.randint(0, 64, (16,), generator=g)
        return {"input_ids": ids, "labels": ids}


class ShardSampler(torch.utils.data.Sampler):
    """The rank's own shard, in order."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        yield from range(self.n)


class Hooks(TrainerCallback):
    def on_step_end(self, a, state, control, **kw):
        inject.branch(state.global_step)
        if args.mode == "short" and state.global_step == F.n_batches(args):
            F.short_done(args, state.global_step)  # its last step: the Trainer leaves the loop now

    def on_log(self, a, state, control, logs=None, **kw):
        if "loss" in (logs or {}):
            inject.slow("log")


class MyTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if model.training:
            inject.compute(self.state.global_step)
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    def get_train_dataloader(self):
        if args.mode != "short":
            return super().get_train_dataloader()
        n = F.n_batches(args) * args.bs
        return torch.utils.data.DataLoader(Tokens(n), batch_size=args.bs, sampler=ShardSampler(n),
                                           collate_fn=self.data_collator)

    def _save(self, output_dir=None, state_dict=None):
        inject.slow("ckpt")
        return super()._save(output_dir, state_dict)


def metrics(pred):
    inject.slow("val")
    return {"n": float(len(pred.label_ids))}


model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
steps = {} if args.mode == "short" else {"max_steps": args.batches * args.epochs}
targs = TrainingArguments(
    output_dir="out", per_device_train_batch_size=args.bs, per_device_eval_batch_size=8, num_train_epochs=1,
    logging_steps=2, report_to=[], ddp_backend="gloo", use_cpu=True, ddp_timeout=1800, disable_tqdm=True,
    dataloader_num_workers=0, eval_strategy="steps", eval_steps=args.every, save_strategy="steps",
    save_steps=args.every, save_only_model=True, **steps,
)
trainer = MyTrainer(model=model, args=targs, train_dataset=Tokens(4096), eval_dataset=Tokens(32),
                    callbacks=[Hooks()], compute_metrics=metrics)
trainer.train()
F.stamp("DONE", f"steps={trainer.state.global_step}")
