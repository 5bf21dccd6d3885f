"""A real architecture nobody here wrote: a tiny randomly-initialised Hugging Face Llama
(2 decoder layers, built from LlamaConfig, no download), FSDP2 per decoder layer + root."""

import torch
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB, SEQ, BATCH = 64, 8, 8


def build_model():
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(config)


def make_batch(step):
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    # Every row has the same number of tokens, so the model's own mean loss is exact here.
    return {"input_ids": ids, "labels": ids.clone()}


def parallelize(model, mesh):
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
