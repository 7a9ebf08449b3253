"""Mixture of experts: a softmax router sends each token to its top-k experts (k from 1 to E).

The routing math is pure functions on flat tokens [N, D] (N = B*T); `MoEMLP` owns the weights:
the router [D, E] and the experts stacked along a leading E axis ([E, D, F], [E, F, D]), so
one batched einsum runs every expert and `model.processes.mesh` can shard experts over devices.

Dispatch uses fixed-capacity buffers (Switch / GShard / MaxText): each expert takes at most C
token-slots; a token's slot in expert e is its rank among the tokens routed to e (one-hot +
cumsum, every token's first choice ranked before any second choice); tokens are scattered into
[E, C, D], the experts run, and outputs are gathered back and mixed with the router weights.
Fixed shapes keep one compilation, and on CPU this was measured ~5x faster than running every
expert on every token.

Capacity policy:
  - training (deterministic=False): C = ceil(N*k/E * moe_capacity_factor), at most N. Slots
    past C are dropped: that expert adds nothing, and a token with all its slots dropped gets
    MLP output 0, so the residual stream carries it through the block unchanged. The dropped
    share of token-slots is returned as `moe_dropped_frac` and logged.
  - moe_capacity_factor = 0, and every deterministic=True call (evaluation, the KV-cache path,
    sampling): dropless, C = N. An expert receives at most one slot per token, so nothing can
    overflow; routing then never depends on which other tokens share the batch, which is
    what makes cached decoding equal the full forward pass.

Losses (returned already weighted, averaged over the model's MoE layers so their scale does
not grow with depth; `Trainer` adds entries named *_loss to the objective):
  - `moe_aux_loss`: Switch load balancing E * sum_e f_e * P_e, f_e the share of token-slots
    routed to e, P_e the mean router probability of e; 1 when routing is uniform.
  - `moe_z_loss`: ST-MoE router z-loss, mean over tokens of logsumexp(router logits)^2; keeps
    logits small so the fp32 softmax stays well conditioned.

Example:
    >>> import jax.numpy as jnp
    >>> probs_NxE = jnp.array([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3]])
    >>> weights_NxK, experts_NxK = top_k_routing(probs_NxE, 2)
    >>> experts_NxK.tolist(), weights_NxK.sum(-1).round(6).tolist()
    ([[1, 2], [0, 2]], [1.0, 1.0])
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from model.network.activations import activation_fn
from model.network.config import ModelConfig

# Parameters whose leading axis indexes experts: model.processes.mesh shards them over devices.
EXPERT_PARAM_PREFIX = "expert_"

# -- routing math ------------------------------------------------------------------------------


def router_probs(logits_NxE: jax.Array) -> jax.Array:
    """Softmax over experts in float32 (bf16 logits would blur close routing decisions)."""
    return jax.nn.softmax(logits_NxE.astype(jnp.float32), axis=-1)


def top_k_routing(probs_NxE: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The k most probable experts per token and their weights renormalised to sum to 1.

    Returns (weights_NxK float32, experts_NxK int32), best expert first. With k = 1 the
    renormalised weight is the constant 1, which would cut the router off from the language-
    model loss; its value stays exactly 1 but its gradient is that of the raw probability p
    (straight-through: p + stop_gradient(1 - p)), as in Switch Transformer.

        >>> w, e = top_k_routing(jnp.array([[0.2, 0.8]]), 1)
        >>> w.tolist(), e.tolist()
        ([[1.0]], [[1]])
    """
    top_NxK, experts_NxK = jax.lax.top_k(probs_NxE, k)
    if k == 1:
        return top_NxK + jax.lax.stop_gradient(1.0 - top_NxK), experts_NxK
    return top_NxK / top_NxK.sum(axis=-1, keepdims=True), experts_NxK


def expert_capacity(n_tokens: int, n_experts: int, k: int, capacity_factor: float) -> int:
    """Token-slots per expert: ceil(N*k/E * factor) clipped to [1, N]; factor 0 = dropless (N).

    >>> expert_capacity(64, 4, 2, 1.25), expert_capacity(64, 4, 2, 0.0)
    (40, 64)
    """
    if capacity_factor <= 0:
        return n_tokens
    return max(1, min(n_tokens, math.ceil(n_tokens * k / n_experts * capacity_factor)))


def capacity_slots(
    experts_NxK: jax.Array, n_experts: int, capacity: int
) -> tuple[jax.Array, jax.Array]:
    """Each token-slot's position in its expert's buffer, and whether it fits (slot < C).

    Positions count the earlier slots routed to the same expert, first choices of all tokens
    before any second choice (so overflow drops second choices first), then in token order.

        >>> slot, keep = capacity_slots(jnp.array([[0], [1], [0], [0]]), 2, capacity=2)
        >>> slot[:, 0].tolist(), keep[:, 0].tolist()
        ([0, 0, 1, 2], [True, True, True, False])
    """
    n, k = experts_NxK.shape
    experts_KN = experts_NxK.T.reshape(-1)  # choice-rank major
    onehot_KNxE = jax.nn.one_hot(experts_KN, n_experts, dtype=jnp.int32)
    position_KNxE = jnp.cumsum(onehot_KNxE, axis=0) - 1
    slot_KN = jnp.sum(position_KNxE * onehot_KNxE, axis=-1)
    slot_NxK = slot_KN.reshape(k, n).T
    return slot_NxK, slot_NxK < capacity


def load_balance_loss(probs_NxE: jax.Array, experts_NxK: jax.Array) -> jax.Array:
    """Switch Transformer's auxiliary loss E * sum_e f_e * P_e (1 for uniform routing).

    f_e: share of all token-slots routed to expert e (counts, no gradient); P_e: mean router
    probability of e (differentiable), so the gradient lowers the probability of busy experts.

        >>> probs_NxE = jnp.full((4, 2), 0.5)
        >>> float(load_balance_loss(probs_NxE, jnp.array([[0], [0], [0], [1]])))
        1.0
    """
    n_experts = probs_NxE.shape[-1]
    counts_E = jax.nn.one_hot(experts_NxK, n_experts, dtype=jnp.float32).sum(axis=(0, 1))
    f_E = counts_E / experts_NxK.size
    p_E = probs_NxE.mean(axis=0)
    return n_experts * jnp.sum(f_E * p_E)


def router_z_loss(logits_NxE: jax.Array) -> jax.Array:
    """ST-MoE router z-loss: mean over tokens of logsumexp(logits)^2.

    >>> float(router_z_loss(jnp.zeros((3, 4))))  # log(4)^2
    1.921812...
    """
    z_N = jax.nn.logsumexp(logits_NxE.astype(jnp.float32), axis=-1)
    return jnp.mean(z_N**2)


# -- the layer ---------------------------------------------------------------------------------


class MoEMLP(nnx.Module):
    """Top-k mixture of GELU (or SwiGLU, per cfg.mlp) experts of width `hidden` on flat
    tokens [N, D].

    Returns (y_NxD, aux) with aux = {"moe_aux_loss", "moe_z_loss", "moe_dropped_frac"}.

        >>> cfg = ModelConfig(vocab_size=64, n_layer=1, n_head=2, n_embd=8, moe_experts=4)
        >>> moe = MoEMLP(cfg, hidden=16, rngs=nnx.Rngs(0))
        >>> y, aux = moe(jnp.ones((6, 8)))
        >>> y.shape, sorted(aux)
        ((6, 8), ['moe_aux_loss', 'moe_dropped_frac', 'moe_z_loss'])
    """

    def __init__(self, cfg: ModelConfig, hidden: int, *, rngs: nnx.Rngs):
        e, d, f = cfg.moe_experts, cfg.n_embd, hidden
        self.n_experts, self.top_k, self.swiglu = e, cfg.moe_top_k, cfg.mlp == "swiglu"
        self.capacity_factor = cfg.moe_capacity_factor
        self.activation = activation_fn(cfg.mlp, cfg.gelu)
        self.dtype = cfg.compute_dtype
        # Each layer adds 1/n_layers of the weighted losses: gpt.py sums aux over blocks, so
        # the logged values are layer means and the weights do not scale with depth.
        per_layer = 1.0 / max(cfg.n_moe_layers, 1)
        self.aux_weight = cfg.moe_aux_weight * per_layer
        self.z_weight = cfg.moe_z_weight * per_layer
        self.layer_share = per_layer
        normal = nnx.initializers.normal
        # Not an nnx.Linear named `kernel`: the router stays float32 (no PTQ/QAT), as routers do.
        self.router = nnx.Param(normal(0.02)(rngs.params(), (d, e), jnp.float32))
        # SwiGLU experts: gate and up projections (each with a bias when cfg.bias, as the dense
        # SwiGLUMLP); GELU experts: one fc projection.
        self.in_names = ("gate", "up") if self.swiglu else ("fc",)
        for name in self.in_names:
            kernel = normal(0.02)(rngs.params(), (e, d, f), jnp.float32)
            setattr(self, f"expert_{name}", nnx.Param(kernel))
            bias = nnx.Param(jnp.zeros((e, f), jnp.float32)) if cfg.bias else None
            setattr(self, f"expert_{name}_bias", bias)
        self.expert_proj = nnx.Param(normal(cfg.resid_std)(rngs.params(), (e, f, d), jnp.float32))
        self.expert_proj_bias = nnx.Param(jnp.zeros((e, d), jnp.float32)) if cfg.bias else None
        self.dropout = nnx.Dropout(cfg.dropout)

    def __call__(
        self, x_NxD: jax.Array, *, deterministic: bool = True, rngs: nnx.Rngs | None = None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        n, d = x_NxD.shape
        logits_NxE = x_NxD.astype(jnp.float32) @ self.router[...]
        probs_NxE = router_probs(logits_NxE)
        weights_NxK, experts_NxK = top_k_routing(probs_NxE, self.top_k)

        factor = 0.0 if deterministic else self.capacity_factor
        capacity = expert_capacity(n, self.n_experts, self.top_k, factor)
        slot_NxK, keep_NxK = capacity_slots(experts_NxK, self.n_experts, capacity)
        # Dropped slots point past the buffer: the scatter skips them, the gather reads 0.
        slot_NxK = jnp.where(keep_NxK, slot_NxK, capacity)

        x_NxKxD = jnp.broadcast_to(x_NxD.astype(self.dtype)[:, None], (n, self.top_k, d))
        buf_ExCxD = jnp.zeros((self.n_experts, capacity, d), self.dtype)
        buf_ExCxD = buf_ExCxD.at[experts_NxK, slot_NxK].set(x_NxKxD, mode="drop")
        y_ExCxD = self._experts(buf_ExCxD)
        y_NxKxD = y_ExCxD.at[experts_NxK, slot_NxK].get(mode="fill", fill_value=0)
        gate_NxK = (weights_NxK * keep_NxK).astype(self.dtype)
        y_NxD = jnp.einsum("nkd,nk->nd", y_NxKxD, gate_NxK)
        y_NxD = self.dropout(y_NxD, deterministic=deterministic, rngs=rngs)

        aux = {
            "moe_aux_loss": self.aux_weight * load_balance_loss(probs_NxE, experts_NxK),
            "moe_z_loss": self.z_weight * router_z_loss(logits_NxE),
            "moe_dropped_frac": self.layer_share * jnp.mean(~keep_NxK, dtype=jnp.float32),
        }
        return y_NxD, aux

    def _experts(self, x_ExCxD: jax.Array) -> jax.Array:
        """Every expert's MLP on its own buffer: batched einsums over the expert axis."""

        def project(name: str, x_ExCxI: jax.Array, spec: str) -> jax.Array:
            out = jnp.einsum(spec, x_ExCxI, getattr(self, name)[...].astype(self.dtype))
            bias = getattr(self, f"{name}_bias")
            return out if bias is None else out + bias[...].astype(self.dtype)[:, None]

        if self.swiglu:
            gate_ExCxF = project("expert_gate", x_ExCxD, "ecd,edf->ecf")
            h_ExCxF = jax.nn.silu(gate_ExCxF) * project("expert_up", x_ExCxD, "ecd,edf->ecf")
        else:
            h_ExCxF = self.activation(project("expert_fc", x_ExCxD, "ecd,edf->ecf"))
        y_ExCxD = project("expert_proj", h_ExCxF, "ecf,efd->ecd")
        return y_ExCxD
