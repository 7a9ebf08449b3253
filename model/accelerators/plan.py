"""--plan: what a config costs on a device, worked out before anything compiles.

Sizes come from the model's abstract shapes (nothing allocated) and the project's own rules:
  parameters    float32, each split over the devices as FSDP and expert parallelism split it
                (model/processes/mesh.py `sharded_axis`), else whole on every device
  gradients     float32, laid out as the parameters (a second copy with train.grad_accum > 1:
                the running sum and the micro-batch's own)
  optimizer     the optimizer's own state, traced from train's optimizer (AdamW: two moments;
                Muon: one for its matrices, two for the rest; NorMuon: one more per output
                neuron of each matrix), each moment laid out as its parameter, smaller
                state (NorMuon's, step counts) whole on every device
  activations   what the backward pass keeps of one micro-batch's share of rows: the residuals
                of `jax.vjp` of the training loss, traced as the device's host traces it (cuDNN
                attention keeps no T x T probabilities), so any rematerialisation the model
                does is counted as it does it; plus the float32 gradient of the logits
  kv cache      --serve's batch: serve.batch_size rows of block_size keys and values per
                layer, in the compute dtype, with float32 weights beside it
FLOPs per token are nanoGPT's 6N + 12 L D T (model/network/gpt.py `flops_per_token`); the
step time assumes a stated model-FLOPs utilisation of the device's dense bf16 peak.

    >>> from configs.schema import load_config, resolve_config_path
    >>> from model.accelerators.devices import accelerator
    >>> cfg = planned_config(load_config(resolve_config_path("gpt2_124m")))
    >>> make_plan(cfg, accelerator("h100-sxm")).fits
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from dataclasses import dataclass, field
from pathlib import Path

from model.accelerators.devices import Accelerator

GPT2_VOCAB = 50257  # r50k: 256 bytes + 50,000 merges + <|endoftext|>
CHAR_VOCAB = 256  # a character vocabulary is the corpus's own: at most this for our texts
DEFAULT_MFU = 0.4  # the step time's assumption: 40% of the dense bf16 peak
PARTS = ("parameters", "gradients", "optimizer", "activations")


@dataclass
class Plan:
    config: str
    device: Accelerator
    devices: int
    dtype: str
    optimizer: str
    fsdp: bool
    attention: str  # what the model picks on this device for training
    params: int
    flops_per_token: float
    bytes_per_device: dict[str, int]  # PARTS, then "total"
    memory_per_device: int  # what a run may allocate on one device
    kv_cache_bytes: int  # --serve's batch on one device
    serve_bytes: int  # float32 weights + the KV cache
    serve_rows: int
    mfu: float
    step_seconds: float
    tokens_per_second: float
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        """Whether training fits on each device."""
        return self.bytes_per_device["total"] <= self.memory_per_device

    @property
    def may_fit(self) -> bool:
        """Whether training fits with what it surely needs (`surely_needed`): --train starts."""
        return surely_needed(self.bytes_per_device, self.device.platform) <= self.memory_per_device

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["device"] = {
            "name": self.device.name,
            "label": self.device.label,
            "bf16_flops": self.device.bf16_flops,
            "memory_bytes": self.device.memory_bytes,
        }
        out["fits"] = self.fits
        out["may_fit"] = self.may_fit
        out["serve_fits"] = self.serve_bytes <= self.memory_per_device
        return out


def planned_config(cfg, run_dir: Path | None = None):
    """`cfg` with the model's vocabulary filled in: the run directory's tokenizer when there
    is one, else what the [tokenizer] section implies (GPT-2's 50,257; a BPE's vocab_size; 256
    for characters, an upper bound)."""
    vocab = cfg.model.vocab_size or _vocab_of(cfg, run_dir)
    model = dataclasses.replace(cfg.model, vocab_size=vocab).validate()
    return dataclasses.replace(cfg, model=model)


def _vocab_of(cfg, run_dir: Path | None) -> int:
    from model.rundir.layout import TOKENIZER_FILE

    if run_dir is not None and (Path(run_dir) / TOKENIZER_FILE).is_file():
        from tokenizer import load_tokenizer

        return load_tokenizer(Path(run_dir) / TOKENIZER_FILE).vocab_size
    if cfg.init_from:
        from model.interop.hf_import import hf_model_config

        return hf_model_config(cfg.init_from, cfg.model).vocab_size
    kind = cfg.tokenizer.kind
    return {"gpt2": GPT2_VOCAB, "char": CHAR_VOCAB}.get(kind, cfg.tokenizer.vocab_size)


def make_plan(
    cfg, device: Accelerator, devices: int = 1, mfu: float = DEFAULT_MFU, memory: int | None = None
) -> Plan:
    """The plan of `cfg` (vocabulary filled in) on `devices` of `device`; `memory`: what one
    device may allocate, if known better than the table (a live device's allocator)."""
    from model.network.gpt import flops_per_token

    model_cfg, train_cfg = cfg.model, cfg.train
    if train_cfg.micro_batch % devices:
        from plumbing.errors import UsageError

        raise UsageError(
            f"the micro-batch (train.batch_size / train.grad_accum = {train_cfg.micro_batch}) "
            f"must divide evenly over the {devices} devices"
        )
    attention = training_attention(model_cfg, device.platform)
    per_device = training_plan_bytes(model_cfg, train_cfg, devices, device.platform)
    params = parameter_count(model_cfg)
    kv = kv_cache_bytes(model_cfg, cfg.serve.batch_size)
    flops = flops_per_token(model_cfg)
    tokens_per_step = train_cfg.batch_size * model_cfg.block_size
    step = flops * tokens_per_step / (devices * device.bf16_flops * mfu)
    notes = []
    if model_cfg.dtype == "float32" and device.platform != "cpu":
        notes.append("float32 compute: expect well below the bf16 MFU assumed here")
    return Plan(
        config=cfg.name,
        device=device,
        devices=devices,
        dtype=model_cfg.dtype,
        optimizer=train_cfg.optimizer,
        fsdp=train_cfg.fsdp,
        attention=attention,
        params=params,
        flops_per_token=flops,
        bytes_per_device=per_device,
        memory_per_device=device.usable_bytes() if memory is None else memory,
        kv_cache_bytes=kv,
        serve_bytes=4 * params + kv,
        serve_rows=cfg.serve.batch_size,
        mfu=mfu,
        step_seconds=step,
        tokens_per_second=tokens_per_step / step,
        notes=notes,
    )


def parameter_count(model_cfg) -> int:
    _, params, _ = _abstract(model_cfg)
    return sum(math.prod(x.shape) for x in _leaves(params))


def state_bytes(model_cfg, train_cfg, devices: int) -> dict[str, int]:
    """Bytes per device of parameters, gradients and optimizer state."""
    import jax

    from model.network.params import path_names
    from model.processes.mesh import owning_parameter, sharded_axis
    from model.training.optim import make_optimizer

    _, params, _ = _abstract(model_cfg)
    split = {}  # parameter path -> (shape, devices it is split over)
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        names = path_names(path)
        axis = sharded_axis(names, x.shape, devices, train_cfg.fsdp)
        split[names] = (tuple(x.shape), devices if axis is not None else 1)
    weights = sum(4 * math.prod(shape) // n for shape, n in split.values())
    optimizer = 0
    opt_state = jax.eval_shape(make_optimizer(train_cfg).init, params)
    for path, x in jax.tree_util.tree_leaves_with_path(opt_state):
        n = owning_parameter(path_names(path), tuple(x.shape), split) or 1  # laid out alike
        optimizer += math.prod(x.shape) * x.dtype.itemsize // n
    gradients = weights * (2 if train_cfg.grad_accum > 1 else 1)
    return {"parameters": weights, "gradients": gradients, "optimizer": optimizer}


def training_plan_bytes(model_cfg, train_cfg, devices: int, platform: str | None = None):
    """Bytes per device of PARTS and their "total", training on `devices` devices of a
    `platform` host ("cpu", "cuda", "rocm", "tpu"; None: this one)."""
    rows = train_cfg.micro_batch // devices
    per_device = state_bytes(model_cfg, train_cfg, devices)
    per_device["activations"] = activation_bytes(model_cfg, train_cfg, rows, platform)
    per_device["total"] = sum(per_device.values())
    return per_device


# XLA on a GPU keeps less than the plan's activations (autodiff's traced residuals): on an
# H200, about 0.54 of them for GPT-2 small's shape (docs/accelerators.md). There --train
# refuses only what cannot fit with this share of them. Not measured on a TPU: the plan stands.
GPU_ACTIVATIONS_SURELY = 0.5


def surely_needed(per_device: dict[str, int], platform: str) -> int:
    """Bytes per device a run surely needs: the plan's total, or on a GPU (JAX's "gpu", the
    plan's "cuda" or "rocm") its state and GPU_ACTIVATIONS_SURELY of its activations.

    >>> surely_needed({"activations": 10, "total": 14}, "cuda"), surely_needed(
    ...     {"activations": 10, "total": 14}, "tpu")
    (9, 14)
    """
    if platform not in ("gpu", "cuda", "rocm"):
        return per_device["total"]
    return per_device["total"] - int((1 - GPU_ACTIVATIONS_SURELY) * per_device["activations"])


def training_attention(model_cfg, platform: str) -> str:
    """The attention the model picks for training on a `platform` host (UsageError:
    model.attention = "cudnn" off an NVIDIA GPU)."""
    from model.accelerators.gpu_host import attention_on

    return attention_on(platform, model_cfg, cached=False, training=True)


def activation_bytes(model_cfg, train_cfg, rows: int, platform: str | None = None) -> int:
    """Bytes the backward pass keeps for `rows` sequences: the residuals of the loss's vjp,
    traced as a `platform` host would (None: this one), and the logits' float32 gradient."""
    import jax
    import jax.numpy as jnp

    from model.accelerators.gpu_host import traced_as
    from model.training.objective import training_loss

    try:  # the residuals JAX's autodiff keeps for the backward pass, with where they come from
        from jax._src.ad_checkpoint import saved_residuals
    except ImportError:  # pragma: no cover - a JAX that moved it
        from jax.ad_checkpoint import saved_residuals

    graphdef, params, rest = _abstract(model_cfg)
    loss = training_loss(graphdef, rest, train_cfg)
    tokens = jax.ShapeDtypeStruct((rows, model_cfg.block_size), jnp.int32)

    def objective(params, x, y):
        return loss(params, x, y, jax.random.key(0))[0]

    with contextlib.nullcontext() if platform is None else traced_as(platform):
        kept = saved_residuals(objective, params, tokens, tokens)
    # Not counted: the parameters themselves (counted above), and reshapes, which XLA keeps as
    # views of the buffer they reshape (a row-major array's reshape is a bitcast).
    saved = sum(
        math.prod(aval.shape) * aval.dtype.itemsize
        for aval, where in kept
        if not where.startswith("from the argument") and "output of reshape" not in where
    )
    logits_grad = rows * model_cfg.block_size * model_cfg.vocab_size * 4
    return saved + logits_grad


def kv_cache_bytes(model_cfg, rows: int) -> int:
    from model.network.gpt import cache_layout

    return sum(
        math.prod(x.shape) * x.dtype.itemsize for x in _leaves(cache_layout(model_cfg, rows))
    )


@functools.lru_cache(maxsize=4)
def _abstract(model_cfg):
    """The abstract model, traced once for the plan's three uses of it."""
    from model.network.params import abstract_model

    return abstract_model(model_cfg)


def _leaves(tree):
    import jax

    return jax.tree_util.tree_leaves(tree)
