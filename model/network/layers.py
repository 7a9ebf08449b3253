"""Norms and feed-forward layers, and the factories the block builds them with.

Every MLP returns `(y, aux)` where aux is a dict of auxiliary losses (empty for dense MLPs).
That is the seam for mixture of experts: an MoE MLP returns its load-balancing and router
z-losses there, and `make_mlp` decides which blocks get one.

Example:
    >>> from model.network.config import ModelConfig
    >>> cfg = ModelConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    >>> mlp = make_mlp(cfg, layer_index=0, rngs=nnx.Rngs(0))
    >>> y, aux = mlp(jnp.ones((1, 4, 32)))
    >>> y.shape, aux
    ((1, 4, 32), {})
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from model.network.activations import activation_fn
from model.network.config import ModelConfig
from model.network.moe import MoEMLP
from model.network.precision import bf16_operand_dot_general, bf16_operand_linears


def make_norm(cfg: ModelConfig, *, rngs: nnx.Rngs) -> nnx.Module:
    """LayerNorm (bias per cfg.bias) or RMSNorm over the model width, epsilon cfg.norm_eps."""
    if cfg.norm == "rmsnorm":
        return nnx.RMSNorm(
            cfg.n_embd,
            epsilon=cfg.norm_eps,
            dtype=cfg.compute_dtype,
            param_dtype=jnp.float32,
            rngs=rngs,
        )
    return nnx.LayerNorm(
        cfg.n_embd,
        epsilon=cfg.norm_eps,
        use_bias=cfg.bias,
        dtype=cfg.compute_dtype,
        param_dtype=jnp.float32,
        rngs=rngs,
    )


def linear(cfg: ModelConfig, n_in: int, n_out: int, std: float, rngs: nnx.Rngs) -> nnx.Linear:
    """A Linear in the model's compute dtype with float32 params, N(0, std) kernel, zero bias;
    in a float32 model, its product's operands as model.linear_operands says."""
    product = {"dot_general": bf16_operand_dot_general} if bf16_operand_linears(cfg) else {}
    return nnx.Linear(
        n_in,
        n_out,
        use_bias=cfg.bias,
        dtype=cfg.compute_dtype,
        param_dtype=jnp.float32,
        kernel_init=nnx.initializers.normal(std),
        bias_init=nnx.initializers.zeros,
        rngs=rngs,
        **product,
    )


def store_bf16_operand_kernels(model) -> None:
    """For sampling, not training: keep the kernels of the Linear layers whose products take
    bf16 operands as bf16. Those products cast them to bf16 anyway, so the values are the
    same, bit for bit; a decode step reads half the bytes and casts nothing (on AMX the 11M
    model's 16-row step 4.3 ms against 6.4, docs/serving.md). Other kernels (an untied
    output layer, quantized layers) keep their dtype."""
    for _, module in nnx.iter_graph(model):
        if isinstance(module, nnx.Linear) and module.dot_general is bf16_operand_dot_general:
            module.kernel.set_value(module.kernel[...].astype(jnp.bfloat16))


class DenseMLP(nnx.Module):
    """GPT-2 MLP: Linear(D, F) -> activation -> Linear(F, D), F = cfg.mlp_width (4D by
    default). The activation is GELU per cfg.gelu (default exact erf as nanoGPT's nn.GELU;
    GPT-2's own weights were trained with the tanh form), or relu(x)**2 with cfg.mlp =
    "relu2"."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.activation = activation_fn(cfg.mlp, cfg.gelu)
        self.c_fc = linear(cfg, cfg.n_embd, cfg.mlp_width, 0.02, rngs)
        self.c_proj = linear(cfg, cfg.mlp_width, cfg.n_embd, cfg.resid_std, rngs)
        self.dropout = nnx.Dropout(cfg.dropout)

    def __call__(
        self, x_BxTxD: jax.Array, *, deterministic: bool = True, rngs: nnx.Rngs | None = None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        h_BxTxF = self.activation(self.c_fc(x_BxTxD))
        y_BxTxD = self.dropout(self.c_proj(h_BxTxF), deterministic=deterministic, rngs=rngs)
        return y_BxTxD, {}


class SwiGLUMLP(nnx.Module):
    """Gated MLP (Shazeer 2020, Llama): down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        hidden = cfg.mlp_width
        self.gate = linear(cfg, cfg.n_embd, hidden, 0.02, rngs)
        self.up = linear(cfg, cfg.n_embd, hidden, 0.02, rngs)
        self.c_proj = linear(cfg, hidden, cfg.n_embd, cfg.resid_std, rngs)
        self.dropout = nnx.Dropout(cfg.dropout)

    def __call__(
        self, x_BxTxD: jax.Array, *, deterministic: bool = True, rngs: nnx.Rngs | None = None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        h_BxTxF = jax.nn.silu(self.gate(x_BxTxD)) * self.up(x_BxTxD)
        y_BxTxD = self.dropout(self.c_proj(h_BxTxF), deterministic=deterministic, rngs=rngs)
        return y_BxTxD, {}


def make_mlp(cfg: ModelConfig, layer_index: int, *, rngs: nnx.Rngs) -> nnx.Module:
    """The feed-forward layer of block `layer_index`: dense GELU, ReLU² or SwiGLU, or with
    cfg.moe_experts > 0 a mixture of such experts in every cfg.moe_every-th block
    (blocks moe_every-1, 2*moe_every-1, ...; see model.network.moe)."""
    if cfg.is_moe_layer(layer_index):
        return MoEMLP(cfg, hidden=cfg.expert_width, rngs=rngs)
    if cfg.mlp == "swiglu":
        return SwiGLUMLP(cfg, rngs=rngs)
    return DenseMLP(cfg, rngs=rngs)
