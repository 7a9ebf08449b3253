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
     `pos`, sample the next). The number of steps is a traced value, so the first chunk can be
     one token (time to first token), and a chunk can stop exactly where the cache fills up:
     the host knows every position in advance, calls refill there and goes on.
  Both programs are compiled before the first token is returned (the first token needs
  both), so crossing the context later never compiles anything, and neither does a new prompt
  length or new sampling settings. `generate` alone jit-compiles them at their first call;
  `compile_programs` compiles them ahead, side by side, and with a `ProgramCache` keeps them
  on disk as executables, so that the next process skips tracing and compiling (the CLI).

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

Chunk size (tokens per compiled call, i.e. streaming granularity), measured (with the earlier
fixed-length scan loop, which this loop replaced at the same per-step work) with
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

import dataclasses
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import serialize_executable

from model.config import ModelConfig
from model.gpt import GPT
from model.program_cache import ProgramCache
from model.sampling import check_sampling, sample_logits
from tokenizer.errors import UsageError

PAD_ID = -1  # what a stopped sample emits after its stop token
DEFAULT_CHUNK_SIZE = 16
MEMORY_SHARE = 0.8  # of the memory available, the most a generation may plan to use
JAX_CACHE_HIT = "/jax/compilation_cache/cache_hits"  # jax.monitoring: read from its disk cache


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
    cfg = model.cfg
    vocab_size = cfg.vocab_size
    prompt = np.asarray(prompt_ids)
    if prompt.ndim != 1 or prompt.size == 0:
        raise UsageError("the prompt is empty: give at least one token")
    if not np.issubdtype(prompt.dtype, np.integer):
        raise UsageError(f"prompt ids must be integers, got dtype {prompt.dtype}")
    if prompt.min() < 0 or prompt.max() >= vocab_size:
        raise UsageError(f"prompt ids must be in 0..{vocab_size - 1} (the model's vocabulary)")
    if len(prompt) > cfg.block_size:
        raise UsageError(
            f"the prompt is {len(prompt)} tokens, longer than the model's context of "
            f"{cfg.block_size} tokens: shorten it"
        )
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise UsageError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not isinstance(num_samples, int) or num_samples < 1:
        raise UsageError(f"num_samples must be an integer >= 1, got {num_samples!r}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise UsageError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")
    if stop_token is not None and not 0 <= stop_token < vocab_size:
        raise UsageError(f"stop_token must be in 0..{vocab_size - 1}, got {stop_token!r}")
    check_memory(cfg, num_samples, use_cache)
    check_seed(seed)
    check_sampling(temperature, top_k, top_p)
    settings = _settings(seed, temperature, top_k, top_p, stop_token)
    if programs is None:
        programs = jit_programs(model, use_cache=use_cache, chunk_size=chunk_size)
    elif programs.num_samples not in (None, num_samples) or (
        programs.use_cache,
        programs.chunk_size,
    ) != (use_cache, chunk_size):
        raise ValueError(
            f"programs compiled for {programs.num_samples} samples, "
            f"use_cache={programs.use_cache}, chunk_size={programs.chunk_size}: not for "
            f"{num_samples}, {use_cache}, {chunk_size}"
        )
    return _stream(
        model, programs, prompt.astype(np.int32), max_new_tokens, settings, num_samples, stop_token
    )


def check_seed(seed: int) -> None:
    """Raise UsageError unless seed is an int32, the range the compiled programs take it in."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise UsageError(f"seed must be an integer, got {seed!r}")
    if not -(2**31) <= seed < 2**31:
        raise UsageError(f"seed must be in -2147483648..2147483647, got {seed}")


def generate_all(model: GPT, prompt_ids: list[int] | np.ndarray, **kwargs) -> np.ndarray:
    """All new tokens at once: [num_samples, n], the chunks of `generate` concatenated."""
    chunks = list(generate(model, prompt_ids, **kwargs))
    return np.concatenate(chunks, axis=1)


def window_size(block_size: int) -> int:
    """Tokens kept when the context is full (the newest included): block_size // 2, >= 1."""
    return max(1, block_size // 2)


# -- memory: refuse what cannot fit, before allocating it --------------------------------------


def decode_bytes_per_sample(cfg: ModelConfig, use_cache: bool) -> int:
    """A generous estimate of the memory one sample of a batch needs while decoding.

    Counted: the KV cache (twice: a step may hold the old and the new copy), the context
    buffer, the logits and the sampling filters' work arrays over the vocabulary, and the
    activations of a refill (cached) or of a full forward (uncached: attention scores too).
    """
    s, d, h, v = cfg.block_size, cfg.n_embd, cfg.n_head, cfg.vocab_size
    item = 2 if cfg.dtype == "bfloat16" else 4
    hidden = max(4 * d, cfg.moe_hidden * max(cfg.moe_top_k, 1))
    total = 8 * s + 8 * v * 4  # context buffers; logits, sort, softmax, cumsum, scatter
    if use_cache:
        total += 2 * (2 * cfg.n_layer * s * d * item)  # k and v per layer, old + new copy
        w = window_size(s)
        total += w * (3 * d + hidden + 2 * d) * 4 + 2 * h * w * s * 4  # one refill's work
    else:
        total += s * (3 * d + hidden + 2 * d) * 4 + 2 * h * s * s * 4  # full forward
    return total


def available_memory_bytes() -> int | None:
    """Memory the decode can use: the accelerator's limit, or the host's available memory."""
    stats = getattr(jax.devices()[0], "memory_stats", lambda: None)()
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(
    cfg: ModelConfig, num_samples: int, use_cache: bool, available: int | None = None
) -> None:
    """Raise UsageError (one line) when num_samples would not fit in memory."""
    available = available_memory_bytes() if available is None else available
    if available is None:
        return
    per_sample = decode_bytes_per_sample(cfg, use_cache)
    budget = int(available * MEMORY_SHARE)
    if num_samples * per_sample > budget:
        raise UsageError(
            f"num_samples={num_samples} needs about {_human(num_samples * per_sample)} for the "
            f"KV caches and logits, more than the {_human(available)} of memory available: "
            f"use at most {max(budget // per_sample, 0)} samples at once"
        )


def _human(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "bytes" else f"{n:,.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"  # unreachable


# -- timing: what the CLI prints and the benchmark reports ---------------------------------------


@dataclass
class DecodeClock:
    """Times a stream: time to its first chunk (from `start`), then the decode rate after it.

    Feed it each chunk as it arrives. The first chunk (one token) marks the first token; the
    decode rate counts the tokens of the later chunks (every sample's, stopped ones' padding
    excluded) over the time from the first chunk to the last.

        >>> clock = DecodeClock(start=time.perf_counter())
        >>> clock.tick(np.zeros((1, 1), np.int32)); clock.tokens_per_s is None
        True
    """

    start: float
    first_token_at: float | None = None
    last_at: float | None = None
    first_tokens: int = 0
    decode_tokens: int = 0

    def tick(self, chunk: np.ndarray) -> None:
        now = time.perf_counter()
        real = int(np.count_nonzero(chunk != PAD_ID))
        if self.first_token_at is None:
            self.first_token_at, self.first_tokens = now, real
        else:
            self.decode_tokens += real
        self.last_at = now

    @property
    def new_tokens(self) -> int:
        return self.first_tokens + self.decode_tokens

    @property
    def first_token_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.start

    @property
    def decode_s(self) -> float:
        return 0.0 if self.first_token_at is None else self.last_at - self.first_token_at

    @property
    def tokens_per_s(self) -> float | None:
        """Decode rate after the first token; None when there is too little to measure."""
        if self.decode_tokens < 1 or self.decode_s <= 0:
            return None
        return self.decode_tokens / self.decode_s


# -- the stream --------------------------------------------------------------------------------
# The carry, what one compiled call hands the next:
# cache     KV cache (cached path only)
# ctx       token ids [B, block_size] at positions 0..pos-1 (what the cache holds)
# pos       number of tokens in the context (the pending token goes to position pos)
# pending   [B] the last token, sampled (or the prompt's last) but not yet fed to the model
# done      [B] whether each sample has emitted the stop token
# step      index of the next new token (for fold_in)


def _stream(
    model, programs, prompt, max_new_tokens, settings, num_samples, stop_token
) -> Iterator[np.ndarray]:
    state = nnx.state(model)
    use_cache, chunk_size = programs.use_cache, programs.chunk_size
    size, window = model.cfg.block_size, window_size(model.cfg.block_size)
    carry = _start_carry(model, prompt, num_samples, use_cache)
    pos = len(prompt) - 1  # host copy of carry["pos"]: it advances deterministically
    if use_cache:
        carry = _refill_pieces(programs.refill, state, carry, shift=0, keep=pos, window=window)

    produced = 0
    while produced < max_new_tokens:
        steps = min(chunk_size if produced else 1, max_new_tokens - produced)
        if use_cache:
            if pos == size:  # the cache is full: keep the last `window` tokens, pending included
                keep = window - 1
                carry = _refill_pieces(
                    programs.refill, state, carry, shift=size - keep, keep=keep, window=window
                )
                pos = keep
            steps = min(steps, size - pos)
        carry, tokens_BxC = programs.chunk(state, carry, settings, np.int32(steps))
        for _ in range(steps):  # the uncached step slides as the cached host loop does
            pos = (window - 1 if pos == size else pos) + 1
        tokens_BxC = np.asarray(tokens_BxC)[:, :steps]  # waits for this chunk: the stream point
        if stop_token is not None:
            stopped_BxC = np.cumsum(tokens_BxC == stop_token, axis=1) > 0
            # columns after the one where the last sample stopped carry only padding
            all_done = np.flatnonzero(np.all(stopped_BxC | (tokens_BxC == PAD_ID), axis=0))
            if all_done.size:
                yield tokens_BxC[:, : all_done[0] + 1]
                return
        produced += steps
        yield tokens_BxC


def _settings(seed, temperature, top_k, top_p, stop_token) -> dict:
    """Plain numpy scalars: traced by the compiled programs, so nothing compiles eagerly for
    them (the key is made from the seed inside the programs)."""
    return {
        "seed": np.int32(seed),
        "temperature": np.float32(temperature),
        "top_k": np.int32(top_k),
        "top_p": np.float32(top_p),
        "stop": np.int32(-1 if stop_token is None else stop_token),
    }


def _start_carry(model: GPT, prompt: np.ndarray, batch: int, use_cache: bool) -> dict:
    # Committed to the device, like the compiled calls' outputs that later calls receive: an
    # uncommitted first carry would make the same program compile twice (once mid-stream).
    return jax.device_put(_host_carry(model, prompt, batch, use_cache), jax.devices()[0])


def _host_carry(model: GPT, prompt: np.ndarray, batch: int, use_cache: bool) -> dict:
    size = model.cfg.block_size
    ctx_S = np.zeros((size,), np.int32)
    ctx_S[: len(prompt) - 1] = prompt[:-1]
    carry = {
        "ctx": np.broadcast_to(ctx_S, (batch, size)).copy(),
        "pos": np.int32(len(prompt) - 1),
        "pending": np.full((batch,), prompt[-1], np.int32),
        "done": np.zeros((batch,), bool),
        "step": np.int32(0),
    }
    if use_cache:
        shape = (batch, size, model.cfg.n_head, model.cfg.head_dim)
        dtype = model.cfg.compute_dtype
        # Stale or zero slots are harmless: attention masks every slot past the query.
        carry["cache"] = [
            {"k": np.zeros(shape, dtype), "v": np.zeros(shape, dtype)}
            for _ in range(model.cfg.n_layer)
        ]
    return carry


def _refill_pieces(refill, state, carry, *, shift: int, keep: int, window: int) -> dict:
    """Move ctx[shift:shift + keep] to positions 0..keep-1 and write them into the cache, in
    pieces of `window` tokens (at most two: keep < block_size); pos becomes keep."""
    for piece, start in enumerate(range(0, max(keep, 1), window)):
        carry = refill(
            state,
            carry,
            np.int32(shift if piece == 0 else 0),
            np.int32(start),
            np.int32(keep),
        )
    return carry


@partial(jax.jit, static_argnums=0, donate_argnums=2)
def _refill(graphdef, state, carry: dict, shift, start, keep) -> dict:
    """Roll ctx left by `shift`, then run ctx[start:start + window] at positions start.. into
    the cache. Tokens past `keep` in the piece are padding: their slots are written too, but
    masked by position and overwritten before any query can see them."""
    model = nnx.merge(graphdef, state)
    window = window_size(model.cfg.block_size)
    ctx_BxS = jnp.roll(carry["ctx"], -shift, axis=1)
    piece_BxW = jax.lax.dynamic_slice_in_dim(ctx_BxS, start, window, axis=1)
    # Only the cache is used, so XLA drops the logits of the last position.
    _, cache = model.decode(piece_BxW, carry["cache"], start, last_only=True)
    return {**carry, "cache": cache, "ctx": ctx_BxS, "pos": keep}


def _sample_step(logits_BxV: jax.Array, carry: dict, settings: dict) -> tuple[dict, jax.Array]:
    """Sample the next token, update pending/done/step; return (carry, emitted token [B])."""
    key = jax.random.fold_in(jax.random.key(settings["seed"]), carry["step"])
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


def _run_steps(step, carry: dict, n_steps, chunk_size: int) -> tuple[dict, jax.Array]:
    """n_steps (traced, <= chunk_size) calls of `step`; tokens [B, chunk_size], PAD past n."""
    batch = carry["pending"].shape[0]

    def body(i, state):
        c, out_BxC = state
        c, token_B = step(c)
        return c, jax.lax.dynamic_update_slice(out_BxC, token_B[:, None], (0, i))

    out_BxC = jnp.full((batch, chunk_size), PAD_ID, jnp.int32)
    return jax.lax.fori_loop(0, n_steps, body, (carry, out_BxC))


@partial(jax.jit, static_argnums=0, static_argnames=("chunk_size",), donate_argnums=2)
def _cached_chunk(graphdef, state, carry: dict, settings: dict, n_steps, *, chunk_size: int):
    """n_steps decode steps against the cache; the host keeps pos + n_steps <= block_size."""
    model = nnx.merge(graphdef, state)

    def step(c):
        logits_Bx1xV, cache = model.decode(c["pending"][:, None], c["cache"], c["pos"])
        ctx = jax.lax.dynamic_update_slice(c["ctx"], c["pending"][:, None], (0, c["pos"]))
        c = {**c, "cache": cache, "ctx": ctx, "pos": c["pos"] + 1}
        return _sample_step(logits_Bx1xV[:, 0], c, settings)

    return _run_steps(step, carry, n_steps, chunk_size)


@partial(jax.jit, static_argnums=0, static_argnames=("chunk_size",), donate_argnums=2)
def _uncached_chunk(graphdef, state, carry: dict, settings: dict, n_steps, *, chunk_size: int):
    """Reference steps: slide when full, append the pending token, full forward over ctx."""
    model = nnx.merge(graphdef, state)
    size = model.cfg.block_size
    keep = window_size(size) - 1

    def step(c):
        full = c["pos"] == size
        ctx = jnp.where(full, jnp.roll(c["ctx"], -(size - keep), axis=1), c["ctx"])
        pos = jnp.where(full, keep, c["pos"])
        ctx = jax.lax.dynamic_update_slice(ctx, c["pending"][:, None], (0, pos))
        x_BxSxD = model.hidden_states(ctx)  # causal: positions after pos change nothing here
        x_Bx1xD = jax.lax.dynamic_slice_in_dim(x_BxSxD, pos, 1, axis=1)
        logits_BxV = model.unembed(x_Bx1xD)[:, 0]
        return _sample_step(logits_BxV, {**c, "ctx": ctx, "pos": pos + 1}, settings)

    return _run_steps(step, carry, n_steps, chunk_size)


# -- the programs: jit-compiled at first call, or compiled ahead (and kept on disk) ------------


@dataclass(frozen=True)
class DecodePrograms:
    """The programs a stream runs: `chunk(state, carry, settings, n_steps) -> (carry, tokens)`
    and, with the cache, `refill(state, carry, shift, start, keep) -> carry`, for one sample
    count (None: any, as jit compiles per shape), cache choice and chunk size."""

    chunk: Callable
    refill: Callable | None
    num_samples: int | None
    use_cache: bool
    chunk_size: int


def jit_programs(model: GPT, *, use_cache: bool, chunk_size: int) -> DecodePrograms:
    """The jitted programs, compiled at their first call (each new shape compiles again)."""
    graphdef = nnx.split(model)[0]
    return DecodePrograms(
        chunk=partial(_chunk_program(use_cache), graphdef, chunk_size=chunk_size),
        refill=partial(_refill, graphdef) if use_cache else None,
        num_samples=None,
        use_cache=use_cache,
        chunk_size=chunk_size,
    )


def compile_programs(
    model: GPT,
    *,
    num_samples: int = 1,
    use_cache: bool = True,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    cache: ProgramCache | None = None,
) -> DecodePrograms:
    """The programs `generate` runs with these settings, compiled before the first token:
    crossing the context, a new prompt length or new sampling settings compile nothing more.

    With a `cache`, they are read from it when it holds them (no tracing, lowering or
    compiling), and stored in it when they were compiled here. The two programs compile side by
    side (XLA compiles outside the GIL).
    """
    check_memory(model.cfg, num_samples, use_cache)
    graphdef, state = nnx.split(model)
    arguments = {
        "model": dataclasses.asdict(model.cfg),
        "state": [
            [jax.tree_util.keystr(path), list(x.shape), str(x.dtype)]
            for path, x in jax.tree_util.tree_leaves_with_path(state)
        ],
        "num_samples": num_samples,
        "use_cache": use_cache,
        "chunk_size": chunk_size,
    }
    stored = cache.get("decode", arguments) if cache is not None else None
    compiled = _deserialize(stored) if stored is not None else None
    example_args = _example_args(model, num_samples, use_cache)
    if compiled is not None and not _runs(compiled, example_args):
        compiled = None  # loaded, but cannot run here: compile, and replace the entry
    if compiled is None:
        compiled, from_jax_cache = _compile(graphdef, example_args, use_cache, chunk_size)
        # An executable that JAX read from its own disk cache cannot be serialized again (on
        # XLA:CPU it loads but fails to run): keep only what was compiled here.
        if cache is not None and not from_jax_cache:
            cache.put("decode", arguments, {name: _serialize(c) for name, c in compiled.items()})
    return DecodePrograms(
        chunk=compiled["chunk"],
        refill=compiled.get("refill"),
        num_samples=num_samples,
        use_cache=use_cache,
        chunk_size=chunk_size,
    )


def _chunk_program(use_cache: bool):
    return _cached_chunk if use_cache else _uncached_chunk


def _example_args(model: GPT, num_samples: int, use_cache: bool) -> dict[str, tuple]:
    """Each program's arguments (after the static ones), as `_stream` passes them: the same
    shapes, dtypes and shardings, on a throwaway carry of its own (calls donate it)."""
    state = nnx.state(model)
    zero = np.int32(0)

    def carry():
        return _start_carry(model, np.zeros(1, np.int32), num_samples, use_cache)

    args = {"chunk": (state, carry(), _settings(0, 1.0, 0, 1.0, None), zero)}
    if use_cache:
        args["refill"] = (state, carry(), zero, zero, zero)
    return args


def _runs(compiled: dict, example_args: dict[str, tuple]) -> bool:
    """Whether kept executables run: each called once on its example arguments (a chunk of
    zero steps; their first call, which the first token would otherwise pay)."""
    try:
        for name, args in example_args.items():
            jax.block_until_ready(compiled[name](*args))
    except Exception:  # e.g. JaxRuntimeError "Function ... not found"; a mismatched signature
        return False
    return True


def _compile(graphdef, example_args: dict[str, tuple], use_cache: bool, chunk_size: int):
    """({name: jax.stages.Compiled}, whether any came from JAX's persistent cache)."""
    trace = {
        "chunk": partial(_chunk_program(use_cache).trace, chunk_size=chunk_size),
        "refill": _refill.trace,
    }
    hits = []

    def listener(event, **kwargs):
        if event == JAX_CACHE_HIT:
            hits.append(event)

    def compile_one(name: str):
        return trace[name](graphdef, *example_args[name]).lower().compile()

    jax.monitoring.register_event_listener(listener)
    try:
        with ThreadPoolExecutor(max_workers=len(example_args)) as pool:
            futures = {name: pool.submit(compile_one, name) for name in example_args}
            compiled = {name: future.result() for name, future in futures.items()}
    finally:
        jax.monitoring.unregister_event_listener(listener)
    return compiled, bool(hits)


def _serialize(compiled) -> tuple:
    return serialize_executable.serialize(compiled)  # (payload, in_tree, out_tree)


def _deserialize(stored: Any) -> dict | None:
    """The programs of a cache entry, loaded onto the first device; None if they do not load."""
    try:
        device = jax.devices()[0]
        return {
            name: serialize_executable.deserialize_and_load(
                payload, in_tree, out_tree, backend=device.client, execution_devices=[device]
            )
            for name, (payload, in_tree, out_tree) in stored.items()
        }
    except Exception:  # an entry this jaxlib cannot load: compile instead
        return None
