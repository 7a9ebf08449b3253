"""Will a training run fit in memory? A lower bound from the config, checked before anything is
allocated against what the memory probe (plumbing/memory.py) says is free, so that a model too
big for the machine is one clear line, not an out-of-memory traceback minutes later.

The estimate counts only what training surely holds at once, so it never refuses a run that
would fit: float32 parameters, their gradients and Adam's two moments (16 bytes a parameter),
and, for one micro-batch, the attention probabilities of every layer (B x H x T x T float32,
kept for the backward pass) and the float32 logits (B x T x V).

    >>> from model.network.config import ModelConfig
    >>> cfg = ModelConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128)
    >>> training_bytes(cfg, rows=12) < 64 << 20
    True
"""

from __future__ import annotations

from model.network.config import ModelConfig
from plumbing.errors import UsageError
from plumbing.memory import available_bytes, human_bytes

STATE_BYTES_PER_PARAM = 16  # float32 parameter, gradient, Adam mu and nu


def training_bytes(cfg: ModelConfig, rows: int, state_copies: float = 1.0) -> int:
    """Lower bound on the bytes one training step holds: `state_copies` copies of parameters
    and optimizer state (one per device when replicated) plus the activations of `rows`
    sequences of cfg.block_size tokens."""
    t = cfg.block_size
    state = STATE_BYTES_PER_PARAM * cfg.approx_params() * state_copies
    attention = cfg.n_layer * rows * cfg.n_head * t * t * 4  # softmax output, float32
    logits = rows * t * cfg.vocab_size * 4  # float32
    return int(state + attention + logits)


def check_training_memory(cfg: ModelConfig, batch_rows: int, fsdp: bool = False) -> None:
    """UsageError, one line, when the training lower bound exceeds the memory there is.

    `batch_rows` is the micro-batch (train.batch_size // train.grad_accum) over all devices.
    On CPU every device shares host memory: the state is held once per device (once in all
    with FSDP) and the whole micro-batch counts. On an accelerator each device holds its
    share of the rows and, with FSDP, of the state.
    """
    import jax

    devices = jax.local_devices()
    n = len(devices)
    if devices[0].platform == "cpu":
        need = training_bytes(cfg, batch_rows, 1.0 if fsdp else n)
        where = "available memory"
    else:
        need = training_bytes(cfg, -(-batch_rows // n), 1.0 / n if fsdp else 1.0)
        where = f"free memory on {devices[0]}"
    have = available_bytes(devices[0])
    if have is None or need <= have:
        return
    raise UsageError(
        f"this model needs at least {human_bytes(need)} to train (about {cfg.approx_params():,} "
        f"parameters, context {cfg.block_size}, {batch_rows} sequences per micro-batch), "
        f"more than the {human_bytes(have)} of {where}: lower model.block_size, model.n_layer, "
        "model.n_embd or train.batch_size (or raise train.grad_accum)"
    )
