"""The GPT itself.

config.py       ModelConfig: the network's hyperparameters (the [model] section)
gpt.py          the decoder: embeddings, blocks, output layer, KV-cache decode
attention.py    causal self-attention (reference, XLA and cuDNN paths)
kv_writes.py    how new keys and values go into the KV cache (decoding, serving chunks)
layers.py       norms and MLPs (GELU, SwiGLU) and the factories blocks use
moe.py          mixture of experts: router, capacity, auxiliary losses
rope.py         rotary position embeddings
activations.py  GELU forms written for speed on XLA:CPU
params.py       the abstract model (shapes without initialising) and parameter names
precision.py    what a matrix product computes in bf16 and float32, on every platform
loss.py         the losses: next-token cross-entropy, and multi-token prediction's
value_embed.py  value embeddings: token-embedding rows mixed into attention's values
"""
