"""Bug: expert capacity computed per rank (16 + rank): all_to_all split sizes disagree between ranks."""

import moe_healthy
from moe_healthy import loss_fn, make_batch, route, shard_batch  # noqa: F401


def build_model():
    moe_healthy.capacity = lambda rank: 16 + rank  # the bug
    return moe_healthy.build_model()
