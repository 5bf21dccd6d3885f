"""Bug: loss_fn adds a weight-norm penalty (the sum of each matrix's L2 norm) taken over `p.to_local()`: under FSDP2 that is this rank's shard, so each rank penalises its own slice's norm.

Report: under FSDP2 a parameter is a DTensor and adding its norm to a plain loss raises, so code takes the
local shard (one-covenant/templar pull request #610: "convert DTensors to their local shards before
measuring norms", which then need a sum across ranks); norms and regularisation of sharded parameters:
facebookresearch/fairscale issue #696. Symptom: "the weights end up with other norms on 2 GPUs than on 1".
Twin: the penalty over the whole parameter (`p.full_tensor()`), the same on every rank.
"""

from _base import HEALTHY, build_model, make_batch, shard_batch  # noqa: F401
from _base import loss_fn as _task_loss
from torch.distributed.tensor import DTensor

PENALTY = 0.05


def _whole(p):
    if isinstance(p, DTensor):
        return p.full_tensor() if HEALTHY else p.to_local()  # the bug: this rank's shard only
    return p


def loss_fn(model, batch):
    penalty = sum(_whole(p).norm() for p in model.parameters() if p.dim() > 1)
    return _task_loss(model, batch) + PENALTY * penalty
