"""Bug: on rank 1 a patched forward of layers.0 (a fused-kernel fallback kept behind a per-node flag) adds the residual twice in its MLP branch.

Report: "rank 1's activations grow layer by layer; rank 0 matches the 1-GPU run".
Twin: the layer's own forward on every rank.
"""

import types

import torch.nn.functional as F
from _base import HEALTHY, RANK, build_model, loss_fn, make_batch, shard_batch  # noqa: F401
from torch.distributed.fsdp import fully_shard


def _forward_fallback(self, x):
    b, s, d = x.shape
    q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    h = x + self.proj(out.transpose(1, 2).reshape(b, s, d))
    return h + h + self.down(F.gelu(self.up(self.mlp_norm(h))))  # the bug: the residual added twice


def parallelize(model, mesh):
    if not HEALTHY and RANK == 1:
        model.layers[0].forward = types.MethodType(_forward_fallback, model.layers[0])
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
