"""Bug: on rank 1 a patched forward of layers.1 applies its mlp_norm twice (a merge leftover in a rank-guarded branch).

Report: "rank 1's loss is slightly different from rank 0's on identical data; the 1-GPU run matches rank 0".
Twin: the layer's own forward on every rank.
"""

import types

import torch.nn.functional as F
from _base import HEALTHY, RANK, build_model, loss_fn, make_batch, shard_batch  # noqa: F401
from torch.distributed.fsdp import fully_shard


def _forward_twice(self, x):
    b, s, d = x.shape
    q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    x = x + self.proj(out.transpose(1, 2).reshape(b, s, d))
    return x + self.down(F.gelu(self.up(self.mlp_norm(self.mlp_norm(x)))))  # the bug: mlp_norm twice


def parallelize(model, mesh):
    if not HEALTHY and RANK == 1:
        model.layers[1].forward = types.MethodType(_forward_twice, model.layers[1])
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
