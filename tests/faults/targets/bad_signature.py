"""Bad input: make_batch takes no step argument."""

import torch


def build_model():
    return torch.nn.Linear(4, 4)


def make_batch():
    return torch.randn(8, 4)
