"""The healthy sequence-parallel hooks the sp_* corpus targets start from (each replaces one)."""

from distdiag.workloads.sequence import TinyCausalLM, contiguous_split, make_lm_batch, parallelize_tiny_lm, sp_loss


def build_model():
    return TinyCausalLM(vocab=64)


def make_batch(step):
    # Two samples, the last 5 positions of sample 0 padded: a mask that matters, rows to confuse.
    return make_lm_batch(2, 32, 64, pad=5, seed=step)


def loss_fn(model, batch):
    return sp_loss(model, batch)


def split_sequence(batch, rank, world_size):
    return contiguous_split(batch, rank, world_size)


def parallelize_sp(model, mesh):
    return parallelize_tiny_lm(model, mesh)
