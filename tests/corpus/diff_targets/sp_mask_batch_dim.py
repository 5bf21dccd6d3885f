"""Bug: the SP attention gathers the attention mask along the batch dim, then reshapes it back.

Keys and values are gathered along the sequence (right); the mask's shards are concatenated
along dim 0 and reshaped to [batch, seq]: the shape is kept, but each sample's padding lands
on other samples and positions. Twin: the mask gathered along the sequence like the keys.
"""

import torch
import torch.distributed as dist
from _sp_base import build_model as healthy_build
from _sp_base import loss_fn, make_batch, split_sequence  # noqa: F401
from _twin import HEALTHY

from distdiag.workloads.sequence import parallelize_tiny_lm


def _gather_batch_dim_then_reshape(mask, group):
    parts = [torch.empty_like(mask) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mask.contiguous(), group=group)
    return torch.cat(parts, dim=0).reshape(mask.shape[0], -1)  # the bug: batch dim, shape kept


class _MaskGatheredAlongBatch(torch.nn.Module):
    """Wraps the model: hands it the mask already 'gathered' (wrongly) and keeps it from gathering it again."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, position_ids=None, attention_mask=None):
        if attention_mask is None or HEALTHY:
            return self.inner(input_ids, position_ids, attention_mask)
        full = _gather_batch_dim_then_reshape(attention_mask, self.inner.sp_group)
        rank, width = dist.get_rank(self.inner.sp_group), input_ids.shape[1]
        # What the model gathers is this rank's slice of the wrong mask; the model gathers it back whole.
        return self.inner(input_ids, position_ids, full[:, rank * width:(rank + 1) * width])


def build_model():
    return healthy_build()


def parallelize_sp(model, mesh):
    return _MaskGatheredAlongBatch(parallelize_tiny_lm(model, mesh))
