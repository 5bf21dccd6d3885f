"""An example target for the sequence_parallel, moe_routing and checkpoint probes.

    torchrun --nproc-per-node 2 -m distdiag.check --target configs/example_sp_moe_target.py \
        --probes sequence_parallel,moe_routing,checkpoint
    # load an existing checkpoint into this model instead of the round trip:
    torchrun --nproc-per-node 2 -m distdiag.check --target configs/example_sp_moe_target.py \
        --probes checkpoint --checkpoint /path/to/step-1000

Replace the bodies with your own code; every hook is optional (docs/sequence_moe_checkpoint.md).
The model here is distdiag's tiny causal LM, which has a sequence-parallel mode; the router
is a fixed linear top-2 router. Hooks see one rank each; distdiag seeds every RNG
identically before calling build_model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distdiag.workloads.sequence import TinyCausalLM, make_lm_batch, shift_labels, take_positions

VOCAB = 64
HIDDEN = 16  # = probes.moe_routing.hidden_dim, the width of the tokens route() receives


def build_model() -> torch.nn.Module:
    return TinyCausalLM(vocab=VOCAB)


def make_batch(step: int) -> dict[str, torch.Tensor]:
    """Hugging Face convention: input_ids, labels (unshifted, -100 ignored), attention_mask."""
    return make_lm_batch(batch_size=2, seq_len=32, vocab=VOCAB, pad=5, seed=step)


def split_sequence(batch: dict[str, torch.Tensor], rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """This rank's contiguous chunk of the sequence: targets shifted BEFORE the split, global positions."""
    seq = batch["input_ids"].shape[1]
    index = torch.tensor_split(torch.arange(seq), world_size)[rank]
    return take_positions(batch, index)  # input_ids, shift_labels, position_ids, attention_mask


def parallelize_sp(model: torch.nn.Module, mesh) -> torch.nn.Module:
    """Sequence-parallel mode: attention all-gathers keys and values along the sequence dim."""
    model.sp_group = mesh.get_group()
    return model


def loss_fn(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Unsplit batch: the mean token loss. Split batch: this rank's token-loss sum x world / all valid targets."""
    logits = model(batch["input_ids"], batch.get("position_ids"), batch.get("attention_mask"))
    targets = batch["shift_labels"] if "shift_labels" in batch else shift_labels(batch["labels"])
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100, reduction="sum")
    count = (targets != -100).sum().float()
    world = 1
    if "shift_labels" in batch and dist.is_initialized():
        world = dist.get_world_size()
        dist.all_reduce(count)  # the group's valid targets, not this rank's
    return total * world / count.clamp(min=1)  # 0, not 0/0, when nothing is valid


_ROUTER = torch.nn.Linear(HIDDEN, 8, bias=False)
torch.nn.init.normal_(_ROUTER.weight, generator=torch.Generator().manual_seed(0))


def route(tokens: torch.Tensor):
    """Expert indices [num_tokens, k] (and the scores, so near-ties can be measured)."""
    scores = torch.softmax(_ROUTER(tokens.to(_ROUTER.weight.device)), dim=-1)  # tokens come on the rank's device
    return scores.topk(2, dim=-1).indices, scores
