"""Small built-in models with a loss, for probes that run without a user target.

Each workload is tiny (a few thousand parameters; a step takes milliseconds on one CPU
core) and deterministic given `torch.manual_seed`. The API is deliberately plain:

    from distdiag.workloads import get_workload
    w = get_workload("transformer")          # or "mlp"; sizes: get_workload("mlp", dim=64)
    w = get_workload("transformer", world_size=3)  # sized so that 3 ranks split it evenly
    torch.manual_seed(0); model = w.build_model()
    batch = w.make_batch(step=1)              # the GLOBAL batch of that step, same on every rank
    shard = w.shard_batch(batch, rank, world) # this rank's part (dim 0), annotated
    loss = w.loss_fn(model, shard)            # the loss this rank backpropagates
    w.blocks(model)                           # the repeated blocks (FSDP2 wraps each one)

A workload exposes the same hooks as a user target (see docs/targets.md), so a probe treats
both alike. The models are also usable alone:

- `TinyMLP(dim, hidden, depth, classes)`: `blocks` (nn.ModuleList of Linear+GELU+LayerNorm
  residual blocks) and a `head`; batch: dict `x` (float [B, dim]), `y` (long [B]).
- `TinyTransformer(vocab, dim, heads, layers, seq)`: token `embed`, `layers` (nn.ModuleList
  of pre-norm causal self-attention + MLP blocks), final `norm`, `head`, and a `scale`
  buffer; batch: dict `tokens` (long [B, seq+1]) and `mask` (bool [B, seq], valid target
  tokens; rows hold different numbers of valid tokens on purpose, which is what makes
  per-rank loss normalisation wrong).

A workload is sized for a world size (`world_size`, default 1): what is cut into one part
per rank - the global batch, and dim 0 of every parameter, which FSDP2 shards - is rounded
up to a multiple of it (`fit_world`), so the probes' built-in runs split evenly and compare
exactly at any world size. At 1, 2 and 4 ranks (and 8 for the transformer) the sizes are
the factories' defaults.

Losses are normalised by the GLOBAL number of items (samples or valid tokens): the shard
carries `global_count` and `world_size` (set by `shard_batch`), and the loss is
`sum(per-item loss) * world_size / global_count`, so the average over ranks that FSDP
applies to gradients gives exactly the gradient of the global-batch mean.

Modules: base (the Workload record, the default split), mlp, transformer, moe (a top-k
mixture-of-experts layer), sequence (sequence-parallel splitters and a tiny causal LM).
Imports torch and nothing else of distdiag.
"""

from __future__ import annotations

from collections.abc import Callable

from distdiag.workloads.base import Workload, fit_world, split_batch
from distdiag.workloads.mlp import TinyMLP, mlp_workload
from distdiag.workloads.transformer import TinyTransformer, transformer_workload

__all__ = [
    "WORKLOADS",
    "Workload",
    "TinyMLP",
    "TinyTransformer",
    "fit_world",
    "get_workload",
    "split_batch",
]

WORKLOADS: dict[str, Callable[..., Workload]] = {
    "mlp": mlp_workload,
    "transformer": transformer_workload,
}
"""Workload factories by name; each takes size keywords and returns a Workload."""


def get_workload(name: str, world_size: int = 1, **sizes: int) -> Workload:
    """The named built-in workload (`mlp`, `transformer`) with optional size overrides,
    sized for `world_size` ranks (the sizes ranks split are rounded up to multiples of it)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    return WORKLOADS[name](world_size=world_size, **sizes)
