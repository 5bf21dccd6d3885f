"""Bug: a zigzag (load-balanced) split, but attention assumes the gathered keys are in contiguous order.

The split hands each rank two chunks with their global position ids (right), and keys and
values are all-gathered along the sequence (right); the key positions, though, are taken as
0..S-1 in gather order instead of gathering the shards' position ids, so under the zigzag
order a query sees the wrong causal prefix. Twin: key positions gathered like the keys.
"""

import torch
from _sp_base import loss_fn, make_batch  # noqa: F401
from _twin import HEALTHY

from distdiag.workloads.sequence import TinyCausalLM, _GatherSeq, attention, parallelize_tiny_lm, zigzag_split


class ZigzagLM(TinyCausalLM):
    def forward(self, input_ids, position_ids=None, attention_mask=None):
        if self.sp_group is None or HEALTHY:
            return super().forward(input_ids, position_ids, attention_mask)
        b, s = input_ids.shape
        x = self.embed(input_ids) + self.pos(position_ids)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        k, v = (_GatherSeq.apply(t, 1, self.sp_group) for t in (k, v))
        k_mask = _GatherSeq.apply(attention_mask, 1, self.sp_group) if attention_mask is not None else None
        k_pos = torch.arange(k.shape[1]).expand(b, -1)  # the bug: assumes the gathered keys are in position order

        def split(t):
            return t.reshape(t.shape[0], t.shape[1], self.heads, -1).transpose(1, 2)

        out = attention(split(q), split(k), split(v), position_ids, k_pos, k_mask)
        x = x + self.proj(out.transpose(1, 2).reshape(b, s, -1))
        return self.head(x + self.mlp(x))


def build_model():
    return ZigzagLM(vocab=64)


def split_sequence(batch, rank, world_size):
    return zigzag_split(batch, rank, world_size)


def parallelize_sp(model, mesh):
    return parallelize_tiny_lm(model, mesh)
