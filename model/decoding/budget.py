"""Memory for decoding: refuse, before anything is allocated, a sample count that cannot fit.

>>> from model.network.config import ModelConfig
>>> cfg = ModelConfig(vocab_size=64, block_size=32, n_layer=1, n_head=2, n_embd=32)
>>> check_memory(cfg, num_samples=1, use_cache=True, available=1 << 30)  # fits: no error
"""

from __future__ import annotations

from model.decoding.steps import window_size
from model.network.config import ModelConfig
from model.network.params import sampling_device
from plumbing.errors import UsageError
from plumbing.memory import available_bytes, human_bytes

MEMORY_SHARE = 0.8  # of the memory available, the most a generation may plan to use


def decode_bytes_per_sample(cfg: ModelConfig, use_cache: bool) -> int:
    """A generous estimate of the memory one sample of a batch needs while decoding.

    Counted: the KV cache (twice: a step may hold the old and the new copy; a serving batch
    keeps a copy of the slots its chunks attend over beside its cache), the context
    buffer, the logits and the sampling filters' work arrays over the vocabulary, and the
    activations of a refill (cached) or of a full forward (uncached: attention scores too).
    """
    s, d, h, v = cfg.block_size, cfg.n_embd, cfg.n_head, cfg.vocab_size
    a = cfg.attn_width  # queries, keys and values: n_head * head_dim each
    item = 2 if cfg.dtype == "bfloat16" else 4
    hidden = max(cfg.mlp_width, cfg.expert_width * max(cfg.moe_top_k, 1))
    total = 8 * s + 8 * v * 4  # context buffers; logits, sort, softmax, cumsum, scatter
    if use_cache:
        total += 2 * (2 * cfg.n_layer * s * a * item)  # k and v per layer, two copies
        w = window_size(s)
        total += w * (3 * a + hidden + 2 * d) * 4 + 2 * h * w * s * 4  # one refill's work
    else:
        total += s * (3 * a + hidden + 2 * d) * 4 + 2 * h * s * s * 4  # full forward
    return total


def check_memory(
    cfg: ModelConfig, num_samples: int, use_cache: bool, available: int | None = None
) -> None:
    """Raise UsageError (one line) when num_samples would not fit in memory."""
    if available is None:
        available = available_bytes(sampling_device())
    if available is None:  # cannot be told: do not refuse
        return
    per_sample = decode_bytes_per_sample(cfg, use_cache)
    budget = int(available * MEMORY_SHARE)
    need = num_samples * per_sample
    if need > budget:
        raise UsageError(
            f"num_samples={num_samples} needs about {human_bytes(need)} for the KV caches and "
            f"logits, more than the {human_bytes(available)} of memory available: "
            f"use at most {max(budget // per_sample, 0)} samples at once"
        )
