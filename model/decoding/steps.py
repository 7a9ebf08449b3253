"""What the compiled decode programs run: the carry they hand each other, the refill of the KV
cache, and a chunk of decode steps (against the cache, or the uncached reference).

The carry, what one compiled call hands the next:
    cache     KV cache (cached path only)
    ctx       token ids [B, block_size] at positions 0..pos-1 (what the cache holds)
    pos       number of tokens in the context (the pending token goes to position pos)
    pending   [B] the last token, sampled (or the prompt's last) but not yet fed to the model
    done      [B] whether each sample has emitted the stop token
    step      index of the next new token (for fold_in)

    >>> window_size(64), window_size(1)
    (32, 1)
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.decoding.sampling import GPU_PLATFORMS, sample_logits, token_scores
from model.network.attention import backend_facts
from model.network.config import ModelConfig
from model.network.gpt import GPT, cache_layout
from model.network.kv_writes import write_window
from model.network.params import sampling_device

PAD_ID = -1  # what a stopped sample emits after its stop token


def window_size(block_size: int) -> int:
    """Tokens kept when the context is full (the newest included): block_size // 2, >= 1."""
    return max(1, block_size // 2)


def start_carry(model: GPT, prompt: np.ndarray, batch: int, use_cache: bool) -> dict:
    # Committed to the device, like the compiled calls' outputs that later calls receive: an
    # uncommitted first carry would make the same program compile twice (once mid-stream).
    return jax.device_put(_host_carry(model, prompt, batch, use_cache), sampling_device())


def carry_layout(cfg: ModelConfig, batch: int, use_cache: bool) -> dict:
    """The carry's shapes and dtypes (ShapeDtypeStructs), for `batch` samples."""
    size = cfg.block_size
    layout = {
        "ctx": jax.ShapeDtypeStruct((batch, size), np.int32),
        "pos": jax.ShapeDtypeStruct((), np.int32),
        "pending": jax.ShapeDtypeStruct((batch,), np.int32),
        "done": jax.ShapeDtypeStruct((batch,), np.bool_),
        "step": jax.ShapeDtypeStruct((), np.int32),
    }
    if use_cache:
        # Stale or zero slots are harmless: attention masks every slot past the query.
        layout["cache"] = cache_layout(cfg, batch)
    return layout


def zeros_like_layout(layout):
    """Host zeros for every ShapeDtypeStruct of `layout`."""
    return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), layout)


def _host_carry(model: GPT, prompt: np.ndarray, batch: int, use_cache: bool) -> dict:
    carry = zeros_like_layout(carry_layout(model.cfg, batch, use_cache))
    carry["ctx"][:, : len(prompt) - 1] = prompt[:-1]
    carry["pos"] = np.int32(len(prompt) - 1)
    carry["pending"][:] = prompt[-1]
    return carry


@partial(jax.jit, static_argnums=0, static_argnames=("width", "scored"), donate_argnums=2)
def refill(
    graphdef, state, carry: dict, shift, start, keep, *, width=None, scored=False, head_DxV=None
):
    """The one prefill: roll ctx left by `shift`, then run ctx[start:start + width] at
    positions start.. into the cache (width: the refill window, block_size // 2, unless a
    caller picks a narrower piece for a short prompt). Tokens past `keep` in the piece are
    padding: their slots are written too, but masked by position and overwritten before any
    query can see them. The caller keeps start + width <= block_size.

    With `scored`, returns (carry, scores): `token_scores` of each piece position j for the
    token that follows it (ctx[start + j + 1], or the pending token at keep - 1), [B, width].
    `head_DxV`: the output layer as `GPT.decoding_head` gives it (None: the model's own)."""
    model = nnx.merge(graphdef, state)
    width = width or window_size(model.cfg.block_size)
    ctx_BxS = jnp.roll(carry["ctx"], -shift, axis=1)
    piece_BxW = jax.lax.dynamic_slice_in_dim(ctx_BxS, start, width, axis=1)
    # Unscored, only the cache is used, so XLA drops the logits of the last position too.
    logits_BxWxV, cache = model.decode(
        piece_BxW, carry["cache"], start, last_only=not scored, head_DxV=head_DxV
    )
    carry = {**carry, "cache": cache, "ctx": ctx_BxS, "pos": keep}
    if not scored:
        return carry
    after_Bx1 = jnp.broadcast_to(carry["pending"][:, None], (ctx_BxS.shape[0], 1))
    next_BxW = jax.lax.dynamic_slice_in_dim(
        jnp.concatenate([ctx_BxS, after_Bx1], axis=1), start + 1, width, axis=1
    )
    positions_W = start + 1 + jnp.arange(width)
    next_BxW = jnp.where(positions_W == keep, carry["pending"][:, None], next_BxW)
    return carry, token_scores(logits_BxWxV, next_BxW)


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


def run_steps(step, carry: dict, n_steps, chunk_size: int) -> tuple[dict, Any]:
    """n_steps calls of `step(carry) -> (carry, out)`: a traced count <= chunk_size, or None
    for exactly chunk_size (a count known when compiling, `fixed_step_counts`). Each leaf of
    `out` ([B, ...]) comes back as [B, chunk_size, ...], PAD_ID (integers) or 0 past n.
    The serving batch (model/serving/batch.py) runs its steps through it too."""
    shapes = jax.eval_shape(step, carry)[1]

    def buffer(s):
        fill = PAD_ID if jnp.issubdtype(s.dtype, jnp.integer) else 0
        return jnp.full((s.shape[0], chunk_size, *s.shape[1:]), fill, s.dtype)

    def body(i, state):
        c, outs = state
        c, out = step(c)
        put = partial(jax.lax.dynamic_update_index_in_dim, index=i, axis=1)
        return c, jax.tree.map(lambda buf, x: put(buf, x), outs, out)

    count = chunk_size if n_steps is None else n_steps
    return jax.lax.fori_loop(0, count, body, (carry, jax.tree.map(buffer, shapes)))


def fixed_step_counts() -> bool:
    """Whether decode chunks are compiled for a fixed number of steps (chunk_size, and one)
    rather than one program taking the count as an argument: on a GPU's host (the host the
    model is traced for, `backend_facts`).

    XLA:GPU runs a loop whose trip count it cannot read from the program by copying the loop
    condition to the host and waiting for it, every turn (so a launch returns only when the
    chunk is done, and the host's work stops overlapping the device's); a count known when
    compiling runs without. XLA:CPU runs loops on the host anyway, and TPUs decide them on the
    device: there one program serves every count, and a short chunk costs only its steps."""
    return backend_facts()[0] in GPU_PLATFORMS


def by_fixed_counts(full: Callable, one: Callable, chunk_size: int) -> Callable:
    """A chunk callable `(*args, n_steps, **kw) -> (carry, out)` made of two programs compiled for
    fixed counts (their n_steps argument None): `full` runs chunk_size steps, `one` a single
    step. n_steps = chunk_size calls `full`; fewer call `one` n_steps times (a first token, a
    context's last few slots). Then `out` is the list of the steps' outputs, which
    `chunk_outputs` joins on the host: a join on the device compiled a program per count and
    row count at its first use (tenths of a second each on a GPU, paid while serving)."""

    def run(state, carry, *args, **kwargs):
        *args, n_steps = args
        n_steps = int(n_steps)
        if n_steps == chunk_size:
            return full(state, carry, *args, None, **kwargs)
        if n_steps < 1:
            raise ValueError(f"a chunk runs 1 to {chunk_size} steps, not {n_steps}")
        outs = []
        for _ in range(n_steps):
            carry, out = one(state, carry, *args, None, **kwargs)
            outs.append(out)
        return carry, outs

    return run


def chunk_outputs(out) -> Any:
    """A chunk's outputs on the host, each leaf [B, columns, ...]: one program's outputs, or
    the per-step outputs of `by_fixed_counts` (a list), joined here. Waits for the chunk."""
    out = jax.device_get(out)
    if not isinstance(out, list):
        return out
    return jax.tree.map(lambda *cols: np.concatenate(cols, axis=1), *out)


@partial(jax.jit, static_argnums=0, static_argnames=("chunk_size",), donate_argnums=2)
def cached_chunk(
    graphdef, state, carry: dict, settings: dict, n_steps, *, chunk_size: int, head_DxV=None
):
    """n_steps (or, None, chunk_size) decode steps against the cache; the host keeps
    pos + n_steps <= block_size. `head_DxV`: as `refill` takes it.

    As the serving batch's chunk (model/serving/batch.py), the cache is only read during the
    steps: each step's keys and values go into a buffer of the chunk's own, which goes into
    the cache once, at the chunk's end. A step that wrote into the cache made XLA:CPU copy each
    layer's keys, transposed, every step (the 11M model decoded one row at 3 ms a step against
    the serving chunk's 1.9)."""
    model = nnx.merge(graphdef, state)
    head = {name: x for name, x in carry.items() if name != "cache"}
    rows = carry["ctx"].shape[0]
    head["recent"], head["at"] = chunk_buffer(model.cfg, rows, chunk_size), jnp.int32(0)
    start = carry["pos"]

    def step(c):
        pending_Bx1 = c["pending"][:, None]
        logits_BxV, recent = step_over_cache(
            model, carry["cache"], c["recent"], c["at"], pending_Bx1, c["pos"], head_DxV
        )
        ctx = jax.lax.dynamic_update_slice(c["ctx"], pending_Bx1, (0, c["pos"]))
        c = {**c, "recent": recent, "at": c["at"] + 1, "ctx": ctx, "pos": c["pos"] + 1}
        return _sample_step(logits_BxV, c, settings)

    head, out = run_steps(step, head, n_steps, chunk_size)
    recent = head.pop("recent")
    del head["at"]
    start_B = jnp.full((rows,), start, jnp.int32)
    count_B = jnp.full((rows,), chunk_size if n_steps is None else n_steps, jnp.int32)
    head["cache"] = cache_with_buffer(carry["cache"], recent, start_B, count_B)
    return head, out


def chunk_buffer(cfg: ModelConfig, rows: int, chunk_size: int) -> list[dict]:
    """A chunk's own keys and values, zeros: per layer {"k", "v"} [rows, H, chunk_size, Dh]."""
    layout = cache_layout(cfg, rows, chunk_size)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), layout)


def step_over_cache(
    model: GPT, cache: list[dict], recent: list[dict], at, tokens_Bx1, pos, head_DxV=None
) -> tuple[jax.Array, list[dict]]:
    """Step `at` of a chunk that only reads `cache`: the tokens run at `pos` (one for every
    row, or [B]) attend over the cache's slots before the chunk and the buffer's 0..at, and
    their keys and values go into the buffer at `at`. Returns (logits [B, V], buffer)."""
    layers = [
        {**kv, "recent_k": part["k"], "recent_v": part["v"], "at": at}
        for kv, part in zip(cache, recent, strict=True)
    ]
    logits_Bx1xV, layers = model.decode(tokens_Bx1, layers, pos, head_DxV=head_DxV)
    return logits_Bx1xV[:, 0], [{"k": x["recent_k"], "v": x["recent_v"]} for x in layers]


def cache_with_buffer(cache: list[dict], recent: list[dict], start_B, count_B) -> list[dict]:
    """`cache` with row b's first count_B[b] buffer entries written at slots start_B[b]..
    (`kv_writes.write_window`): a chunk's end."""
    return [
        {name: write_window(layer[name], part[name], start_B, count_B) for name in ("k", "v")}
        for layer, part in zip(cache, recent, strict=True)
    ]


@partial(jax.jit, static_argnums=0, static_argnames=("chunk_size",), donate_argnums=2)
def uncached_chunk(
    graphdef, state, carry: dict, settings: dict, n_steps, *, chunk_size: int, head_DxV=None
):
    """Reference steps: slide when full, append the pending token, full forward over ctx.
    `head_DxV`: as `refill` takes it."""
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
        logits_BxV = model.unembed(x_Bx1xD, head_DxV)[:, 0]
        return _sample_step(logits_BxV, {**c, "ctx": ctx, "pos": pos + 1}, settings)

    return run_steps(step, carry, n_steps, chunk_size)


def chunk_program(use_cache: bool):
    return cached_chunk if use_cache else uncached_chunk
