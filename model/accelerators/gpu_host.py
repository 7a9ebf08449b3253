"""Tracing the model as a host with another accelerator would, from this CPU machine.

What a program computes is decided twice: in Python while tracing (which attention kernel the
model picks, from the host's platform, GPU generation and cuDNN version) and by XLA when it
lowers and compiles (for `lowering_platforms`). Lowering for "cuda" here changes only the
second; `traced_as` changes the first too, so the lowered program is the one an H100 would
run: cuDNN flash attention in bf16 where `model.attention = "auto"` picks it.

JAX asks the installed cuDNN for its version and the local GPU for its compute capability
before it emits cuDNN's fused attention; neither exists here, so the two queries answer as on
an H100 (cuDNN 9.10, compute capability 9.0) for the duration. They are JAX internals
(jax._src.cudnn.fused_attention_stablehlo); if they move, `traced_as("cuda")` says so in an
error rather than tracing something else.

    >>> with traced_as("tpu"):
    ...     backend_facts()
    ('tpu', None)
"""

from __future__ import annotations

import contextlib
from unittest import mock

from model.network.attention import backend_facts, choose_implementation, traced_for

# What each platform's host reports to the model; cuda: an H100 (Hopper, compute capability
# 9.0), the GPU the project's bf16 configs are sized for.
HOSTS: dict[str, tuple[str, tuple[int, int] | None]] = {
    "cpu": ("cpu", None),
    "cuda": ("cuda", (9, 0)),
    "rocm": ("rocm", None),
    "tpu": ("tpu", None),
}
CUDNN_VERSION = 91000  # cuDNN 9.10, as jax[cuda12] ships it

__all__ = ["HOSTS", "attention_on", "backend_facts", "traced_as"]


def attention_on(platform: str, model_cfg, *, cached: bool, training: bool) -> str:
    """The attention the model picks on a `platform` host (model/network/attention.py's own
    choice); UsageError where it refuses (model.attention = "cudnn" off an NVIDIA GPU)."""
    host, capability = HOSTS[platform]
    return choose_implementation(
        model_cfg.attention,
        platform=host,
        compute_capability=capability,
        dtype=model_cfg.dtype,
        head_dim=model_cfg.head_dim,
        cached=cached,
        dropout=training and model_cfg.dropout > 0,
    )


@contextlib.contextmanager
def traced_as(platform: str):
    """Trace the model's programs as a `platform` host ("cpu", "cuda", "rocm" or "tpu")
    would."""
    host = HOSTS[platform]
    with contextlib.ExitStack() as stack:
        stack.enter_context(traced_for(*host))
        if platform == "cuda":
            stack.enter_context(_cudnn_as_on(host[1]))
        yield


@contextlib.contextmanager
def _cudnn_as_on(capability: tuple[int, int]):
    """JAX's cuDNN checks answering as on a GPU of `capability` with cuDNN CUDNN_VERSION."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fused
    except ImportError as err:  # pragma: no cover - a JAX that moved it
        raise RuntimeError(f"cannot trace cuDNN attention with this JAX: {err}") from None
    missing = [
        name
        for name in ("check_cudnn_version", "check_compute_capability")
        if not callable(getattr(fused, name, None))
    ]
    if missing:
        raise RuntimeError(f"cannot trace cuDNN attention with this JAX: no {missing}")

    def at_least(wanted: str) -> bool:
        return capability >= tuple(int(x) for x in wanted.split("."))

    with (
        mock.patch.object(fused, "check_cudnn_version", lambda: CUDNN_VERSION),
        mock.patch.object(fused, "check_compute_capability", at_least),
    ):
        yield
