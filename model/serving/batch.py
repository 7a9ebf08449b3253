"""The compiled programs of a serving batch: B rows, each its own request, decoded together.

A row is one request's decoding state in the batch: its KV cache rows, its context, its
position, its pending token and its step count. Rows move at their own positions (per-row
lengths), so requests of any prompt length share one decode step. A request's prompt goes
into the cache on its own, through `--inference`'s one prefill program (model.decoding.steps
`refill`, in a piece as wide as the prompt needs), and the row is then put into its slot of
the batch (`put_row`); a row whose context is full is taken out (`take_row`), slid by the
same program and put back. So a request sees the context policy of `--inference`.

The decode steps (`batch_chunk`) run the model's cached decode with a position per row. The
cache is only read during a chunk: each row attends over its own slots before the chunk
(only as many as the longest row needs, `length`) and over the chunk's own keys and values,
which every step writes into a small buffer at one index for all rows (one slice write,
where writing into the cache at each row's position took a write per row and layer every
step); the buffer goes into the cache once, at the chunk's end (`write_window`). The slots a
chunk attends over are a copy of the cache's first rows and slots (`attended_cache`: a
strided slice, which XLA:CPU copies at about 7 GB/s, 5.5 ms for 16 rows over 128 slots of the
11M model). The chunk takes that copy as an argument and writes its window into it as well,
so the next chunk of the same shape reads it as it is: the copy is made again only when the
shape changes (the length grows, every fourth chunk of 8 steps at most) or a row is put in.

Each row samples with its own settings and key (`fold_in(key(seed), step)`, as `--inference`
does). Free slots among the rows run are masked by `active` (nothing of theirs is written, so a
free row's kept prompt stays); a chunk runs only the first rows, as many as the highest busy
slot needs (1, 4 or 16 of 16). Each row count and length is its own compiled program, all
compiled at start-up.

    >>> batch = empty_batch(model, rows=4)                           # doctest: +SKIP
    >>> batch = put_row(batch, row_carry, np.int32(2))  # doctest: +SKIP
    >>> seen = attended_cache(batch, rows=4, length=64)  # doctest: +SKIP
    >>> (batch, seen), out = batch_chunk(graphdef, state, (batch, seen), settings, active,
    ...                                  np.int32(4), chunk_size=8, rows=4)  # doctest: +SKIP
    >>> out["token"].shape  # doctest: +SKIP
    (4, 8)
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.decoding.sampling import sample_logits, token_scores_if
from model.decoding.sampling_params import SamplingParams
from model.decoding.steps import (
    PAD_ID,
    cache_with_buffer,
    carry_layout,
    chunk_buffer,
    run_steps,
    step_over_cache,
    zeros_like_layout,
)
from model.network.config import ModelConfig
from model.network.gpt import GPT
from model.network.params import sampling_device

ROW_FIELDS = ("cache", "ctx", "pending", "done")  # [1, ...] in a row carry, [B, ...] here


def empty_batch(model: GPT, rows: int) -> dict:
    """A batch of `rows` free slots, committed to this process's first device (see
    model.decoding.steps)."""
    return jax.device_put(zeros_like_layout(batch_layout(model.cfg, rows)), sampling_device())


def batch_layout(cfg: ModelConfig, rows: int) -> dict:
    """The batch's shapes and dtypes: a carry of `rows` samples whose position and step are
    per row."""
    per_row = jax.ShapeDtypeStruct((rows,), np.int32)
    return {**carry_layout(cfg, rows, use_cache=True), "pos": per_row, "step": per_row}


def batch_settings(rows: int) -> dict[str, np.ndarray]:
    """Per-row sampling settings (host arrays, filled in as requests take slots)."""
    return {
        "seed": np.zeros((rows,), np.int32),
        "temperature": np.zeros((rows,), np.float32),
        "top_k": np.zeros((rows,), np.int32),
        "top_p": np.ones((rows,), np.float32),
        "stop": np.full((rows,), -1, np.int32),
        "scored": np.zeros((rows,), bool),  # the request asked for log-probabilities
    }


def set_row_settings(
    settings: dict, slot: int, sampling: SamplingParams, stop_token: int | None, scored: bool
) -> None:
    """Write a request's sampling settings, stop token and whether it asked for
    log-probabilities into row `slot` of `settings`."""
    settings["seed"][slot] = sampling.seed
    settings["temperature"][slot] = sampling.temperature
    settings["top_k"][slot] = sampling.top_k
    settings["top_p"][slot] = sampling.top_p
    settings["stop"][slot] = -1 if stop_token is None else stop_token
    settings["scored"][slot] = scored


def attention_lengths(size: int, fine: bool) -> list[int]:
    """The cache lengths `batch_chunk` may attend over, for a context of `size` slots: each is
    a program compiled at start-up, so there are few. With `fine` (the full batch), every
    multiple of an eighth of the context (at least 32 slots); otherwise a quarter, half or
    all of it. Attention over the cache is bound by reading it, which matters with many rows:
    measured on the 11M model at 16 rows, a step takes 12 ms over 64 slots and 22 ms over
    256, against 3.8 and 5.1 ms for one row.

    >>> attention_lengths(256, fine=True), attention_lengths(256, fine=False)
    ([32, 64, 96, 128, 160, 192, 224, 256], [64, 128, 256])
    >>> attention_lengths(64, fine=True), attention_lengths(16, fine=False)
    ([32, 64], [16])
    """
    if fine:
        step = max(size // 8, min(32, size))
        return sorted({min(step * k, size) for k in range(1, -(-size // step) + 1)})
    return sorted({max(size * k // 4, min(32, size)) for k in (1, 2, 4)})


@partial(jax.jit, donate_argnums=0)
def put_row(batch: dict, row: dict, slot) -> dict:
    """`batch` with slot `slot` holding a single-row carry (refilled by the decode programs)."""
    out = dict(batch)
    for name in ROW_FIELDS:
        out[name] = jax.tree_util.tree_map(
            lambda b, r: jax.lax.dynamic_update_index_in_dim(b, r[0], slot, axis=0),
            batch[name],
            row[name],
        )
    out["pos"] = batch["pos"].at[slot].set(row["pos"])
    out["step"] = batch["step"].at[slot].set(row["step"])
    return out


@jax.jit
def take_row(batch: dict, slot) -> dict:
    """The single-row carry of slot `slot` (to slide its context with `refill`)."""
    row = {
        name: jax.tree_util.tree_map(
            lambda b: jax.lax.dynamic_index_in_dim(b, slot, axis=0, keepdims=True), batch[name]
        )
        for name in ROW_FIELDS
    }
    row["pos"] = batch["pos"][slot]
    row["step"] = batch["step"][slot]
    return row


@partial(jax.jit, static_argnames=("rows", "length"))
def attended_cache(batch: dict, *, rows: int, length: int) -> list[dict]:
    """The slots a chunk of `rows` rows over `length` cache slots attends over: a copy of the
    batch cache's first rows and slots, per layer {"k", "v"} [rows, H, length, Dh]."""
    return jax.tree_util.tree_map(lambda x: x[:rows, :, :length], batch["cache"])


def attended_like(batch: dict, rows: int, length: int) -> list[dict]:
    """`attended_cache(batch, rows=rows, length=length)` as shapes (arrays or shapes in
    `batch`), on the batch's devices: what a chunk's programs are compiled for."""
    shapes = jax.eval_shape(partial(attended_cache, rows=rows, length=length), batch)
    return jax.tree.map(
        lambda s, x: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=x.sharding),
        shapes,
        batch["cache"],
    )


@partial(
    jax.jit,
    static_argnums=0,
    static_argnames=("chunk_size", "rows"),
    donate_argnums=2,
)
def batch_chunk(
    graphdef,
    state,
    carry: tuple[dict, list[dict]],
    settings: dict,
    active_B,
    n_steps,
    *,
    chunk_size: int,
    rows: int,
    head_DxV=None,
) -> tuple[tuple[dict, list[dict]], jax.Array]:
    """n_steps (traced, <= chunk_size; None: chunk_size) decode steps of every active row, on
    carry = (batch, attended); the host keeps each active row's pos + n_steps within
    `attended`'s slots. Only the first `rows` rows run (the host puts every active row
    there): a few requests cost a few rows' compute, not the whole batch's. They attend over
    `attended`, the first cache slots of those rows (`attended_cache`): short rows cost
    short attention.

    Returns ((batch, attended), out), the chunk's keys and values written into both; for the
    rows run, out["token"] [rows, chunk_size] (PAD_ID for free slots, for rows past their
    stop token and past n_steps) and each token's `token_scores` ("logprob" [rows,
    chunk_size], "top_ids"/"top_logprobs" [rows, chunk_size, 5]; on a CPU or TPU, zeros in a
    chunk where no busy row's settings ask for them). `head_DxV`: the output
    layer as `GPT.decoding_head` gives it (None: the model's own)."""
    model = nnx.merge(graphdef, state)
    batch, attended = carry
    head = {name: x[:rows] for name, x in batch.items() if name != "cache"}
    settings = jax.tree_util.tree_map(lambda x: x[:rows], settings)
    active_B = active_B[:rows]
    # The cache is only read during the chunk; each step's keys and values go to a buffer of
    # the chunk's own (`recent`), written in at its end.
    head["recent"], head["at"] = chunk_buffer(model.cfg, rows, chunk_size), jnp.int32(0)
    start_B = head["pos"]
    # Log-probabilities (a softmax and a top-5 over the vocabulary, every row, every step)
    # only in chunks where a busy row asked for them (on a GPU, always).
    scored = jnp.any(settings["scored"] & active_B)

    def step(c):
        # A free row runs at position `at`: it sees the buffer's slots 0..at only (never no
        # key at all, never a position past the context); what it computes is dropped.
        pos_B = jnp.where(active_B, c["pos"], c["at"])
        logits_BxV, recent = step_over_cache(
            model, attended, c["recent"], c["at"], c["pending"][:, None], pos_B, head_DxV
        )
        at_BxS = (jnp.arange(c["ctx"].shape[1]) == pos_B[:, None]) & active_B[:, None]
        ctx = jnp.where(at_BxS, c["pending"][:, None], c["ctx"])  # a select, not a scatter
        keys_B = jax.vmap(lambda seed, i: jax.random.fold_in(jax.random.key(seed), i))(
            settings["seed"], c["step"]
        )
        token_B = sample_logits(
            logits_BxV, keys_B, settings["temperature"], settings["top_k"], settings["top_p"]
        )
        scores = token_scores_if(scored, logits_BxV, token_B)
        live_B = active_B & ~c["done"]
        emitted_B = jnp.where(live_B, token_B, PAD_ID)
        advance_B = active_B.astype(jnp.int32)
        c = {
            "recent": recent,
            "at": c["at"] + 1,
            "ctx": ctx,
            "pos": c["pos"] + advance_B,
            "pending": jnp.where(active_B, token_B, c["pending"]),
            "done": c["done"] | (live_B & (token_B == settings["stop"])),
            "step": c["step"] + advance_B,
        }
        return c, {"token": emitted_B, **scores}

    head, out_R = run_steps(step, head, n_steps, chunk_size)
    count_B = jnp.where(active_B, chunk_size if n_steps is None else n_steps, 0)
    recent = head.pop("recent")
    del head["at"]
    out = {
        name: jax.lax.dynamic_update_slice(batch[name], part, (0,) * part.ndim)
        for name, part in head.items()
    }

    out["cache"] = cache_with_buffer(batch["cache"], recent, start_B, count_B)
    return (out, cache_with_buffer(attended, recent, start_B, count_B)), out_R
