"""Will a training run fit in memory? Checked before anything is allocated against what the
memory probe (plumbing/memory.py) says is free, so that a model too big for the machine is one
clear line, not an out-of-memory traceback minutes later.

On an accelerator the check is the plan's (model/accelerators/plan.py, what `--plan` prints):
parameters, gradients, optimizer state and activations per device, as the run will lay them
out, against the device's free memory. On a GPU, where XLA keeps less than the plan's
activations, a run is refused only when it cannot fit with half of them (plan.surely_needed);
between that and the plan it starts, with a note.

On CPU every device shares the host's memory. A quick lower bound comes first, from what
training surely holds at once: float32 parameters, their gradients and the optimizer's moments
(`optimizer_floats`: AdamW two a parameter; Muon one for its matrices and two for AdamW's
part, the embeddings), and for one micro-batch the attention probabilities of every layer
(B x H x T x T float32) and the float32 logits (B x T x V). Above the memory there is, the run is
refused; within a quarter of it, the plan decides; below, a small model starts without the
second of tracing the plan costs.

    >>> from model.network.config import ModelConfig
    >>> cfg = ModelConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128)
    >>> training_bytes(cfg, rows=12) < 64 << 20
    True
"""

from __future__ import annotations

import sys

from model.network.config import ModelConfig
from model.processes.distributed import is_primary
from plumbing.errors import UsageError
from plumbing.memory import available_bytes, human_bytes

PLAN_SHARE = 0.25  # on CPU, the plan is made once the lower bound passes this share


def optimizer_floats(cfg: ModelConfig, optimizer: str = "adamw") -> int:
    """Float32 moments the optimizer surely keeps, from the config's shapes: AdamW two a
    parameter; Muon one (momentum) a parameter of its matrices and AdamW's two for the token
    and position tables. Not counted, being small: the norms, biases, router and output
    layer's share of AdamW (Muon), NorMuon's moment per output neuron, step counts.

    >>> cfg = ModelConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128)
    >>> optimizer_floats(cfg, "muon") - cfg.approx_params() == (65 + 64) * 128
    True
    """
    n = cfg.approx_params()
    if optimizer == "adamw":
        return 2 * n
    positions = cfg.block_size if cfg.position == "learned" else 0
    return n + (cfg.vocab_size + positions) * cfg.n_embd


def training_bytes(
    cfg: ModelConfig, rows: int, state_copies: float = 1.0, optimizer: str = "adamw"
) -> int:
    """Lower bound on the bytes one training step holds: `state_copies` copies of parameters,
    gradients and optimizer state (one per device when replicated) plus the activations of `rows`
    sequences of cfg.block_size tokens."""
    t = cfg.block_size
    state = (8 * cfg.approx_params() + 4 * optimizer_floats(cfg, optimizer)) * state_copies
    attention = cfg.n_layer * rows * cfg.n_head * t * t * 4  # softmax output, float32
    logits = rows * t * cfg.vocab_size * 4 * (1 + cfg.mtp_tokens)  # float32; multi-token heads'
    return int(state + attention + logits)


def check_training_memory(model_cfg: ModelConfig, train_cfg, note: bool = True) -> None:
    """UsageError, one line, when training `model_cfg` with `train_cfg` cannot fit. `note`:
    say so when it may not fit (a GPU's plan above its free memory); an early check leaves
    that to the check that follows it."""
    import jax

    device, n = jax.local_devices()[0], jax.device_count()
    have = available_bytes(device)
    if have is None:
        return
    # The evaluation's batch holds its logits and attention too, beside the training state.
    rows = max(train_cfg.micro_batch, train_cfg.eval_rows)
    batch = "per micro-batch" if rows == train_cfg.micro_batch else "per validation batch"
    if device.platform == "cpu":
        copies = 1.0 if train_cfg.fsdp else n
        quick = training_bytes(model_cfg, rows, copies, train_cfg.optimizer)
        if quick > have:
            advice = _ADVICE if batch == "per micro-batch" else "lower train.eval_batch_size"
            raise UsageError(
                f"this model needs at least {human_bytes(quick)} to train (about "
                f"{model_cfg.approx_params():,} parameters, context {model_cfg.block_size}, "
                f"{rows} sequences {batch}), more than the {human_bytes(have)} of "
                f"available memory: {advice}"
            )
        if quick <= PLAN_SHARE * have:
            return
    _check_plan(model_cfg, train_cfg, device, n, have, note)


def _check_plan(model_cfg: ModelConfig, train_cfg, device, n: int, have: int, note: bool) -> None:
    from model.accelerators.plan import surely_needed, training_plan_bytes

    per_device = training_plan_bytes(model_cfg, train_cfg, n)
    on_cpu = device.platform == "cpu"
    # CPU devices are views of one host: all their shares come out of the same memory.
    shares = n if on_cpu else 1
    need = per_device["total"] * shares
    if need <= have:
        return
    parts = ", ".join(f"{k} {human_bytes(v)}" for k, v in per_device.items() if k != "total")
    where = "available memory" if on_cpu else f"free memory on {device}"
    each = f"{human_bytes(per_device['total'])} on each of {n} devices" if n > 1 else ""
    sized = f"{human_bytes(need)} to train ({each + '; ' if each else ''}{parts}"
    floor = surely_needed(per_device, device.platform) * shares
    if floor <= have:  # under the plan's total (need > have): a GPU's share of activations
        if note and is_primary():
            print(
                f"train: note: the plan says about {sized}; --plan shows the plan), more than "
                f"the {human_bytes(have)} of {where}, but XLA keeps less than the plan's "
                f"activations: starting; if it runs out of memory, {_ADVICE}",
                file=sys.stderr,
            )
        return
    surely = f", at least {human_bytes(floor)}" if floor < need else ""
    raise UsageError(
        f"this model needs about {sized}; --plan shows the plan{surely}), more than the "
        f"{human_bytes(have)} of {where}: {_ADVICE}"
    )


_ADVICE = (
    "lower model.block_size, model.n_layer, model.n_embd or train.batch_size (or raise "
    "train.grad_accum, or set train.fsdp=true on several devices)"
)
