"""Bug: parallelize recomputes each block's attention scale from the LOCAL head count (heads // world, as a tensor-parallel code path does) although no head is split.

Report: "the multi-GPU loss is off from the first step on every rank; the single-GPU run is fine".
Twin: the scale stays 1/sqrt(head_dim) with head_dim = dim // heads.
"""

import types

import torch.nn.functional as F
from _base import HEALTHY, WORLD, loss_fn, make_batch, shard_batch  # noqa: F401
from _base import build_model as _build
from torch.distributed.fsdp import fully_shard


def _forward(self, x):
    b, s, d = x.shape
    q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                         scale=self.attn_scale)
    x = x + self.proj(out.transpose(1, 2).reshape(b, s, d))
    return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


def build_model():
    model = _build()
    for layer in model.layers:
        layer.attn_scale = (layer.qkv.in_features // layer.heads) ** -0.5
        layer.forward = types.MethodType(_forward, layer)
    return model


def parallelize(model, mesh):
    for layer in model.layers:
        if not HEALTHY:
            local_heads = max(1, layer.heads // WORLD)
            layer.attn_scale = (layer.qkv.in_features // local_heads) ** -0.5  # the bug: head_dim from local heads
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
