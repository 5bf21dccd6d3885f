"""Healthy sequence-parallel target: the tiny LM, the built-in contiguous split, a valid-token-weighted loss."""

from distdiag.workloads.sequence import TinyCausalLM, contiguous_split, make_lm_batch, parallelize_tiny_lm, sp_loss


def build_model():
    return TinyCausalLM(vocab=64)


def make_batch(step):
    # One sample: the wrong-dim gather twin stays silent (broadcasts) instead of raising.
    return make_lm_batch(1, 32, 64, pad=5, seed=step)


def loss_fn(model, batch):
    return sp_loss(model, batch)


def split_sequence(batch, rank, world_size):
    return contiguous_split(batch, rank, world_size)


def parallelize_sp(model, mesh):
    return parallelize_tiny_lm(model, mesh)
