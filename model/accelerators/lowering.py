"""Every compiled program, lowered for cuda, rocm and tpu here, and what the lowered text holds.

The programs are the project's own jitted functions, traced with abstract arguments (shapes,
dtypes and shardings; nothing allocated, so GPT-2 small costs what a tiny model does):

    train       the train step (the config's optimizer and variants: the other optimizer,
                gradient accumulation, mixture of experts, int4 QAT; with several devices each
                data-parallel and FSDP) and the evaluation
    decode      --inference's refill (prompt prefill and context slides), cached chunk and
                uncached chunk
    serve       the server's scored refill, put_row, take_row and batch_chunk

Each is traced as a host of the platform would trace it (model/accelerators/gpu_host.py: on
cuda in bf16 the model picks cuDNN flash attention) and lowered with
`traced.lower(lowering_platforms=(platform,))`. The StableHLO text is then checked
(model/accelerators/program_text.py):
  - no float64 (TPUs have none; GPUs run it at a fraction of the speed);
  - no host callbacks (a Python call from the device program), except the custom
    partitioning callback of sharded cuDNN attention, which XLA's partitioner calls at compile
    time to shard JAX's cuDNN rule;
  - cuDNN's fused attention (`__cudnn$fmha...`, forward and backward) exactly where the model
    should pick it, and nowhere else;
  - in bf16, no product of a float32 and a bf16 operand without the bf16 algorithm
    (model/network/precision.py): that product would run in float32 (checked on the traced
    program, before lowering hides it behind an upcast);
  - for cuda and rocm, in the programs a stream calls every few tokens (decode, serve), no
    control flow that XLA:GPU decides on the host: no conditional, no loop over a traced
    count (checked on the traced program, in the branch of each `platform_dependent` choice
    that the platform runs).

    >>> results = lower_all(load_config("configs/shakespeare.toml"), ("tpu",))  # doctest: +SKIP
    >>> all(r.ok for r in results)  # doctest: +SKIP
    True
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from model.accelerators.gpu_host import attention_on, traced_as
from model.accelerators.program_text import (
    custom_call_targets,
    host_syncs,
    inspect_text,
    mixed_products,
)
from model.decoding.programs import DEFAULT_CHUNK_SIZE
from model.decoding.sampling import GPU_PLATFORMS
from model.decoding.sampling_params import SamplingParams
from model.decoding.steps import (
    cached_chunk,
    carry_layout,
    fixed_step_counts,
    refill,
    uncached_chunk,
    window_size,
)
from model.network.config import ModelConfig
from model.network.gpt import GPT
from model.network.params import sampling_device
from model.serving.batch import (
    attended_like,
    batch_chunk,
    batch_layout,
    batch_settings,
    put_row,
    take_row,
)
from model.training.trainer import Trainer, eval_chunk
from plumbing.errors import UsageError

PLATFORMS = ("cuda", "rocm", "tpu")
DTYPES = ("float32", "bfloat16")
# The train-step variants lowered besides the config itself: name -> (train, model) overrides.
VARIANTS: dict[str, tuple[dict, dict]] = {
    # AdamW without Muon's own options (NorMuon, Polar Express), which it refuses.
    "adamw": ({"optimizer": "adamw", "normuon": False, "muon_orthogonalizer": "newton_schulz"}, {}),
    "muon": ({"optimizer": "muon"}, {}),
    "accumulation": ({"grad_accum": 2}, {}),
    "moe": ({}, {"moe_experts": 8, "moe_top_k": 2}),
    "qat int4": ({"qat_bits": 4}, {}),
}


@dataclass(frozen=True)
class Program:
    """One compiled program: `trace()` traces it with abstract arguments. `full_attention`:
    its attention runs over whole sequences (training, evaluation, the uncached reference),
    where cuDNN can run, rather than over the KV cache."""

    name: str
    trace: Callable[[], Any]
    full_attention: bool
    training: bool = False
    streamed: bool = False  # called every few tokens (decoding, serving): see `host_syncs`


@dataclass
class Lowering:
    """One program lowered for one platform in one compute dtype."""

    program: str
    platform: str
    dtype: str
    attention: str = ""  # what the model picked: "xla", "cudnn", "reference"
    problems: list[str] = field(default_factory=list)
    custom_calls: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


# -- the programs ---------------------------------------------------------------------------


def training_programs(cfg, devices: int, variants: Iterable[str] = VARIANTS) -> list[Program]:
    """The train step for the config and each variant (DP and FSDP with several devices), and
    the evaluation."""
    programs = []
    layouts = [False, True] if devices > 1 else [cfg.train.fsdp]
    runs = {"": ({}, {})}
    for name in variants:
        train_over, model_over = VARIANTS[name]
        if _differs(cfg, train_over, model_over):
            runs[name] = (train_over, model_over)
    for name, (train_over, model_over) in runs.items():
        train_cfg, model_cfg = _variant(cfg, devices, train_over, model_over)
        for fsdp in layouts:
            label = ", ".join(x for x in (name or train_cfg.optimizer, "fsdp" * fsdp) if x)
            tracer = _train_step_tracer(train_cfg, model_cfg, fsdp)
            programs.append(Program(f"train step ({label})", tracer, True, training=True))
    train_cfg, model_cfg = _variant(cfg, devices, {}, {})
    if train_cfg.steps_per_call > 1:  # the config's calls of several steps: a loop around it
        label = f"train steps ({train_cfg.steps_per_call} a call)"
        tracer = _train_step_tracer(train_cfg, model_cfg, train_cfg.fsdp, train_cfg.steps_per_call)
        programs.append(Program(label, tracer, True, training=True))
    programs.append(Program("evaluation", _eval_tracer(train_cfg, model_cfg), True))
    return programs


def _differs(cfg, train_over: dict, model_over: dict) -> bool:
    """Whether a variant changes the config (the config's own optimizer is no variant)."""
    current = {k: getattr(cfg.train, k) for k in train_over}
    current.update({k: getattr(cfg.model, k) for k in model_over})
    return current != {**train_over, **model_over}


def _variant(cfg, devices: int, train_over: dict, model_over: dict):
    """(train config, model config) of a variant; the batch rounded up so that every device
    gets whole micro-batch rows (the full batch: a batch-size schedule's smaller programs need
    less)."""
    train_cfg = dataclasses.replace(
        cfg.train, eval_batch_size=0, batch_size_schedule=[], **train_over
    )
    step = devices * train_cfg.grad_accum
    batch = -(-train_cfg.batch_size // step) * step
    train_cfg = dataclasses.replace(train_cfg, batch_size=batch).validate()
    model_cfg = dataclasses.replace(cfg.model, **model_over).validate()
    return train_cfg, model_cfg


def _train_step_tracer(train_cfg, model_cfg: ModelConfig, fsdp: bool, calls: int = 1) -> Callable:
    """The train step's trace; with `calls` > 1 the program that runs that many steps."""

    def trace():
        trainer = Trainer(dataclasses.replace(train_cfg, fsdp=fsdp), model_cfg, abstract=True)
        program = trainer.train_step if calls == 1 else trainer.train_steps
        return program.trace(trainer.initial_state(), *trainer.batch_shapes(steps=calls))

    return trace


def _eval_tracer(train_cfg, model_cfg: ModelConfig) -> Callable:
    def trace():
        trainer = Trainer(train_cfg, model_cfg, abstract=True)
        rows, block = train_cfg.eval_rows, model_cfg.block_size
        shape = (eval_chunk(train_cfg.eval_steps, rows * block), rows, block)
        x = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=trainer.batch_sharding)
        total = jax.ShapeDtypeStruct((), jnp.float32, sharding=NamedSharding(trainer.mesh, P()))
        return trainer.eval_batches.trace(trainer.initial_state().params, x, x, total)

    return trace


def decode_programs(cfg) -> list[Program]:
    """--inference's programs for the config's sample count (refill also prefills prompts)."""
    model_cfg, samples = cfg.model.validate(), cfg.sample.num_samples

    def tracer(program, use_cache: bool, **static):
        def trace():
            graphdef, state = _abstract_model(model_cfg)
            carry = _on_device(carry_layout(model_cfg, samples, use_cache))
            scalar = _on_device(jax.ShapeDtypeStruct((), jnp.int32))
            if program is refill:
                return refill.trace(graphdef, state, carry, scalar, scalar, scalar)
            settings = _on_device(SamplingParams().settings(None))
            return program.trace(graphdef, state, carry, settings, _n_steps(scalar), **static)

        return trace

    chunk = {"chunk_size": DEFAULT_CHUNK_SIZE}
    return [
        Program("refill (prefill, slides)", tracer(refill, True), False, streamed=True),
        Program("cached chunk", tracer(cached_chunk, True, **chunk), False, streamed=True),
        Program("uncached chunk", tracer(uncached_chunk, False, **chunk), True, streamed=True),
    ]


def serving_programs(cfg) -> list[Program]:
    """The server's programs for serve.batch_size rows."""
    model_cfg, rows = cfg.model.validate(), cfg.serve.batch_size

    def tracer(name: str):
        def trace():
            graphdef, state = _abstract_model(model_cfg)
            batch = _on_device(batch_layout(model_cfg, rows))
            row = _on_device(carry_layout(model_cfg, 1, use_cache=True))
            scalar = _on_device(jax.ShapeDtypeStruct((), jnp.int32))
            if name == "scored refill":  # a prompt's prefill with its log-probabilities (echo)
                width = window_size(model_cfg.block_size)
                return refill.trace(
                    graphdef, state, row, scalar, scalar, scalar, width=width, scored=True
                )
            if name == "put_row":
                return put_row.trace(batch, row, scalar)
            if name == "take_row":
                return take_row.trace(batch, scalar)
            settings = _on_device(batch_settings(rows))
            active = _on_device(jax.ShapeDtypeStruct((rows,), jnp.bool_))
            attended = attended_like(batch, rows, model_cfg.block_size)
            return batch_chunk.trace(
                graphdef, state, (batch, attended), settings, active, _n_steps(scalar),
                chunk_size=cfg.serve.chunk_steps, rows=rows,
            )  # fmt: skip

        return trace

    names = ("scored refill", "put_row", "take_row", "batch_chunk")
    return [Program(name, tracer(name), False, streamed=True) for name in names]


def _n_steps(scalar):
    """A chunk's step-count argument as this host compiles it: None where the count is
    fixed (GPUs, model.decoding.steps.fixed_step_counts), else the traced scalar."""
    return None if fixed_step_counts() else scalar


@functools.lru_cache(maxsize=4)
def _abstract_model(model_cfg: ModelConfig):
    """(graphdef, state) of a GPT as shapes on this process's first device (the same for every
    host, so kept for the next program)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: GPT(model_cfg, rngs=nnx.Rngs(0))))
    return graphdef, _on_device(state)


def _on_device(tree):
    """Shapes of `tree`'s leaves (arrays, numpy scalars or shapes) on this process's first
    device, where --inference and --serve put everything."""
    device = SingleDeviceSharding(sampling_device())
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), tree)


# -- lowering and what the text holds ---------------------------------------------------------


def lower_all(
    cfg,
    platforms: Iterable[str] = PLATFORMS,
    dtypes: Iterable[str] = DTYPES,
    groups: Iterable[str] = ("train", "decode", "serve"),
    variants: Iterable[str] = VARIANTS,
    on_result: Callable[[Lowering], None] | None = None,
) -> list[Lowering]:
    """Every program of `cfg` (its vocabulary filled in) lowered for each platform and
    compute dtype; dtypes the config cannot take (cuDNN attention in float32) are left out."""
    results = []
    for dtype in dtypes:
        try:
            dtype_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=dtype))
            dtype_cfg.model.validate()
        except UsageError:
            continue
        for program in _programs(dtype_cfg, groups, variants):
            for result in lower_program(program, platforms, dtype_cfg.model):
                results.append(result)
                if on_result is not None:
                    on_result(result)
    return results


def _programs(cfg, groups: Iterable[str], variants: Iterable[str]) -> list[Program]:
    programs = []
    if "train" in groups:
        programs += training_programs(cfg, jax.device_count(), variants)
    if "decode" in groups:
        programs += decode_programs(cfg)
    if "serve" in groups:
        programs += serving_programs(cfg)
    return programs


def lower_program(
    program: Program, platforms: Iterable[str], model_cfg: ModelConfig
) -> list[Lowering]:
    """`program` traced as each platform's host and lowered for it, then checked. Platforms
    whose hosts make the same choices share one trace (tracing is most of the cost)."""
    results, by_choices = [], {}
    for platform in platforms:
        result = Lowering(program.name, platform, model_cfg.dtype)
        results.append(result)
        try:
            result.attention = expected_attention(program, platform, model_cfg)
        except UsageError:  # model.attention=cudnn off an NVIDIA GPU: refused, by design
            result.attention = "n/a"
            continue
        # What the host's Python decides: the attention, and fixed decode step counts (GPUs).
        choices = (result.attention, platform in GPU_PLATFORMS)
        by_choices.setdefault(choices, []).append(result)
    for (attention, _), group in by_choices.items():
        try:
            _forget_traces_of_another_host(attention)
            with traced_as(group[0].platform):
                traced = program.trace()
        except Exception as err:  # any failure to trace is what this check reports
            for result in group:
                result.problems.append(f"does not trace: {_describe(err)}")
            continue
        mixed = mixed_products(traced.jaxpr) if model_cfg.dtype == "bfloat16" else []
        for result in group:
            if mixed:
                result.problems.append(
                    f"{len(mixed)} float32 x bf16 products would run in float32, e.g. {mixed[0]}"
                )
            try:
                text = traced.lower(lowering_platforms=(result.platform,)).as_text()
                result.problems += inspect_text(text, attention == "cudnn", program.training)
                result.custom_calls = sorted(set(custom_call_targets(text)))
                if program.streamed and result.platform != "tpu":
                    result.problems += host_syncs(traced.jaxpr, result.platform)
            except Exception as err:  # likewise for lowering
                result.problems.append(f"does not lower: {_describe(err)}")
    return results


_last_host_choice: list[str] = []  # the attention of the last trace made in this process


def _forget_traces_of_another_host(attention: str) -> None:
    """jit keeps traces by argument shapes, not by the host they were made for: before a
    trace that picks other attention than the last one, drop them (the programs that are
    module-level jits, --inference's and the server's, would otherwise reuse them)."""
    if _last_host_choice and _last_host_choice[-1] != attention:
        jax.clear_caches()
    _last_host_choice[:] = [attention]


def expected_attention(program: Program, platform: str, model_cfg: ModelConfig) -> str:
    """What the model picks for `program` on a `platform` host (UsageError: refused)."""
    return attention_on(
        platform, model_cfg, cached=not program.full_attention, training=program.training
    )


def _describe(err: BaseException) -> str:
    first = (str(err).strip().splitlines() or [""])[0][:300]
    return f"{type(err).__name__}: {first}"
