"""Bad input: a global batch of 6 samples, which 4 ranks cannot split."""

import torch

from distdiag.workloads import TinyMLP


def build_model():
    return TinyMLP(classes=4)


def make_batch(step):
    return torch.randn(6, 16)


def loss_fn(model, batch):
    return model(batch).pow(2).mean()
