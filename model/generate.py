"""Autoregressive sampling that streams tokens: a KV-cache decode loop compiled per chunk.

How it runs (use_cache=True):
  1. prefill: one call writes the prompt (all but its last token) into a fresh KV cache. The
     prompt is padded to a bucket length (powers of two, at most block_size) so a new prompt
     length recompiles only when it crosses a bucket; its true length is a traced value.
  2. chunks: one jitted call runs `chunk_size` decode steps in a `lax.scan` (feed the
     pending token at `pos`, sample the next) and returns them; the generator yields them while
     nothing else is compiled: every shape is fixed, the position and the sampling settings
     are traced arrays: one prefill program per bucket, one chunk program (two once a run
     outgrows the context, see 3.).
  3. sliding window: the cache holds block_size positions. When it is full, the step
     re-prefills the last block_size // 2 tokens at positions 0.. (one T = block_size // 2
     call inside the same compiled loop, under `lax.cond`; only chunks in which the host
     knows the cache fills up are compiled with that branch) and carries on. The model thus
     always sees between block_size / 2 and block_size tokens of context, positions stay in
     range for learned embeddings and RoPE alike, and the extra cost is one half-window
     forward per block_size / 2 tokens (amortised: about one extra token-forward per token,
     batched, so far cheaper than re-running the context each step).

use_cache=False is the nanoGPT way, kept for comparison: every step runs the full forward over
the last block_size tokens (cropped), in a fixed [B, block_size] buffer, inside the same
chunked compiled loop, so a benchmark measures the cache and not recompilation or dispatch.

Randomness: step i (the i-th new token) samples with `fold_in(key(seed), i)`, so the same seed
gives the same tokens whatever the chunk size, and with or without the cache (up to float
noise in the logits). Stop token: a sample that emits it keeps emitting PAD_ID (-1) after it;
the generator stops once every sample has stopped, and yields nothing past the last stop.

Chunk size (tokens per compiled call, i.e. streaming granularity), measured with
`scripts/bench_generate.py --nanogpt-size --chunk-sizes 1,4,16,64` (0.8M params, context 64,
500 tokens, cache on, 1 sample, medians of 3, 2-core CPU shared with other jobs, load ~4):
chunk 1: 839 tok/s, 4: 2151, 16: 2892, 64: 3601. Per-call dispatch and the host sync dominate
small chunks; 16 keeps ~80% of the 64-token throughput while text still arrives every ~6 ms,
so it is the default.

Example:
    >>> from flax import nnx
    >>> from model.config import ModelConfig
    >>> from model.gpt import GPT
    >>> model = GPT(ModelConfig(vocab_size=64, block_size=32, n_layer=1, n_head=2, n_embd=32),
    ...             rngs=nnx.Rngs(0))
    >>> out = generate_all(model, [1, 2, 3], max_new_tokens=5, temperature=0.0)
    >>> out.shape
    (1, 5)
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.gpt import GPT
from model.sampling import sample_logits, sampling_params
from tokenizer.errors import UsageError

PAD_ID = -1  # what a stopped sample emits after its stop token
DEFAULT_CHUNK_SIZE = 16
MIN_BUCKET = 8


def generate(
    model: GPT,
    prompt_ids: list[int] | np.ndarray,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    num_samples: int = 1,
    use_cache: bool = True,
    stop_token: int | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Iterator[np.ndarray]:
    """Yield new tokens as int32 arrays [num_samples, n], n <= chunk_size, as they are made.

    A prompt longer than the context is cropped to its last block_size tokens (as nanoGPT).
    Concatenated, the chunks hold max_new_tokens columns, fewer if every sample stopped.
    Bad arguments raise UsageError here, before the first chunk is asked for.
    """
    vocab_size = model.cfg.vocab_size
    prompt = np.asarray(prompt_ids)
    if prompt.ndim != 1 or prompt.size == 0:
        raise UsageError("the prompt is empty: give at least one token")
    if not np.issubdtype(prompt.dtype, np.integer):
        raise UsageError(f"prompt ids must be integers, got dtype {prompt.dtype}")
    if prompt.min() < 0 or prompt.max() >= vocab_size:
        raise UsageError(f"prompt ids must be in 0..{vocab_size - 1} (the model's vocabulary)")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise UsageError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not isinstance(num_samples, int) or num_samples < 1:
        raise UsageError(f"num_samples must be an integer >= 1, got {num_samples!r}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise UsageError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")
    if stop_token is not None and not 0 <= stop_token < vocab_size:
        raise UsageError(f"stop_token must be in 0..{vocab_size - 1}, got {stop_token!r}")
    temperature_, top_k_, top_p_ = sampling_params(temperature, top_k, top_p)
    prompt = prompt.astype(np.int32)[-model.cfg.block_size :]
    settings = {
        "key": jax.random.key(seed),
        "temperature": temperature_,
        "top_k": top_k_,
        "top_p": top_p_,
        "stop": jnp.asarray(-1 if stop_token is None else stop_token, jnp.int32),
    }
    return _stream(
        model, prompt, max_new_tokens, settings, num_samples, use_cache, stop_token, chunk_size
    )


def _stream(
    model, prompt, max_new_tokens, settings, num_samples, use_cache, stop_token, chunk_size
) -> Iterator[np.ndarray]:
    cfg = model.cfg
    graphdef, state = nnx.split(model)
    size, window = cfg.block_size, max(1, cfg.block_size // 2)
    if use_cache:
        carry = _start_cached(graphdef, state, prompt, num_samples, size)
    else:
        carry = _start_uncached(prompt, num_samples, size)

    produced = 0
    pos = len(prompt) - 1  # host copy of carry["pos"] (it advances deterministically)
    while produced < max_new_tokens:
        if use_cache:
            may_slide = pos + chunk_size > size  # some step of this chunk finds the cache full
            for _ in range(chunk_size):
                pos = (window if pos >= size else pos) + 1
            carry, tokens_BxC = _cached_chunk(
                graphdef, state, carry, settings, chunk_size=chunk_size, may_slide=may_slide
            )
        else:
            carry, tokens_BxC = _uncached_chunk(
                graphdef, state, carry, settings, chunk_size=chunk_size
            )
        tokens_BxC = np.asarray(tokens_BxC)  # waits for this chunk: the streaming point
        take = min(chunk_size, max_new_tokens - produced)
        tokens_BxC = tokens_BxC[:, :take]
        if stop_token is not None:
            stopped_BxC = np.cumsum(tokens_BxC == stop_token, axis=1) > 0
            # columns after the one where the last sample stopped carry only padding
            all_done = np.flatnonzero(np.all(stopped_BxC | (tokens_BxC == PAD_ID), axis=0))
            if all_done.size:
                yield tokens_BxC[:, : all_done[0] + 1]
                return
        produced += take
        yield tokens_BxC


def generate_all(model: GPT, prompt_ids: list[int] | np.ndarray, **kwargs) -> np.ndarray:
    """All new tokens at once: [num_samples, n], the chunks of `generate` concatenated."""
    chunks = list(generate(model, prompt_ids, **kwargs))
    return np.concatenate(chunks, axis=1)


def prompt_bucket(n: int, block_size: int) -> int:
    """Padded prefill length for n tokens: the next power of two >= max(n, 8), <= block_size."""
    return min(block_size, max(MIN_BUCKET, 1 << max(n - 1, 0).bit_length()))


# -- the carry: what one chunk hands the next -------------------------------------------------
# cache     KV cache (cached path only)
# ctx_BxS   token ids at positions 0..S-1 (cached: what the cache holds; uncached: the context)
# pos       number of tokens in ctx (the pending token goes to position pos)
# pending_B the last token, sampled (or the prompt's last) but not yet fed to the model
# done_B    whether each sample has emitted the stop token
# step      index of the next new token (for fold_in)


def _start_cached(graphdef, state, prompt: np.ndarray, batch: int, block_size: int) -> dict:
    n = len(prompt)
    padded_T = np.zeros((prompt_bucket(n - 1, block_size),), np.int32)
    padded_T[: n - 1] = prompt[:-1]
    return _prefill(graphdef, state, padded_T, np.int32(n - 1), np.int32(prompt[-1]), batch=batch)


def _start_uncached(prompt: np.ndarray, batch: int, block_size: int) -> dict:
    ctx_S = np.zeros((block_size,), np.int32)
    ctx_S[: len(prompt) - 1] = prompt[:-1]
    return {
        "ctx": jnp.asarray(np.broadcast_to(ctx_S, (batch, block_size))),
        "pos": jnp.int32(len(prompt) - 1),
        "pending": jnp.full((batch,), prompt[-1], jnp.int32),
        "done": jnp.zeros((batch,), bool),
        "step": jnp.int32(0),
    }


@partial(jax.jit, static_argnums=0, static_argnames=("batch",))
def _prefill(graphdef, state, padded_T, n_prefill, last_token, *, batch: int) -> dict:
    """Fresh cache holding the prompt's first n_prefill tokens (padding beyond them is
    written too, but masked by position and overwritten before any query can see it)."""
    model = nnx.merge(graphdef, state)
    block_size = model.cfg.block_size
    tokens_BxT = jnp.broadcast_to(padded_T, (batch, padded_T.shape[0]))
    # Only the cache is returned, so XLA drops the unused logits.
    _, cache = model.decode(tokens_BxT, model.init_cache(batch), 0, last_only=True)
    ctx_BxS = jnp.zeros((batch, block_size), jnp.int32)
    ctx_BxS = jax.lax.dynamic_update_slice(ctx_BxS, tokens_BxT, (0, 0))
    return {
        "cache": cache,
        "ctx": ctx_BxS,
        "pos": n_prefill,
        "pending": jnp.full((batch,), last_token, jnp.int32),
        "done": jnp.zeros((batch,), bool),
        "step": jnp.int32(0),
    }


def _sample_step(logits_BxV: jax.Array, carry: dict, settings: dict) -> tuple[dict, jax.Array]:
    """Sample the next token, update pending/done/step; return (carry, emitted token [B])."""
    key = jax.random.fold_in(settings["key"], carry["step"])
    token_B = sample_logits(
        logits_BxV, key, settings["temperature"], settings["top_k"], settings["top_p"]
    )
    emitted_B = jnp.where(carry["done"], PAD_ID, token_B)
    carry = {
        **carry,
        "pending": token_B,
        "done": carry["done"] | (token_B == settings["stop"]),
        "step": carry["step"] + 1,
    }
    return carry, emitted_B


@partial(jax.jit, static_argnums=0, static_argnames=("chunk_size", "may_slide"), donate_argnums=2)
def _cached_chunk(graphdef, state, carry: dict, settings: dict, *, chunk_size: int, may_slide):
    """chunk_size decode steps in one compiled loop; returns (carry, tokens [B, chunk_size]).

    may_slide=False compiles the plain loop, for chunks the host knows fit in the cache; the
    per-step `lax.cond` of the sliding window costs ~30% of a step on CPU (it copies the
    cache through the branches), so it is only compiled into chunks that need it.
    """
    model = nnx.merge(graphdef, state)
    size = model.cfg.block_size
    window = max(1, size // 2)

    def feed_pending(c):
        logits_Bx1xV, cache = model.decode(c["pending"][:, None], c["cache"], c["pos"])
        ctx = jax.lax.dynamic_update_slice(c["ctx"], c["pending"][:, None], (0, c["pos"]))
        return logits_Bx1xV[:, 0], cache, ctx, c["pos"] + 1

    def slide_window(c):
        # Cache full: restart from the last `window` tokens (pending included) at position 0.
        recent_BxW = jnp.concatenate([c["ctx"][:, size - window + 1 :], c["pending"][:, None]], 1)
        logits_Bx1xV, cache = model.decode(recent_BxW, c["cache"], 0, last_only=True)
        ctx = jax.lax.dynamic_update_slice(jnp.zeros_like(c["ctx"]), recent_BxW, (0, 0))
        return logits_Bx1xV[:, 0], cache, ctx, jnp.int32(window)

    def step(c, _):
        if may_slide:
            logits_BxV, cache, ctx, pos = jax.lax.cond(
                c["pos"] < size, feed_pending, slide_window, c
            )
        else:
            logits_BxV, cache, ctx, pos = feed_pending(c)
        return _sample_step(logits_BxV, {**c, "cache": cache, "ctx": ctx, "pos": pos}, settings)

    carry, tokens_CxB = jax.lax.scan(step, carry, None, length=chunk_size)
    return carry, tokens_CxB.T


@partial(jax.jit, static_argnums=0, static_argnames=("chunk_size",), donate_argnums=2)
def _uncached_chunk(graphdef, state, carry: dict, settings: dict, *, chunk_size: int):
    """nanoGPT-style steps: append, crop to the last block_size tokens, full forward."""
    model = nnx.merge(graphdef, state)
    size = model.cfg.block_size

    def step(c, _):
        full = c["pos"] >= size
        ctx = jnp.where(full, jnp.roll(c["ctx"], -1, axis=1), c["ctx"])  # crop the oldest
        pos = jnp.minimum(c["pos"], size - 1)
        ctx = jax.lax.dynamic_update_slice(ctx, c["pending"][:, None], (0, pos))
        x_BxSxD = model.hidden_states(ctx)  # positions after pos see only padding: causal
        x_Bx1xD = jax.lax.dynamic_slice_in_dim(x_BxSxD, pos, 1, axis=1)
        logits_BxV = model.unembed(x_Bx1xD)[:, 0]
        return _sample_step(logits_BxV, {**c, "ctx": ctx, "pos": pos + 1}, settings)

    carry, tokens_CxB = jax.lax.scan(step, carry, None, length=chunk_size)
    return carry, tokens_CxB.T
