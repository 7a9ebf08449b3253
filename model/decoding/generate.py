"""Autoregressive sampling that streams tokens: a KV-cache decode loop compiled per chunk.

Context policy (the same with and without the cache): the model sees at most block_size
tokens. While the text fits, it sees all of it. When the context is full, it keeps the last
block_size // 2 tokens (the newest one included) at positions 0.. and carries on; the context
grows again to block_size, slides again, and so on. So the model always sees between
block_size / 2 and block_size tokens, and every position stays in range, for learned
embeddings and RoPE alike. A prompt may hold up to block_size tokens; a longer one is refused.

How it runs (use_cache=True), with two compiled programs whose shapes never change:
  1. refill: writes block_size // 2 tokens of the context buffer into the KV cache at a traced
     position. A prompt of n tokens takes one or two refill calls (its first n - 1 tokens; the
     last is fed by the first decode step), and a slide takes one (the kept tokens, moved to
     position 0). Every prompt length and every slide runs this same program.
  2. chunk: up to `chunk_size` decode steps in one `lax.fori_loop` (feed the pending token at
     `pos`, sample the next; the steps' keys and values reach the cache at the chunk's end,
     as in the serving batch's chunk). The number of steps is a traced value, so the first
     chunk can be one token (time to first token), and a chunk can stop exactly where the
     cache fills up: the host knows every position in advance, calls refill there and goes
     on. On GPUs the count is fixed when compiling instead (a traced one costs XLA:GPU a host
     round trip per step): a chunk program and a one-step program, called as many times as a
     shorter chunk needs, its outputs joined on the host (`model.decoding.steps`).
  Each chunk is launched before the one before it is fetched, so the host's work (fetching a
  chunk, the caller's printing) overlaps the device's next chunk, as in the serving engine.
  Both programs are compiled before the first token is returned (the first token needs
  both), so crossing the context later never compiles anything, and neither does a new prompt
  length or new sampling settings. `generate` alone jit-compiles them at their first call
  (on a GPU, the full-chunk program at the first full chunk, after the first token);
  `compile_programs` (model.decoding.programs) compiles them ahead, side by side, and with a
  `ProgramCache` keeps them on disk as executables, so that the next process skips tracing
  and compiling (the CLI).

use_cache=False is the reference (the nanoGPT way, without its crop): every step runs the full
forward over exactly the tokens the cache would hold, in a fixed [B, block_size] buffer, and
slides the same way; one compiled program, chunked the same way, so a benchmark measures the
cache and not recompilation or dispatch. Its logits equal the cached ones up to float
rounding (~1e-6 in float32), so greedy and seeded sampled tokens are the same, unless two
candidates are closer than that rounding (not seen in the tests, possible in principle).

Randomness: step i (the i-th new token) samples with `fold_in(key(seed), i)`, so the same seed
gives the same tokens whatever the chunk size, and with or without the cache. Stop token: a
sample that emits it keeps emitting PAD_ID (-1) after it; the generator stops once every
sample has stopped, and yields nothing past the last stop.

Example:
    >>> from flax import nnx
    >>> from model.network.config import ModelConfig
    >>> from model.network.gpt import GPT
    >>> model = GPT(ModelConfig(vocab_size=64, block_size=32, n_layer=1, n_head=2, n_embd=32),
    ...             rngs=nnx.Rngs(0))
    >>> out = generate_all(model, [1, 2, 3], max_new_tokens=5, temperature=0.0)
    >>> out.shape
    (1, 5)
"""

from __future__ import annotations

from collections.abc import Iterator

import jax
import numpy as np
from flax import nnx

from model.decoding.budget import check_memory
from model.decoding.programs import DEFAULT_CHUNK_SIZE, DecodePrograms, jit_programs
from model.decoding.prompts import check_prompt_length
from model.decoding.sampling_params import SamplingParams
from model.decoding.steps import PAD_ID, chunk_outputs, start_carry, window_size
from model.network.gpt import GPT
from plumbing.errors import UsageError


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
    programs: DecodePrograms | None = None,
) -> Iterator[np.ndarray]:
    """Yield new tokens as int32 arrays [num_samples, n], 1 <= n <= chunk_size, as they are made.

    The first chunk is a single token, so its arrival is the time to first token. Concatenated,
    the chunks hold max_new_tokens columns, fewer if every sample stopped. Bad arguments (a
    prompt longer than the context, more samples than memory holds) raise UsageError here,
    before anything is compiled or allocated. `programs` (from `compile_programs`, for these
    num_samples, use_cache and chunk_size) runs the stream with nothing left to compile;
    without them the programs are jit-compiled at their first call.
    """
    prompt = _checked_prompt(prompt_ids, model.cfg.vocab_size, model.cfg.block_size)
    _check_counts(max_new_tokens=max_new_tokens, num_samples=num_samples, chunk_size=chunk_size)
    if stop_token is not None and not 0 <= stop_token < model.cfg.vocab_size:
        raise UsageError(f"stop_token must be in 0..{model.cfg.vocab_size - 1}, got {stop_token!r}")
    check_memory(model.cfg, num_samples, use_cache)
    params = SamplingParams(temperature, top_k, top_p, seed).checked()
    if programs is None:
        programs = jit_programs(model, use_cache=use_cache, chunk_size=chunk_size)
    elif not programs.serve(num_samples, use_cache, chunk_size):
        raise ValueError(
            f"programs compiled for {programs.num_samples} samples, "
            f"use_cache={programs.use_cache}, chunk_size={programs.chunk_size}: not for "
            f"{num_samples}, {use_cache}, {chunk_size}"
        )
    settings = params.settings(stop_token)
    return _stream(model, programs, prompt, max_new_tokens, settings, num_samples, stop_token)


def _checked_prompt(prompt_ids, vocab_size: int, block_size: int) -> np.ndarray:
    """The prompt as int32 ids, or UsageError: empty, not integers, outside the vocabulary, or
    longer than the context."""
    prompt = np.asarray(prompt_ids)
    if prompt.ndim != 1 or prompt.size == 0:
        raise UsageError("the prompt is empty: give at least one token")
    if not np.issubdtype(prompt.dtype, np.integer):
        raise UsageError(f"prompt ids must be integers, got dtype {prompt.dtype}")
    if prompt.min() < 0 or prompt.max() >= vocab_size:
        raise UsageError(f"prompt ids must be in 0..{vocab_size - 1} (the model's vocabulary)")
    check_prompt_length(len(prompt), block_size)
    return prompt.astype(np.int32)


def _check_counts(**counts: int) -> None:
    """Each count an integer >= 1 (UsageError naming the first that is not)."""
    for name, value in counts.items():
        if not isinstance(value, int) or value < 1:
            raise UsageError(f"{name} must be an integer >= 1, got {value!r}")


def generate_all(model: GPT, prompt_ids: list[int] | np.ndarray, **kwargs) -> np.ndarray:
    """All new tokens at once: [num_samples, n], the chunks of `generate` concatenated."""
    chunks = list(generate(model, prompt_ids, **kwargs))
    return np.concatenate(chunks, axis=1)


def _stream(
    model, programs, prompt, max_new_tokens, settings, num_samples, stop_token
) -> Iterator[np.ndarray]:
    state = nnx.state(model)
    use_cache, chunk_size = programs.use_cache, programs.chunk_size
    size, window = model.cfg.block_size, window_size(model.cfg.block_size)
    carry = start_carry(model, prompt, num_samples, use_cache)
    pos = len(prompt) - 1  # host copy of carry["pos"]: it advances deterministically
    if use_cache:
        carry = refill_pieces(programs.refill, state, carry, shift=0, keep=pos, window=window)

    # Each chunk is launched before the one before it is fetched: the host's work on a chunk
    # (fetching it, and whatever the caller does with it) overlaps the device's next chunk.
    produced, launched = 0, None
    while launched is not None or produced < max_new_tokens:
        ahead = None
        if produced < max_new_tokens:
            steps = min(chunk_size if produced else 1, max_new_tokens - produced)
            if use_cache:
                if pos == size:  # the cache is full: keep the last `window` tokens, pending too
                    keep = window - 1
                    carry = refill_pieces(
                        programs.refill, state, carry, shift=size - keep, keep=keep, window=window
                    )
                    pos = keep
                steps = min(steps, size - pos)
            carry, out = programs.chunk(state, carry, settings, np.int32(steps))
            for _ in range(steps):  # the uncached step slides as the cached host loop does
                pos = (window - 1 if pos == size else pos) + 1
            ahead, produced = (out, steps), produced + steps
        if launched is not None:
            tokens_BxC, finished = _fetched(*launched, stop_token)
            yield tokens_BxC
            if finished:
                return
        launched = ahead


def _fetched(out, steps: int, stop_token: int | None) -> tuple[np.ndarray, bool]:
    """A launched chunk's tokens on the host (waiting for it: the stream point), [B, steps],
    and whether every sample has stopped: then cut after the column where the last stopped."""
    tokens_BxC = chunk_outputs(out)[:, :steps]
    if stop_token is None:
        return tokens_BxC, False
    stopped_BxC = np.cumsum(tokens_BxC == stop_token, axis=1) > 0
    # columns after the one where the last sample stopped carry only padding
    all_done = np.flatnonzero(np.all(stopped_BxC | (tokens_BxC == PAD_ID), axis=0))
    if all_done.size:
        return tokens_BxC[:, : all_done[0] + 1], True
    return tokens_BxC, False


def refill_pieces(refill, state, carry, *, shift: int, keep: int, window: int) -> dict:
    """Move ctx[shift:shift + keep] to positions 0..keep-1 and write them into the cache, in
    pieces of `window` tokens (at most two: keep < block_size); pos becomes keep. A prompt
    (shift 0, keep = its length - 1) and a slide (shift = block_size - keep) alike."""

    def run(carry, shift, start, keep, width):
        return refill(state, carry, shift, start, keep), None

    return prefill_pieces(run, carry, shift=shift, keep=keep, widths=(window,))[0]


def prefill_pieces(run, carry, *, shift: int, keep: int, widths, start: int = 0):
    """`refill_pieces` for any piece widths, from position `start` on (the cache already holds
    the context before it: a reused prefix). Each piece is the narrowest of `widths` that holds
    the rest of the context, else the widest, placed so that it ends within the context.
    `run(carry, shift, start, keep, width) -> (carry, scores or None)` runs one piece (the
    `refill` program). Returns (carry, scores): with scores, host arrays [B, keep - start, ...]
    for positions start..keep-1 (`token_scores` of the token after each), else None."""
    size = carry["ctx"].shape[1]
    parts, first = [], True
    while first or start < keep:
        width = next((w for w in sorted(widths) if w >= keep - start), max(widths))
        at = min(start, size - width)
        carry, scores = run(
            carry, np.int32(shift if first else 0), np.int32(at), np.int32(keep), width
        )
        if scores is not None:
            lo, hi = start - at, min(at + width, keep) - at
            parts.append(jax.tree.map(lambda x, lo=lo, hi=hi: np.asarray(x)[:, lo:hi], scores))
        start, first = at + width, False
    if not parts:
        return carry, None
    return carry, jax.tree.map(lambda *xs: np.concatenate(xs, axis=1), *parts)
