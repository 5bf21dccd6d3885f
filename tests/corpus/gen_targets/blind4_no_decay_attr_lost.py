"""Bug: build_model marks the parameters that must not be decayed (norm weights, biases) with an attribute, `p._no_weight_decay = True`, and build_optimizer puts the marked ones in a group with weight_decay 0. fully_shard replaces every parameter with a new DTensor parameter and the attribute does not come along: on the sharded path nothing is marked, and AdamW decays the norms and biases too.

Report: "since FSDP flattens everything, `p.ndim` is always < 2 ... which means everything will be
weight-decayed" (mlfoundations/open_clip pull request #358: the no-decay rule stops matching once FSDP owns
the parameters); "Applying Weight Decay to certain parameters with FSDP" (pytorch/pytorch issue #101343);
"with FSDP1 and `use_orig_params=false`, a `FlatParameter` can ... prevent correct post-wrap
classification" (verl-project/verl pull request #7215). The same loss of the classification, here through
a per-parameter attribute (Mamba-style `_no_weight_decay`) that FSDP2's new parameters do not carry.
Symptom: "norm weights shrink on 8 GPUs but not on 1; loss and gradients match at step 1".
Twin: build_optimizer classifies by `p.ndim < 2` (a DTensor keeps its global shape), the same groups as the
attribute gives in one process.
"""

import torch
from _base import HEALTHY, loss_fn, make_batch, shard_batch  # noqa: F401
from _base import build_model as _build_model

LR, WEIGHT_DECAY = 0.02, 0.5


def build_model():
    model = _build_model()
    for p in model.parameters():
        if p.dim() < 2:  # norms' weights and biases, and the linears' biases
            p._no_weight_decay = True
    return model


def build_optimizer(params):
    params = list(params)
    if HEALTHY:
        skip = [p for p in params if p.dim() < 2]
    else:
        skip = [p for p in params if getattr(p, "_no_weight_decay", False)]  # the bug: lost after fully_shard
    ids = {id(p) for p in skip}
    decay = [p for p in params if id(p) not in ids]
    return torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                              {"params": skip, "weight_decay": 0.0}], lr=LR)
