"""The model's hyperparameters: one typed, validated dataclass.

Example:
    >>> cfg = ModelConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32)
    >>> cfg.validate() is cfg
    True
    >>> cfg.head_dim
    16
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from plumbing import checks
from plumbing.errors import UsageError
from plumbing.typed_data import from_plain

NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu", "relu2")
POSITIONS = ("learned", "rope")
DTYPES = ("float32", "bfloat16")  # names only: configs load without importing JAX
GELUS = ("exact", "tanh")
ATTENTIONS = ("auto", "xla", "cudnn", "reference")
MATMUL_PRECISIONS = ("default", "high", "highest")  # model/network/precision.py
LINEAR_OPERANDS = ("float32", "bfloat16", "auto")  # model/network/precision.py
# Fields that choose how the same function is computed, not which function: a checkpoint
# trained with one value runs with any other (model/training/resume.py `check_compatible`).
IMPLEMENTATION_FIELDS = ("dropout", "dtype", "attention", "matmul_precision", "linear_operands")

# Plain upper bounds, far above any model this project trains, that keep a typo such as
# n_layer=1e30 from hanging construction (model/training/memory.py has the fine check).
MAX_DIM = 2**31 - 1  # token ids, positions and widths are int32 in JAX
MAX_LAYERS = 1024
MAX_EXPERTS = 1024
MAX_PARAMS = 10**12


# unsafe_hash: the config is static data of the model's graphdef, which jit hashes as a static
# argument; the model keeps its own copy, so later edits of the caller's config are harmless.
@dataclass(unsafe_hash=True)
class ModelConfig:
    # Number of token ids the embedding and the output layer cover; 0 in a config file, where
    # it is not known until the tokenizer exists (the train stage fills it in).
    vocab_size: int = 0
    block_size: int = 256  # context length: the most tokens the model attends over at once
    n_layer: int = 6  # number of transformer blocks
    n_head: int = 6  # attention heads per block; n_embd must be a multiple of it
    n_embd: int = 384  # width of the residual stream (defaults: nanoGPT's Shakespeare model)
    # Width of one attention head; 0 = n_embd / n_head (then n_embd must be a multiple of
    # n_head). Wider heads than the stream split into (Qwen3-0.6B: 16 heads of 128 on 1024).
    attn_head_dim: int = 0
    dropout: float = 0.0  # dropout rate on embeddings, attention weights and residual branches
    bias: bool = False  # biases in Linear and LayerNorm layers (GPT-2 had them)
    norm: str = "layernorm"  # "layernorm" | "rmsnorm" (pre-norm, before each sub-block)
    # "gelu" (4x hidden, exact erf GELU as nanoGPT) | "swiglu" (Llama) | "relu2" (4x hidden,
    # relu(x)**2: modded-nanogpt, nanochat)
    mlp: str = "gelu"
    # Hidden width of the dense MLP (and of experts, unless moe_hidden says otherwise); 0 = the
    # default of model.mlp: 4*n_embd, or for SwiGLU 8/3*n_embd rounded up to a multiple of 8
    # (Llama's rule). Imported Llama/Qwen3 checkpoints set their own (intermediate_size).
    mlp_hidden: int = 0
    gelu: str = "exact"  # GELU form: "exact" (erf, nanoGPT's nn.GELU) | "tanh" (GPT-2's gelu_new)
    norm_eps: float = 1e-5  # epsilon of LayerNorm / RMSNorm (GPT-2: layer_norm_epsilon 1e-5)
    # Output layer = the token embedding (GPT-2, nanoGPT); false adds a separate [D, V] layer.
    tie_embeddings: bool = True
    position: str = "learned"  # "learned" absolute embeddings | "rope" rotary on q and k
    rope_theta: float = 10000.0  # RoPE base: wavelengths grow geometrically up to 2*pi*theta
    # The modern recipe (modded-nanogpt, nanochat; docs/training.md has what each did here).
    qk_norm: bool = False  # RMS-normalise each head's queries and keys (no weights) before q.k
    # With qk_norm: a learned scale per head dimension after the normalisation, shared by the
    # heads (Qwen3's q_norm/k_norm, OLMo 2); false = weightless, as modded-nanogpt.
    qk_norm_weights: bool = False
    zero_init_proj: bool = False  # residual projections (attention, MLP) start at zero
    logit_softcap: float = 0.0  # logits = c * tanh(logits / c); 0 = off (nanochat: 15)
    # Each block's input becomes a*x + b*x0, x0 = the embedded tokens, with learned scalars
    # (a, b) per block starting at (1, 0): modded-nanogpt's residual mixing with the input.
    x0_mixing: bool = False
    # Value embeddings (nanochat's ResFormer-style value residual): alternating blocks, the last
    # included, get a token-embedding table of their own, mixed into the attention values as
    # v + 2*sigmoid(gate) * table[token], the gate per head from the block's input.
    value_embeddings: bool = False
    # U-net skips (modded-nanogpt): the outputs of the first n_layer // 2 blocks are added, each
    # with a learned scalar weight starting at 1, to the inputs of the mirrored blocks of the
    # second half (block i to block n_layer-1-i; an odd count leaves the middle block unpaired).
    unet_skips: bool = False
    # Multi-token prediction (Gloeckle et al. 2024, DeepSeek-V3): in training, k extra heads
    # (one Linear n_embd -> n_embd each, then the shared output layer) predict the tokens
    # 2..k+1 ahead; 0 = off. Their mean cross-entropy times mtp_weight (DeepSeek-V3's 0.3)
    # joins the objective; the logits, evaluation and decoding are the plain model's.
    mtp_tokens: int = 0
    mtp_weight: float = 0.3
    moe_experts: int = 0  # experts per MoE layer; 0 = dense MLP everywhere
    moe_top_k: int = 2  # experts each token is routed to (when moe_experts > 0)
    moe_every: int = 1  # an MoE MLP replaces the dense MLP in every k-th block
    moe_hidden: int = 0  # expert hidden width; 0 = the dense MLP's (4*n_embd, SwiGLU 8/3*n_embd)
    moe_aux_weight: float = 0.01  # weight of the Switch load-balancing loss (1 when balanced)
    moe_z_weight: float = 0.001  # weight of the router z-loss, mean logsumexp(router logits)^2
    moe_capacity_factor: float = 1.25  # training slots per expert / (tokens*k/E); 0 = dropless
    dtype: str = "float32"  # compute dtype: "float32" | "bfloat16"; params always float32
    # Attention kernel: "auto" (cuDNN flash attention on NVIDIA GPUs in bf16, else XLA's
    # jax.nn.dot_product_attention) | "xla" | "cudnn" | "reference" (our einsum form).
    # Same values whichever runs (model/network/attention.py); not part of a checkpoint's identity.
    attention: str = "auto"
    # What a float32 matrix product computes on GPU/TPU: "default" (TF32 on NVIDIA Ampere and
    # later, one bf16 pass on TPU, float32 on CPU) | "high" (TPU: three bf16 passes) |
    # "highest" (float32 everywhere, slower). bf16 products are bf16 x bf16 with float32
    # accumulation whatever this says (model/network/precision.py).
    matmul_precision: str = "default"
    # The blocks' Linear layers in a float32 model: "float32" operands | "bfloat16" operands
    # with float32 accumulation (the rest stays float32) | "auto": bfloat16 on a CPU with AMX,
    # where such products run 2-3x faster, float32 elsewhere. bf16 models ignore it.
    linear_operands: str = "float32"

    @property
    def head_dim(self) -> int:
        """Width of one attention head: model.attn_head_dim, or n_embd // n_head."""
        return self.attn_head_dim or self.n_embd // self.n_head

    @property
    def attn_width(self) -> int:
        """Width of the queries (and keys, values) of all heads: n_head * head_dim."""
        return self.n_head * self.head_dim

    @property
    def resid_std(self) -> float:
        """Init std of the projections back into the residual stream: GPT-2 scales them by
        1/sqrt(2 * n_layer); with zero_init_proj they start at zero (modded-nanogpt), so each
        block starts as the identity."""
        return 0.0 if self.zero_init_proj else 0.02 / math.sqrt(2 * self.n_layer)

    @property
    def compute_dtype(self):
        """The jnp dtype activations are computed in."""
        import jax.numpy as jnp

        return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[self.dtype]

    @property
    def mlp_width(self) -> int:
        """Hidden width of the dense MLP: model.mlp_hidden, or the default of model.mlp.

        >>> ModelConfig(n_embd=768).mlp_width, ModelConfig(n_embd=768, mlp="swiglu").mlp_width
        (3072, 2048)
        """
        if self.mlp_hidden:
            return self.mlp_hidden
        if self.mlp == "swiglu":  # 2/3 of 4*n_embd: a 4x GELU MLP's parameters, as Llama
            return 8 * math.ceil(int(2 * 4 * self.n_embd / 3) / 8)
        return 4 * self.n_embd

    @property
    def expert_width(self) -> int:
        """Hidden width of one MoE expert: model.moe_hidden, or the dense MLP's."""
        return self.moe_hidden or self.mlp_width

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices of one MLP (or expert): gate + up + proj, or fc + proj."""
        return 3 if self.mlp == "swiglu" else 2

    @property
    def expert_params(self) -> int:
        """Weights of one MoE expert (its matrices; biases aside)."""
        return self.mlp_matrices * self.expert_width * self.n_embd

    @property
    def n_moe_layers(self) -> int:
        """How many blocks have an MoE MLP (every moe_every-th; none without experts)."""
        return sum(self.is_moe_layer(i) for i in range(self.n_layer))

    def is_moe_layer(self, layer_index: int) -> bool:
        """Whether block `layer_index` has an MoE MLP: blocks moe_every-1, 2*moe_every-1, ..."""
        return self.moe_experts > 0 and (layer_index + 1) % self.moe_every == 0

    @property
    def value_embedding_layers(self) -> tuple[int, ...]:
        """Blocks with a value-embedding table: every other one, ending with the last
        (nanochat's has_ve); none without model.value_embeddings.

        >>> ModelConfig(n_layer=5, value_embeddings=True).value_embedding_layers
        (0, 2, 4)
        """
        if not self.value_embeddings:
            return ()
        return tuple(i for i in range(self.n_layer) if i % 2 == (self.n_layer - 1) % 2)

    @property
    def n_unet_skips(self) -> int:
        """U-net skip connections: n_layer // 2 with model.unet_skips (none for one block)."""
        return self.n_layer // 2 if self.unet_skips else 0

    def approx_params(self) -> int:
        """Parameter count from the shapes alone (biases and norms included roughly), for
        size limits and memory estimates; no model is built.

        >>> cfg = ModelConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128)
        >>> cfg.approx_params()  # the model built from it has 804,096
        807296
        """
        c = self.n_embd
        n_moe = self.n_moe_layers
        per_layer = 4 * c * self.attn_width + 8 * c  # attention, norms and biases
        mlps = (self.n_layer - n_moe) * self.mlp_matrices * self.mlp_width * c
        mlps += n_moe * (self.moe_experts * self.expert_params + c * self.moe_experts)
        positions = self.block_size * c if self.position == "learned" else 0
        # value-embedding tables and their gates, U-net skip weights, multi-token heads
        value_embed = self.vocab_size * self.attn_width + c * self.n_head  # table + gate
        extras = len(self.value_embedding_layers) * value_embed
        extras += self.n_unet_skips + self.mtp_tokens * c * c
        return self.vocab_size * c + positions + self.n_layer * per_layer + mlps + 2 * c + extras

    def for_vocab(self, vocab_size: int) -> ModelConfig:
        """A validated copy for a tokenizer of `vocab_size` tokens (a config file leaves the
        vocabulary 0 until the tokenizer exists)."""
        return dataclasses.replace(self, vocab_size=vocab_size).validate()

    def validate(self) -> ModelConfig:
        """Raise UsageError with one line naming the first bad value; return self if valid."""
        self._check_shape()
        self._check_options()
        self._check_moe()
        if self.approx_params() > MAX_PARAMS:
            raise UsageError(
                f"the model would have about {self.approx_params():.3g} parameters, above the "
                f"limit of {MAX_PARAMS:.0e}: lower model.n_layer, model.n_embd or "
                "tokenizer.vocab_size"
            )
        return self

    def _check_shape(self) -> None:
        """Sizes: positive integers within their limits; heads that divide the width."""
        limits = {"n_layer": MAX_LAYERS, "moe_every": MAX_LAYERS}
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "moe_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise UsageError(f"model.{name} must be a positive integer, got {value!r}")
            if value > limits.get(name, MAX_DIM):
                raise UsageError(
                    f"model.{name} must be at most {limits.get(name, MAX_DIM)}, got {value}"
                )
        head = self.attn_head_dim
        if isinstance(head, bool) or not isinstance(head, int) or not 0 <= head <= MAX_DIM:
            raise UsageError(
                f"model.attn_head_dim must be an integer >= 0 (0 = n_embd / n_head, at most "
                f"{MAX_DIM}), got {head!r}"
            )
        if not head and self.n_embd % self.n_head != 0:
            raise UsageError(
                f"model.n_embd ({self.n_embd}) must be a multiple of model.n_head ({self.n_head})"
            )

    def _check_options(self) -> None:
        """Choices and the numbers that go with them (attention kernel, norms, positions)."""
        _check_choice("norm", self.norm, NORMS)
        _check_choice("mlp", self.mlp, MLPS)
        _check_choice("position", self.position, POSITIONS)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("gelu", self.gelu, GELUS)
        _check_choice("attention", self.attention, ATTENTIONS)
        _check_choice("matmul_precision", self.matmul_precision, MATMUL_PRECISIONS)
        _check_choice("linear_operands", self.linear_operands, LINEAR_OPERANDS)
        if self.attention == "cudnn" and self.dtype != "bfloat16":
            raise UsageError(
                "model.attention='cudnn' needs model.dtype='bfloat16' (cuDNN flash attention "
                "runs in fp16/bf16 only); use model.attention=auto"
            )
        if self.attention == "cudnn" and not (self.head_dim % 8 == 0 and self.head_dim <= 128):
            raise UsageError(
                f"model.attention='cudnn' needs a head dim that is a multiple of 8 and at most "
                f"128, got n_embd/n_head = {self.head_dim}; use model.attention=auto"
            )
        if isinstance(self.norm_eps, bool) or not (
            isinstance(self.norm_eps, (int, float)) and 0.0 < self.norm_eps < 1.0
        ):
            raise UsageError(f"model.norm_eps must be a number in (0, 1), got {self.norm_eps!r}")
        flags = ("tie_embeddings", "qk_norm", "qk_norm_weights", "zero_init_proj", "x0_mixing")
        for name in (*flags, "value_embeddings", "unet_skips"):
            if not isinstance(getattr(self, name), bool):
                raise UsageError(f"model.{name} must be true or false, got {getattr(self, name)!r}")
        if self.qk_norm_weights and not self.qk_norm:
            raise UsageError("model.qk_norm_weights=true needs model.qk_norm=true")
        hidden = self.mlp_hidden
        if isinstance(hidden, bool) or not isinstance(hidden, int) or not 0 <= hidden <= MAX_DIM:
            raise UsageError(
                f"model.mlp_hidden must be an integer >= 0 (0 = model.mlp's default, at most "
                f"{MAX_DIM}), got {hidden!r}"
            )
        cap = self.logit_softcap
        if not (checks.is_float32(cap) and cap >= 0):
            raise UsageError(
                f"model.logit_softcap must be a finite number >= 0 (0 = off), got {cap!r}"
            )
        if self.position == "rope" and self.head_dim % 2 != 0:
            raise UsageError(
                f"model.position='rope' needs an even head dim, got n_embd/n_head = {self.head_dim}"
            )
        if not (checks.is_float32(self.rope_theta) and self.rope_theta > 0):
            raise UsageError(
                f"model.rope_theta must be a finite number > 0, got {self.rope_theta!r}"
            )
        if not (isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0):
            raise UsageError(f"model.dropout must be in [0, 1), got {self.dropout!r}")
        self._check_mtp()

    def _check_mtp(self) -> None:
        """Multi-token prediction: each head needs a target inside the training window."""
        k, most = self.mtp_tokens, self.block_size - 2
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= max(most, 0):
            raise UsageError(
                f"model.mtp_tokens must be an integer in 0..{max(most, 0)} (0 = off; at most "
                f"model.block_size - 2, so that a target lies in the window), got {k!r}"
            )
        w = self.mtp_weight
        if not (checks.is_float32(w) and w >= 0):
            raise UsageError(f"model.mtp_weight must be a finite number >= 0, got {w!r}")

    def _check_moe(self) -> None:
        """Mixture-of-experts settings (checked whether or not experts are on)."""
        if self.moe_experts > MAX_EXPERTS:
            raise UsageError(
                f"model.moe_experts must be at most {MAX_EXPERTS}, got {self.moe_experts}"
            )
        if self.moe_experts < 0 or self.moe_top_k <= 0:
            raise UsageError(
                f"model.moe_experts must be >= 0 and model.moe_top_k >= 1, "
                f"got {self.moe_experts} and {self.moe_top_k}"
            )
        if self.moe_experts > 0 and self.moe_top_k > self.moe_experts:
            raise UsageError(
                f"model.moe_top_k ({self.moe_top_k}) cannot exceed "
                f"model.moe_experts ({self.moe_experts})"
            )
        if self.moe_experts > 0 and self.moe_every > self.n_layer:
            raise UsageError(
                f"model.moe_every ({self.moe_every}) is above model.n_layer ({self.n_layer}): "
                "no block would get an MoE MLP"
            )
        if not isinstance(self.moe_hidden, int) or not 0 <= self.moe_hidden <= MAX_DIM:
            raise UsageError(
                f"model.moe_hidden must be an integer >= 0 (at most {MAX_DIM}), "
                f"got {self.moe_hidden!r}"
            )
        for name in ("moe_aux_weight", "moe_z_weight", "moe_capacity_factor"):
            value = getattr(self, name)
            if not (checks.is_float32(value) and value >= 0):
                raise UsageError(f"model.{name} must be a finite number >= 0, got {value!r}")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UsageError(f"model.{name} must be one of {', '.join(choices)}; got {value!r}")


def model_config_of(saved: dict[str, Any]) -> ModelConfig:
    """The [model] section of a run's saved config (config.json, a checkpoint's record), typed
    and checked as a config file's is (not yet validated: its vocabulary may still be 0)."""
    return from_plain(ModelConfig, saved.get("model", {}), "model.")
