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
# Exports load on first use, so `model.config` (which every config load needs) and the other
# small modules import without pulling in JAX and Flax.
_EXPORTS = {
    "GPT": "model.gpt",
    "KVCache": "model.gpt",
    "count_params": "model.gpt",
    "flops_per_token": "model.gpt",
    "ModelConfig": "model.config",
    "PAD_ID": "model.generate",
    "generate_all": "model.generate",
    "sample_logits": "model.sampling",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'model' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
