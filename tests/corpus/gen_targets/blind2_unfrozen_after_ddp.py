"""Bug: parallelize builds DistributedDataParallel while the embedding is still frozen (a fine-tuning schedule's first stage), then unfreezes it: DDP registered no reduction for a parameter that did not require grad at construction, so the embedding's gradient stays each rank's own.

Report: "when you unfreeze the parameters via requires_grad=True ... the way DDP works it wouldn't sync
these changes" (Lightning-AI/pytorch-lightning issue #20340, BackboneFinetuning under DDP); "During the
construction of DDP, it will read through all the module's parameters and register the call-back function
... to every single parameter" (pytorch/pytorch issue #12603). Symptom: "after unfreezing the backbone the
ranks' embeddings drift apart; everything else stays in sync".
Twin: the schedule's unfreeze happens before the DDP wrap (DDP then reduces the embedding too).
"""

from _base import HEALTHY, build_model, loss_fn, make_batch, shard_batch  # noqa: F401
from torch.nn.parallel import DistributedDataParallel


def parallelize(model, mesh):
    model.embed.weight.requires_grad_(False)  # stage 1 of the schedule: a frozen embedding
    if HEALTHY:
        model.embed.weight.requires_grad_(True)  # stage 2 (from step 0 here), before the wrap
        return DistributedDataParallel(model)
    wrapped = DistributedDataParallel(model)
    model.embed.weight.requires_grad_(True)  # the bug: stage 2 after the wrap, which never reduces it
    return wrapped
