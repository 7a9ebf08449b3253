"""The GPT decoder: embeddings, pre-norm blocks, tied output layer, and an explicit KV cache.

Training calls `model(tokens)`; sampling calls `model.decode(tokens, cache, pos)` with a cache
from `model.init_cache(batch)`. Both run the same blocks; only the attention keys differ.

Example:
    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> cfg = ModelConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    >>> model = GPT(cfg, rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((2, 5), jnp.int32)).shape
    (2, 5, 64)
    >>> cache = model.init_cache(batch_size=2)
    >>> logits, cache = model.decode(jnp.zeros((2, 5), jnp.int32), cache, jnp.int32(0))
    >>> logits.shape
    (2, 5, 64)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from model.network.attention import CausalSelfAttention, LayerCache
from model.network.config import ModelConfig
from model.network.layers import linear, make_mlp, make_norm
from model.network.loss import multi_token_losses
from model.network.precision import matmul_precision, mixed_product_precision
from plumbing.errors import UsageError

KVCache = list[LayerCache]  # one {"k", "v"} dict per layer, each [B, H, S, Dh]


@jax.custom_vjp
def add_broadcast(x, y):
    """x + y, with y broadcast over x's axes where it has size 1 (learned positions [1, T, D]
    over a batch [B, T, D]). The same values and gradients as `x + y`; only the program of
    y's gradient differs on a CPU: there the sum of x's gradient over the broadcast axes is
    taken as a product with ones. XLA:CPU fuses a sum with the elementwise work that produces
    its operand (with x0-mixing, every block's share of x's gradient) and recomputed that work
    in a loop ten times slower than the same work without the sum: 2.4 ms a step of the fast
    config on a 2-core Zen 3, whose steps ran about 5% faster without it (docs/recipe.md). A
    product's operand is computed once (it is x's gradient, needed anyway). Elsewhere (chosen
    when the program is lowered) the sum stays a sum, exact in float32 at any matmul precision."""
    return x + y


def _add_broadcast_fwd(x, y):
    return x + y, y


def _add_broadcast_bwd(y, g):
    axes = [i for i, (n, m) in enumerate(zip(g.shape, y.shape, strict=True)) if m < n]

    def as_product(g):  # XLA:CPU's float32 products are float32 at every precision
        ones = jnp.ones([g.shape[a] for a in axes], g.dtype)
        return jnp.tensordot(ones, g, axes=(list(range(len(axes))), axes))

    def as_sum(g):
        return jnp.sum(g, axis=axes)

    total = jax.lax.platform_dependent(g, cpu=as_product, default=as_sum)
    return g, total.reshape(y.shape).astype(y.dtype)


add_broadcast.defvjp(_add_broadcast_fwd, _add_broadcast_bwd)


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)).

    With model.x0_mixing the block's input is first a*x + b*x0 (x0: the embedded tokens),
    learned scalars starting at (a, b) = (1, 0), so the block starts as without them. With
    model.value_embeddings, some blocks' attention has a value-embedding table, which reads
    the token ids.
    """

    def __init__(self, cfg: ModelConfig, layer_index: int, *, rngs: nnx.Rngs):
        self.x0_lambdas = nnx.Param(jnp.array([1.0, 0.0])) if cfg.x0_mixing else None
        self.ln_1 = make_norm(cfg, rngs=rngs)
        value_embed = layer_index in cfg.value_embedding_layers
        self.attn = CausalSelfAttention(cfg, value_embed=value_embed, rngs=rngs)
        self.ln_2 = make_norm(cfg, rngs=rngs)
        self.mlp = make_mlp(cfg, layer_index, rngs=rngs)

    def __call__(
        self,
        x_BxTxD: jax.Array,
        x0_BxTxD: jax.Array,
        positions_BxT: jax.Array,
        *,
        cache: LayerCache | None = None,
        tokens_BxT: jax.Array | None = None,
        deterministic: bool = True,
        rngs: nnx.Rngs | None = None,
    ) -> tuple[jax.Array, LayerCache | None, dict[str, jax.Array]]:
        if self.x0_lambdas is not None:
            a, b = self.x0_lambdas[...].astype(x_BxTxD.dtype)
            x_BxTxD = a * x_BxTxD + b * x0_BxTxD
        y, cache = self.attn(
            self.ln_1(x_BxTxD),
            positions_BxT,
            cache=cache,
            tokens_BxT=tokens_BxT,
            deterministic=deterministic,
            rngs=rngs,
        )
        x_BxTxD = x_BxTxD + y
        # The MLP is position-wise: run it on [B*T, D] (2-D matmuls; XLA:CPU runs their
        # backward ~2.5x faster than with batch dimensions, and MoE routes flat tokens).
        b, t, d = x_BxTxD.shape
        y_NxD, aux = self.mlp(
            self.ln_2(x_BxTxD).reshape(b * t, d), deterministic=deterministic, rngs=rngs
        )
        return x_BxTxD + y_NxD.reshape(b, t, d), cache, aux


class GPT(nnx.Module):
    """GPT-2-style decoder-only transformer (learned or rotary positions).

    With model.unet_skips, the outputs of blocks 0..n/2-1 are added, times a learned scalar
    each (modded-nanogpt's skip_weights, starting at 1), to the inputs of blocks n-1..n-n/2:
    block i feeds block n-1-i; an odd count leaves the middle block unpaired. With
    model.mtp_tokens, training adds multi-token heads' losses (model/network/loss.py).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        cfg = dataclasses.replace(cfg).validate()  # own copy: the caller may edit theirs
        self.cfg = cfg
        init = nnx.initializers.normal(0.02)
        # The embedding table stays float32 (also as the tied output layer); activations are
        # cast to the compute dtype after the lookup.
        self.wte = nnx.Embed(cfg.vocab_size, cfg.n_embd, embedding_init=init, rngs=rngs)
        if cfg.position == "learned":
            self.wpe = nnx.Embed(cfg.block_size, cfg.n_embd, embedding_init=init, rngs=rngs)
        else:
            self.wpe = None
        self.drop = nnx.Dropout(cfg.dropout)
        self.blocks = nnx.List([Block(cfg, i, rngs=rngs) for i in range(cfg.n_layer)])
        skips = cfg.n_unet_skips
        self.skip_weights = nnx.Param(jnp.ones(skips, jnp.float32)) if skips else None
        heads = [linear(cfg, cfg.n_embd, cfg.n_embd, 0.02, rngs) for _ in range(cfg.mtp_tokens)]
        self.mtp_heads = nnx.List(heads) if heads else None
        self.ln_f = make_norm(cfg, rngs=rngs)
        # Untied: a separate output layer [D, V] (no bias, as GPT-2's lm_head).
        self.lm_head = (
            None
            if cfg.tie_embeddings
            else nnx.Linear(cfg.n_embd, cfg.vocab_size, use_bias=False, kernel_init=init, rngs=rngs)
        )

    # -- public API -------------------------------------------------------------------------

    def __call__(
        self, tokens_BxT: jax.Array, *, deterministic: bool = True, rngs: nnx.Rngs | None = None
    ) -> jax.Array:
        """Logits [B, T, V] in float32 for every position (causal)."""
        x_BxTxD, _ = self._hidden_with_aux(tokens_BxT, deterministic, rngs)
        return self.unembed(x_BxTxD)

    def forward_with_aux(
        self, tokens_BxT: jax.Array, *, deterministic: bool = True, rngs: nnx.Rngs | None = None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Logits [B, T, V] float32 and auxiliary losses summed over blocks (empty if dense),
        with model.mtp_tokens also the multi-token losses (`mtp_loss`, `mtp_ce`). A jitted
        caller that uses only the logits (evaluation) pays for none of those: XLA drops them.

        Dropout is active only with deterministic=False, and then needs rngs with a "dropout"
        stream, e.g. `nnx.Rngs(dropout=jax.random.fold_in(key, step))` so resumed runs replay.
        """
        x_BxTxD, aux = self._hidden_with_aux(tokens_BxT, deterministic, rngs)
        if self.mtp_heads is not None:
            with matmul_precision(self.cfg.matmul_precision):
                aux = {**aux, **multi_token_losses(self, x_BxTxD, tokens_BxT)}
        return self.unembed(x_BxTxD), aux

    def hidden_states(self, tokens_BxT: jax.Array) -> jax.Array:
        """Final-normed hidden states [B, T, D] (compute dtype), no dropout; `unembed` maps
        them to logits. Lets a caller project only the positions it needs."""
        return self._hidden_with_aux(tokens_BxT, True, None)[0]

    def unembed(self, x_BxTxD: jax.Array, head_DxV: jax.Array | None = None) -> jax.Array:
        """Output layer (the tied embedding, or lm_head): logits [B, T, V] float32 from final
        hidden states. `head_DxV`: the tied embedding as a [D, V] copy (`decoding_head`),
        used in its place for a product of several rows (B * T > 1); one row keeps the
        embedding as it lies (as fast, and the same bits as without a copy).

        Not `wte.attend`: that would promote both operands to one dtype, while we want
        compute-dtype operands (bf16 matmul speed) with float32 accumulation and logits.
        With model.logit_softcap c > 0, logits are c * tanh(logits / c): within (-c, c).
        """
        if head_DxV is not None and x_BxTxD.shape[0] * x_BxTxD.shape[1] > 1:
            weight, spec = head_DxV, "btd,dv->btv"
        elif self.lm_head is not None:
            weight, spec = self.lm_head.kernel[...], "btd,dv->btv"  # [D, V]
        else:
            weight, spec = self.wte.embedding[...], "btd,vd->btv"  # [V, D]
        # bf16: bf16 operands, float32 accumulation, also in the backward pass, which meets the
        # float32 gradient of the logits (model/network/precision.py).
        with matmul_precision(self.cfg.matmul_precision):
            logits = jnp.einsum(
                spec,
                x_BxTxD,
                weight.astype(x_BxTxD.dtype),
                preferred_element_type=jnp.float32,
                precision=mixed_product_precision(x_BxTxD.dtype),
            )
        cap = self.cfg.logit_softcap
        return cap * jnp.tanh(logits / cap) if cap > 0 else logits

    def init_cache(self, batch_size: int, max_len: int | None = None) -> KVCache:
        """Zeroed KV cache: per layer {"k", "v"} of shape [B, max_len, H, Dh], compute dtype.

        max_len defaults to block_size; with learned positions it cannot exceed it.
        """
        max_len = self.cfg.block_size if max_len is None else max_len
        if max_len <= 0 or (self.cfg.position == "learned" and max_len > self.cfg.block_size):
            raise UsageError(
                f"cache length {max_len} must be in 1..block_size={self.cfg.block_size} "
                "with learned positions"
            )
        return jax.tree.map(
            lambda s: jnp.zeros(s.shape, s.dtype), cache_layout(self.cfg, batch_size, max_len)
        )

    def decoding_head(self) -> jax.Array | None:
        """The tied embedding transposed, [D, V], as an array of its own, for `decode`'s
        `head_DxV` on a CPU; None for an untied lm_head (already [D, V]) or off a CPU. XLA:CPU
        multiplies 2 - 16 rows by a [V, D] operand, contracting its last axis, 2 - 20 times
        slower than by a [D, V] one (the 11M model's 1,024 x 384: 0.37 against 0.16 ms a
        step at 16 rows; GPT-2's 50,257 x 768: 36 against 12 ms, and 102 against 13 at 4
        rows; docs/serving.md). One row is about as fast either way. It costs one more copy
        of the embedding."""
        weight = self.wte.embedding[...]
        if self.lm_head is not None or {d.platform for d in weight.devices()} != {"cpu"}:
            return None
        return jnp.transpose(weight)  # called eagerly: a buffer of its own, laid out [D, V]

    def decode(
        self,
        tokens_BxT: jax.Array,
        cache: KVCache,
        pos: jax.Array | int,
        *,
        last_only=False,
        head_DxV: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """Run T new tokens at absolute positions pos..pos+T-1 against the cache; `pos` is one
        position for every row, or a position per row ([B], with T = 1: a serving batch, whose
        rows are different requests at their own lengths).

        Writes their k/v into the cache and returns (logits [B, T, V] float32, new cache);
        with last_only, logits [B, 1, V] of the last token only (prefill skips the rest);
        with head_DxV (`decoding_head`), the output layer multiplies by it.
        Each query attends to cache slots <= its own position. The caller keeps
        pos + T <= cache length (dynamic_update_slice would clamp the write otherwise).
        Inference only: no dropout.
        """
        t = tokens_BxT.shape[1]
        pos_B = jnp.reshape(jnp.asarray(pos, jnp.int32), (-1, 1))  # [1, 1]: every row alike
        positions_BxT = pos_B + jnp.arange(t, dtype=jnp.int32)
        x_BxTxD, new_cache, _ = self._run(tokens_BxT, positions_BxT, cache, True, None)
        if last_only:
            x_BxTxD = x_BxTxD[:, -1:]
        return self.unembed(x_BxTxD, head_DxV), new_cache

    # -- internals --------------------------------------------------------------------------

    def _hidden_with_aux(
        self, tokens_BxT: jax.Array, deterministic: bool, rngs: nnx.Rngs | None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        t = tokens_BxT.shape[1]
        if t > self.cfg.block_size:
            raise UsageError(
                f"sequence of {t} tokens is longer than the model's context "
                f"(block_size={self.cfg.block_size})"
            )
        positions_BxT = jnp.arange(t, dtype=jnp.int32)[None]
        x_BxTxD, _, aux = self._run(tokens_BxT, positions_BxT, None, deterministic, rngs)
        return x_BxTxD, aux

    def _run(
        self,
        tokens_BxT: jax.Array,
        positions_BxT: jax.Array,
        cache: KVCache | None,
        deterministic: bool,
        rngs: nnx.Rngs | None,
    ) -> tuple[jax.Array, KVCache | None, dict[str, jax.Array]]:
        """Hidden states after the final norm [B, T, D], the updated cache, aux losses."""
        x_BxTxD = self.wte(tokens_BxT)
        if self.wpe is not None:
            x_BxTxD = add_broadcast(x_BxTxD, self.wpe(positions_BxT))
        x_BxTxD = self.drop(x_BxTxD, deterministic=deterministic, rngs=rngs)
        x_BxTxD = x_BxTxD.astype(self.cfg.compute_dtype)
        x0_BxTxD = x_BxTxD

        aux: dict[str, jax.Array] = {}
        new_cache: KVCache | None = None if cache is None else []
        n, n_skips, skips = self.cfg.n_layer, self.cfg.n_unet_skips, []  # U-net: first half's
        with matmul_precision(self.cfg.matmul_precision):  # every product of the blocks
            for i, block in enumerate(self.blocks):
                if i >= n - n_skips:  # mirrored block n-1-i of the first half feeds this one
                    weight = self.skip_weights[n - 1 - i].astype(x_BxTxD.dtype)
                    x_BxTxD = x_BxTxD + weight * skips[n - 1 - i]
                layer_cache = None if cache is None else cache[i]
                x_BxTxD, layer_cache, block_aux = block(
                    x_BxTxD,
                    x0_BxTxD,
                    positions_BxT,
                    cache=layer_cache,
                    tokens_BxT=tokens_BxT,
                    deterministic=deterministic,
                    rngs=rngs,
                )
                if i < n_skips:
                    skips.append(x_BxTxD)
                if new_cache is not None:
                    new_cache.append(layer_cache)
                for name, value in block_aux.items():
                    aux[name] = aux.get(name, 0.0) + value

        return self.ln_f(x_BxTxD), new_cache, aux


def cache_layout(cfg: ModelConfig, batch_size: int, max_len: int | None = None) -> KVCache:
    """The KV cache's shapes and dtype (ShapeDtypeStructs): per layer {"k", "v"} of
    [B, H, max_len (default block_size), Dh] in the compute dtype, heads first so that a decode
    step reads each head's keys as they lie. The one place the layout is written; every cache
    (decoding, the serving batch, abstract programs) is built from it."""
    shape = (batch_size, cfg.n_head, max_len or cfg.block_size, cfg.head_dim)
    leaf = jax.ShapeDtypeStruct(shape, cfg.compute_dtype)
    return [{"k": leaf, "v": leaf} for _ in range(cfg.n_layer)]


def count_params(model: nnx.Module) -> int:
    """Number of trainable parameters (a tied embedding counted once)."""
    params = nnx.state(model, nnx.Param)
    return sum(int(x.size) for x in jax.tree.leaves(params))


def flops_per_token(cfg: ModelConfig, n_params: int | None = None) -> float:
    """Training FLOPs per token (forward + backward) at full context, for MFU. `n_params`:
    the model's count_params where the caller has it (the trainer does); without it, an
    abstract model is traced to count them (about half a second).

    nanoGPT's estimate_mfu (PaLM appendix B): 6 * N + 12 * L * H * Dh * T, where N counts
    parameters except the position embedding (it does no matmul; the token embedding does
    when tied, as the output layer; untied, its lookup is no matmul either and the separate
    output layer counts instead), 6N is the matmul work of forward (2N) and backward (4N), and
    the second term is attention's q·k and probs·v over a context of T = block_size.

    Example:
        >>> cfg = ModelConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
        >>> flops_per_token(cfg) > 0
        True
        >>> top2 = [flops_per_token(dataclasses.replace(cfg, moe_experts=e)) for e in (2, 8)]
        >>> top2[1] - top2[0] == 6 * 2 * 32 * 6  # 2 of 8 experts run: only the routers grow
        True
    """
    n = n_params
    if n is None:
        n = count_params(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))))
    if cfg.position == "learned":
        n -= cfg.block_size * cfg.n_embd
    if not cfg.tie_embeddings:
        n -= cfg.vocab_size * cfg.n_embd
    # Value-embedding tables are lookups (as nanochat's estimate_flops excludes them); each
    # multi-token head runs the output layer once more, beyond its own Linear.
    n -= len(cfg.value_embedding_layers) * cfg.vocab_size * cfg.attn_width
    n += cfg.mtp_tokens * cfg.vocab_size * cfg.n_embd
    # A token runs its top-k experts, not all of them: the model's FLOPs count those (as
    # MaxText's MFU does), whatever padding to capacity the layer computes besides.
    n -= cfg.n_moe_layers * max(cfg.moe_experts - cfg.moe_top_k, 0) * cfg.expert_params
    return 6.0 * n + 12.0 * cfg.n_layer * cfg.n_head * cfg.head_dim * cfg.block_size
