"""tinyllm's model library: the GPT, its KV-cache sampler, and the training stage around it.

Example:
    >>> from flax import nnx
    >>> from model import GPT, ModelConfig, generate_all
    >>> model = GPT(ModelConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32),
    ...             rngs=nnx.Rngs(0))
    >>> generate_all(model, [1, 2, 3], max_new_tokens=4, temperature=0).shape
    (1, 4)
"""

# `generate` (the function) stays in model.generate: exporting it would shadow the module.
from model.config import ModelConfig
from model.generate import PAD_ID, generate_all
from model.gpt import GPT, KVCache, count_params, flops_per_token
from model.sampling import sample_logits

__all__ = [
    "GPT",
    "PAD_ID",
    "KVCache",
    "ModelConfig",
    "count_params",
    "flops_per_token",
    "generate_all",
    "sample_logits",
]
