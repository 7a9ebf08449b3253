"""Causal multi-head self-attention, with an optional explicit KV cache.

The math is one pure function (`attend`, the readable reference); the module owns the
projections and the cache writes. The same `attend` serves training (keys = this call's tokens,
causal mask) and decoding (keys = the preallocated cache, [B, H, S, Dh], masked by absolute
position), so the two paths cannot drift apart.

The same attention also runs through `jax.nn.dot_product_attention` (`model.attention`):
XLA's implementation anywhere, or cuDNN's fused flash attention on NVIDIA GPUs, which never
materialises the [T, S] scores. `choose_implementation` picks one per call, from facts known
at trace time (backend, dtype, head dim, cache or not, dropout), and picks cuDNN only where
JAX's cuDNN path accepts the call (jax/_src/cudnn/fused_attention_stablehlo.py, JAX 0.10):
  - fp16/bf16 inputs (float32 is refused);
  - head dim a multiple of 8, at most 128 (256 only on Hopper and later: we stay at 128);
  - a CUDA GPU of compute capability 8.0 or more (Ampere: flash attention's floor);
  - a causal mask given as `is_causal` (cuDNN skips the masked blocks). The KV cache's
    position mask is neither causal nor a padding length, and as a dense mask cuDNN would
    take it as an additive bias: the cache path uses XLA.
Attention dropout: dot_product_attention has no dropout on the probabilities, so a training
call with model.dropout > 0 runs the reference (dropout stays exactly as before).

Example:
    >>> from flax import nnx
    >>> from model.network.config import ModelConfig
    >>> cfg = ModelConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)
    >>> attn = CausalSelfAttention(cfg, rngs=nnx.Rngs(0))
    >>> y, _ = attn(jnp.ones((1, 4, 32)), jnp.arange(4))
    >>> y.shape
    (1, 4, 32)
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import math
import operator

import jax
import jax.numpy as jnp
from flax import nnx

from model.network.config import ModelConfig
from model.network.kv_writes import write_cache, write_recent
from model.network.layers import linear
from model.network.precision import mixed_product_precision
from model.network.rope import apply_rope
from model.network.value_embed import ValueEmbedding
from plumbing.errors import UsageError

# {"k": [B, H, S, Dh], "v": ...}; in a serving chunk's steps also "recent_k", "recent_v"
# ([B, H, C, Dh], the chunk's own) and "at" (the step), see `kv_writes.write_recent`
LayerCache = dict[str, jax.Array]

CUDNN_MIN_COMPUTE_CAPABILITY = (8, 0)
CUDNN_MAX_HEAD_DIM = 128
CUDNN_DTYPES = ("bfloat16", "float16")

# Masked scores get the most negative float32 rather than -inf: a fully masked row (never
# produced by our callers) would then give a uniform softmax instead of NaNs.
_MASKED = float(jnp.finfo(jnp.float32).min)


def attend(
    q_BxTxHxD: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask_TxS: jax.Array,
    *,
    heads_first: bool = False,
    dropout: nnx.Dropout | None = None,
    deterministic: bool = True,
    rngs: nnx.Rngs | None = None,
) -> jax.Array:
    """Scaled dot-product attention; scores and softmax in float32, output in q's dtype.

    k and v are [B, S, H, D], or [B, H, S, D] with `heads_first` (the KV cache's layout: one
    head's keys are contiguous, so a decode step's products read the cache as it lies instead
    of transposing all of it first); or tuples of such parts, whose keys are attended as if
    concatenated along S without copying them into one array (a serving chunk: the cache and
    the chunk's own keys). mask_TxS ([T, S], or [B, T, S]: a mask per row; S all parts' keys)
    is True where query t may attend to key s.
    """
    kv = "bhsd" if heads_first else "bshd"
    k_parts, v_parts = (k, v) if isinstance(k, tuple) else ((k,), (v,))
    scale = 1.0 / math.sqrt(q_BxTxHxD.shape[-1])
    scores_BxHxTxS = jnp.concatenate([
        jnp.einsum(
            f"bthd,{kv}->bhts", q_BxTxHxD, part, preferred_element_type=jnp.float32,
            precision=mixed_product_precision(q_BxTxHxD.dtype),  # bf16 in the backward too
        ) for part in k_parts
    ], axis=-1)  # fmt: skip
    mask_BxTxS = mask_TxS if mask_TxS.ndim == 3 else mask_TxS[None]
    scores_BxHxTxS = jnp.where(mask_BxTxS[:, None], scores_BxHxTxS * scale, _MASKED)
    probs_BxHxTxS = jax.nn.softmax(scores_BxHxTxS, axis=-1)
    if dropout is not None:
        probs_BxHxTxS = dropout(probs_BxHxTxS, deterministic=deterministic, rngs=rngs)
    probs_BxHxTxS = probs_BxHxTxS.astype(v_parts[0].dtype)
    if len(v_parts) == 1:
        return jnp.einsum(f"bhts,{kv}->bthd", probs_BxHxTxS, v)
    ends = list(itertools.accumulate(part.shape[2 if heads_first else 1] for part in v_parts))
    probs_parts = jnp.split(probs_BxHxTxS, ends[:-1], axis=-1)
    return functools.reduce(
        operator.add,
        (
            jnp.einsum(f"bhts,{kv}->bthd", probs, part)
            for probs, part in zip(probs_parts, v_parts, strict=True)
        ),
    )


def choose_implementation(
    requested: str,
    *,
    platform: str,
    compute_capability: tuple[int, int] | None,
    dtype: str,
    head_dim: int,
    cached: bool,
    dropout: bool,
) -> str:
    """Which attention runs: "reference", "xla" or "cudnn". Pure: tested for every case.

    requested: model.attention ("auto" | "xla" | "cudnn" | "reference"); platform: "cuda",
    "rocm", "cpu" or "tpu"; compute_capability: (major, minor) of a CUDA GPU, else None;
    dtype: the compute dtype's name; cached: keys come from the KV cache (position mask);
    dropout: attention dropout is active in this call.

    >>> choose_implementation("auto", platform="cuda", compute_capability=(9, 0),
    ...     dtype="bfloat16", head_dim=64, cached=False, dropout=False)
    'cudnn'
    >>> choose_implementation("auto", platform="cpu", compute_capability=None,
    ...     dtype="float32", head_dim=64, cached=False, dropout=False)
    'xla'
    """
    if requested == "reference" or dropout:
        return "reference"  # dot_product_attention cannot drop attention probabilities
    if requested == "xla" or cached:
        return "xla"
    cudnn_ok = (
        platform == "cuda"
        and compute_capability is not None
        and compute_capability >= CUDNN_MIN_COMPUTE_CAPABILITY
        and dtype in CUDNN_DTYPES
        and head_dim % 8 == 0
        and head_dim <= CUDNN_MAX_HEAD_DIM
    )
    if requested == "cudnn" and not cudnn_ok:
        raise UsageError(
            f"model.attention='cudnn' needs an NVIDIA GPU of compute capability 8.0+ "
            f"(this backend: {platform}"
            + (f" {compute_capability[0]}.{compute_capability[1]}" if compute_capability else "")
            + f"), bf16/fp16 compute (model.dtype={dtype}) and a head dim that is a multiple "
            f"of 8 up to {CUDNN_MAX_HEAD_DIM} (got {head_dim}); use model.attention=auto"
        )
    return "cudnn" if cudnn_ok else "xla"


# The host a trace is made for, when it is not this one (scripts/check_lowering.py traces the
# programs an H100 would run, on a CPU); None: the default device says.
_traced_for: contextvars.ContextVar[tuple[str, tuple[int, int] | None] | None] = (
    contextvars.ContextVar("traced_for", default=None)
)


def backend_facts() -> tuple[str, tuple[int, int] | None]:
    """(platform, compute capability) of the host the model is traced for: the default
    device's, ("cuda", (9, 0)) on an H100, ("cpu", None) here; or what `traced_for` says."""
    override = _traced_for.get()
    return override if override is not None else _device_facts()


@contextlib.contextmanager
def traced_for(platform: str, compute_capability: tuple[int, int] | None = None):
    """Choose attention as a `platform` host would (e.g. "cuda", (9, 0)) while tracing here.

    Lowering for another platform (`lower(lowering_platforms=...)`) changes the target of the
    compiled code, not the choices made in Python at trace time: this changes those."""
    token = _traced_for.set((platform, compute_capability))
    try:
        yield
    finally:
        _traced_for.reset(token)


@functools.cache
def _device_facts() -> tuple[str, tuple[int, int] | None]:
    """The default device's facts, read once."""
    device = jax.local_devices()[0]
    if device.platform != "gpu":
        return device.platform, None
    version = str(getattr(device.client, "platform_version", "")).lower()
    if "cuda" not in version:
        return "rocm", None
    try:
        major, minor = (int(x) for x in str(device.compute_capability).split(".")[:2])
    except (AttributeError, ValueError):
        return "cuda", None
    return "cuda", (major, minor)


def attend_fused(
    q_BxTxHxD: jax.Array, k_BxTxHxD: jax.Array, v_BxTxHxD: jax.Array, implementation: str
) -> jax.Array:
    """Causal `attend` through jax.nn.dot_product_attention (the mask given as is_causal, the
    form cuDNN's flash attention can skip blocks with)."""
    return jax.nn.dot_product_attention(
        q_BxTxHxD, k_BxTxHxD, v_BxTxHxD, is_causal=True, implementation=implementation
    )


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) over the last axis (computed in float32, returned in x's dtype), with no
    learned scale: QK-norm on each head's queries and keys bounds the attention logits.

    >>> [round(v, 4) for v in rms_normalize(jnp.array([3.0, 4.0]), 0.0).tolist()]
    [0.8485, 1.1314]
    """
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def causal_mask(t: int) -> jax.Array:
    """[T, T] boolean lower-triangular mask: query t sees keys 0..t."""
    return jnp.tril(jnp.ones((t, t), dtype=bool))


def position_mask(query_pos_BxT: jax.Array, num_keys: int) -> jax.Array:
    """[B, T, S] mask for a cache: a query at absolute position p sees cache slots 0..p.

    Slots beyond p hold stale or padding entries; masking by position (not by a length) keeps
    every shape fixed, so one compiled program serves every step.
    """
    return jnp.arange(num_keys) <= query_pos_BxT[..., None]


def chunk_mask(positions_Bx1: jax.Array, at, num_cached: int, num_recent: int) -> jax.Array:
    """[B, 1, S + C] mask of step `at` of a serving chunk (its buffer: kv_writes.write_recent):
    a row at position p sees the cache's slots before its chunk began (p - at), and the
    chunk's keys 0..at."""
    start_Bx1x1 = (positions_Bx1 - at)[..., None]
    cached_Bx1xS = jnp.arange(num_cached) < start_Bx1x1
    recent_C = jnp.arange(num_recent) <= at
    recent_Bx1xC = jnp.broadcast_to(recent_C, (*start_Bx1x1.shape[:2], num_recent))
    return jnp.concatenate([cached_Bx1xS, recent_Bx1xC], axis=-1)


class CausalSelfAttention(nnx.Module):
    """Multi-head attention with fused qkv projection, as in GPT-2; with `value_embed`, a
    value-embedding table mixed into its values (model/network/value_embed.py)."""

    def __init__(self, cfg: ModelConfig, *, value_embed: bool = False, rngs: nnx.Rngs):
        self.n_head = cfg.n_head
        self.head_dim = cfg.head_dim
        self.rope_theta = cfg.rope_theta if cfg.position == "rope" else None
        self.qk_norm_eps = cfg.norm_eps if cfg.qk_norm else None
        if cfg.qk_norm_weights:  # Qwen3's q_norm/k_norm: one scale per head dimension
            self.q_norm = nnx.Param(jnp.ones(cfg.head_dim, jnp.float32))
            self.k_norm = nnx.Param(jnp.ones(cfg.head_dim, jnp.float32))
        self.c_attn = linear(cfg, cfg.n_embd, 3 * cfg.attn_width, 0.02, rngs)
        # GPT-2: residual projections scaled by 1/sqrt(2 * n_layer), two per block, so the
        # residual stream's variance does not grow with depth.
        self.c_proj = linear(cfg, cfg.attn_width, cfg.n_embd, cfg.resid_std, rngs)
        self.attn_dropout = nnx.Dropout(cfg.dropout) if cfg.dropout > 0 else None
        self.attention = cfg.attention
        self.dtype_name = cfg.dtype
        self.resid_dropout = nnx.Dropout(cfg.dropout)
        self.value_embed = ValueEmbedding(cfg, rngs=rngs) if value_embed else None

    def _attend_causal(self, q_BxTxHxD, k_BxTxHxD, v_BxTxHxD, deterministic, rngs):
        """Attention over this call's own tokens (training, evaluation, a full forward)."""
        platform, capability = backend_facts()
        implementation = choose_implementation(
            self.attention,
            platform=platform,
            compute_capability=capability,
            dtype=self.dtype_name,
            head_dim=self.head_dim,
            cached=False,
            dropout=self.attn_dropout is not None and not deterministic,
        )
        if implementation == "reference":
            mask = causal_mask(q_BxTxHxD.shape[1])
            return attend(
                q_BxTxHxD, k_BxTxHxD, v_BxTxHxD, mask,
                dropout=self.attn_dropout, deterministic=deterministic, rngs=rngs,
            )  # fmt: skip
        return attend_fused(q_BxTxHxD, k_BxTxHxD, v_BxTxHxD, implementation)

    def __call__(
        self,
        x_BxTxD: jax.Array,
        positions_BxT: jax.Array,
        *,
        cache: LayerCache | None = None,
        tokens_BxT: jax.Array | None = None,
        deterministic: bool = True,
        rngs: nnx.Rngs | None = None,
    ) -> tuple[jax.Array, LayerCache | None]:
        """Attend; with a cache, write this call's k/v at positions_T[0] and attend over it
        (in a serving chunk's step, a cache with a buffer of the chunk's own keys: write them
        there, see `kv_writes.write_recent`). tokens_BxT: the ids of this call's tokens (needed
        with a value embedding).

        positions_BxT are the absolute positions of the T tokens (consecutive), [1, T] for
        every row alike or [B, 1] for a position per row (a serving batch's decode step). The
        cache's layout is [B, H, S, Dh] (model.network.gpt.cache_layout); whatever its length
        S, a query at position p sees slots 0..p, so the caller may pass the first slots only.
        """
        b, t, d = x_BxTxD.shape
        width = self.n_head * self.head_dim  # d, unless the heads are set wider or narrower
        # Projections on [B*T, D]: XLA:CPU runs the backward of 2-D matmuls ~2.5x faster than
        # of the same matmuls with two batch dimensions.
        qkv_BxTx3D = self.c_attn(x_BxTxD.reshape(b * t, d)).reshape(b, t, 3 * width)
        q, k, v = jnp.split(qkv_BxTx3D, 3, axis=-1)
        q_BxTxHxD = q.reshape(b, t, self.n_head, self.head_dim)
        k_BxTxHxD = k.reshape(b, t, self.n_head, self.head_dim)
        v_BxTxHxD = v.reshape(b, t, self.n_head, self.head_dim)
        if self.value_embed is not None:  # before the cache write: decoding caches the mix
            v_BxTxHxD = v_BxTxHxD + self.value_embed(tokens_BxT, x_BxTxD)
        if self.qk_norm_eps is not None:  # before RoPE, as modded-nanogpt (a rotation keeps norms)
            q_BxTxHxD = rms_normalize(q_BxTxHxD, self.qk_norm_eps)
            k_BxTxHxD = rms_normalize(k_BxTxHxD, self.qk_norm_eps)
            if hasattr(self, "q_norm"):  # scaled after the cast back, as Qwen3's RMSNorm
                q_BxTxHxD = q_BxTxHxD * self.q_norm[...].astype(q_BxTxHxD.dtype)
                k_BxTxHxD = k_BxTxHxD * self.k_norm[...].astype(k_BxTxHxD.dtype)
        if self.rope_theta is not None:
            q_BxTxHxD = apply_rope(q_BxTxHxD, positions_BxT, self.rope_theta)
            k_BxTxHxD = apply_rope(k_BxTxHxD, positions_BxT, self.rope_theta)

        if cache is None:
            new_cache = None
            y_BxTxHxD = self._attend_causal(q_BxTxHxD, k_BxTxHxD, v_BxTxHxD, deterministic, rngs)
        elif "recent_k" in cache:  # a step of a serving chunk: the cache is only read
            new_cache = {
                **cache,
                "recent_k": write_recent(cache["recent_k"], k_BxTxHxD, cache["at"]),
                "recent_v": write_recent(cache["recent_v"], v_BxTxHxD, cache["at"]),
            }
            keys = (cache["k"], new_cache["recent_k"])
            values = (cache["v"], new_cache["recent_v"])
            mask = chunk_mask(positions_BxT, cache["at"], cache["k"].shape[2], keys[1].shape[2])
            y_BxTxHxD = attend(q_BxTxHxD, keys, values, mask, heads_first=True)
        else:
            keys = write_cache(cache["k"], k_BxTxHxD, positions_BxT)
            values = write_cache(cache["v"], v_BxTxHxD, positions_BxT)
            new_cache = {"k": keys, "v": values}
            # XLA's products on the cache as it lies (a position mask: no cuDNN, see above)
            mask = position_mask(positions_BxT, keys.shape[2])
            y_BxTxHxD = attend(q_BxTxHxD, keys, values, mask, heads_first=True)
        y_BxTxD = self.c_proj(y_BxTxHxD.reshape(b * t, width)).reshape(b, t, d)
        y_BxTxD = self.resid_dropout(y_BxTxD, deterministic=deterministic, rngs=rngs)
        return y_BxTxD, new_cache
