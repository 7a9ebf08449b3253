"""The `[train]` section of a run's config: batch, schedule, optimizer, evaluation, QAT.

>>> TrainConfig(batch_size=12, grad_accum=3).validate().micro_batch
4
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Self

from model.processes.cpu_devices import check_cpu_devices
from model.training.muon_coefficients import ORTHOGONALIZERS, POLAR_EXPRESS
from model.training.tracking import TRACKERS
from plumbing import checks
from plumbing.errors import UsageError

OPTIMIZERS = ("adamw", "muon")
MAX_NS_STEPS = 50  # Newton-Schulz iterations per Muon update; 5 is the usual count
SCHEDULES = ("cosine", "wsd")


@dataclass
class TrainConfig:
    batch_size: int = 12  # sequences per optimizer step (all devices together)
    max_steps: int = 2000
    learning_rate: float = 1e-3  # peak, after warmup
    min_lr: float = 1e-4  # where the decay ends (cosine or wsd's cooldown); then flat
    warmup_steps: int = 100
    lr_decay_steps: int = 0  # steps to reach min_lr (warmup included); 0 = max_steps
    weight_decay: float = 0.1  # matrices only; times the scheduled rate at each step
    # Decay only where the update and the weight agree in sign (Muon's or AdamW's matrices).
    cautious_weight_decay: bool = False
    # "adamw" | "muon": Muon (optax.contrib.muon) for the weight matrices, AdamW for the
    # embeddings, output layer, norms and biases (model/training/optim.py).
    optimizer: str = "adamw"
    muon_learning_rate: float = 0.02  # peak rate of Muon's matrices (train.optimizer = "muon")
    muon_ns_steps: int = 5  # iterations that orthogonalise each Muon update (at most 50)
    # "newton_schulz" (one quintic, Keller Jordan's) | "polar_express" (one per iteration,
    # for 5 iterations; Amsel et al. 2025): model/training/muon.py.
    muon_orthogonalizer: str = "newton_schulz"
    normuon: bool = False  # Muon: NorMuon's per-neuron normalisation of the update
    lr_schedule: str = "cosine"  # "cosine" | "wsd": warmup, stable, then a linear cooldown
    decay_fraction: float = 0.2  # wsd: the last fraction of the decay steps that cools down
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # global norm; 0 = off
    grad_accum: int = 1  # micro-batches per step (batch_size must divide by it)
    # Smaller batches early (modded-nanogpt's batch-size warmup): [[from_step, sequences],
    # ...] from step 0, ending at batch_size; [] = batch_size throughout. Each size is a
    # program of its own, split into grad_accum micro-batches; the LR schedule is unchanged.
    batch_size_schedule: list[list[int]] = field(default_factory=list)
    eval_interval: int = 250  # steps between validation runs (and checkpoints)
    eval_steps: int = 200  # validation batches per evaluation
    eval_batch_size: int = 0  # sequences per validation batch; 0 = the training micro-batch
    log_interval: int = 10
    checkpoint_interval: int = 0  # 0 = at every eval
    # Steps one compiled call runs (a loop over that many batches, sent to the devices at
    # once), never past a log, evaluation or checkpoint step: each call's fixed costs (the
    # dispatch, the batch's transfer, starting the devices) are a tenth of a small model's
    # step on CPU. 1 = a call per step.
    steps_per_call: int = 1
    seed: int = 1337
    qat_bits: int = 0  # quantization-aware training: 0 = off, 8 or 4
    quant_group_size: int = 64  # int4: input rows per scale (QAT, export); last group may be short
    fsdp: bool = False  # shard parameters over the data axis too (ZeRO-3 style)
    # GPU: deterministic kernels (XLA's --xla_gpu_deterministic_ops), the same bits on every
    # run, at a cost in speed; CPUs and TPUs are deterministic already.
    deterministic: bool = False
    # On CPU: data-parallel devices, 0 = one per core (model/processes/cpu_devices.py).
    cpu_devices: int = 0
    # Where metrics go besides metrics.jsonl: "none" | "tensorboard" (RUN/tensorboard/) |
    # "wandb" (WANDB_MODE=offline honoured); model/training/tracking.py.
    tracker: str = "none"

    @property
    def micro_batch(self) -> int:
        """Sequences per forward pass: batch_size / grad_accum."""
        return self.batch_size // self.grad_accum

    @property
    def eval_rows(self) -> int:
        """Sequences per validation batch: eval_batch_size, or the micro-batch."""
        return self.eval_batch_size or self.micro_batch

    @property
    def shared_rows(self) -> int:
        """What a data-parallel device count must divide: every micro-batch (of each
        scheduled batch size) and the validation batch."""
        return math.gcd(self.eval_rows, *(b // self.grad_accum for b in self.batch_sizes))

    @property
    def batch_sizes(self) -> list[int]:
        """The distinct batch sizes training steps use (one compiled step each)."""
        return sorted({rows for _, rows in self.batch_size_schedule} | {self.batch_size})

    def batch_size_at(self, step: int) -> int:
        """Sequences in step `step`'s batch (0-based): batch_size_schedule's, or batch_size.

        >>> t = TrainConfig(batch_size=8, batch_size_schedule=[[0, 2], [10, 4], [20, 8]])
        >>> [t.batch_size_at(s) for s in (0, 9, 10, 25)], t.sequences_before(12)
        ([2, 2, 4, 8], 28)
        """
        return max(((start, rows) for start, rows in self._stages() if start <= step))[1]

    @property
    def checkpoint_every(self) -> int:
        """Steps between checkpoints: checkpoint_interval, or eval_interval."""
        return self.checkpoint_interval or self.eval_interval

    def steps_in_call(self, step: int) -> int:
        """Steps the call from `step` runs: train.steps_per_call, or 1 (a call per step) where
        that many would pass the next log, evaluation or checkpoint step, batch-size change or
        max_steps (the loop acts there, and several processes agree there whether to stop).
        One program of train.steps_per_call steps and at most one of a single step.

        >>> t = TrainConfig(max_steps=95, steps_per_call=20, log_interval=50, eval_interval=90)
        >>> [t.steps_in_call(s) for s in (0, 20, 40, 49, 50, 70, 90)]
        [20, 20, 1, 1, 20, 20, 1]
        """
        intervals = (self.log_interval, self.eval_interval, self.checkpoint_every)
        ends = [self.max_steps, *((step // every + 1) * every for every in intervals)]
        ends += [start for start, _ in self._stages() if start > step]
        return self.steps_per_call if step + self.steps_per_call <= min(ends) else 1

    def sequences_before(self, step: int) -> int:
        """Sequences trained on in steps 0..step-1 (what the schedule's stages add up to)."""
        stages = self._stages()
        ends = [start for start, _ in stages[1:]] + [step]
        return sum(rows * max(0, min(end, step) - start)
                   for (start, rows), end in zip(stages, ends, strict=True))  # fmt: skip

    def _stages(self) -> list[tuple[int, int]]:
        return [(a, b) for a, b in self.batch_size_schedule] or [(0, self.batch_size)]

    def _check_batch_size_schedule(self) -> None:
        """[[0, b0], [s1, b1], ...]: steps rising from 0, each size dividing by grad_accum and
        at most batch_size, the last one batch_size (the full batch memory is planned for)."""
        schedule, key = self.batch_size_schedule, "train.batch_size_schedule"
        if not schedule:
            return
        if not all(isinstance(e, list) and len(e) == 2 for e in schedule):
            raise UsageError(f"{key} must be [[from_step, batch_size], ...], got {schedule}")
        steps = [start for start, _ in schedule]
        if steps[0] != 0 or steps != sorted(set(steps)):
            raise UsageError(f"{key}'s steps must start at 0 and rise, got {steps}")
        for start, rows in schedule:
            checks.non_negative(f"{key}'s step", start)
            checks.positive(f"{key}'s batch size", rows)
            if rows > self.batch_size or rows % self.grad_accum:
                raise UsageError(
                    f"{key}'s batch size {rows} must be at most train.batch_size "
                    f"({self.batch_size}) and divisible by train.grad_accum ({self.grad_accum})"
                )
        if schedule[-1][1] != self.batch_size:
            raise UsageError(
                f"{key} must end at train.batch_size ({self.batch_size}), got {schedule[-1][1]}"
            )

    def validate(self) -> Self:
        """Raise UsageError naming the first bad value; return self if all are good.

        Counts are integers in 1..2**31-1 (0 allowed where it means "off"), the seed in
        0..2**32-1, every float finite and in its own range (betas in [0, 1), a positive
        learning rate, min_lr <= learning_rate).
        """
        for key in ("batch_size", "max_steps", "grad_accum", "eval_interval", "eval_steps"):
            checks.positive(f"train.{key}", getattr(self, key))
        checks.positive("train.log_interval", self.log_interval)
        checks.positive("train.steps_per_call", self.steps_per_call)
        checks.positive("train.quant_group_size", self.quant_group_size)
        checks.positive("train.muon_ns_steps", self.muon_ns_steps)
        # Each iteration is unrolled into the step program: a huge count would compile forever.
        checks.at_most("train.muon_ns_steps", self.muon_ns_steps, MAX_NS_STEPS)
        for key in ("warmup_steps", "lr_decay_steps", "weight_decay", "grad_clip"):
            checks.non_negative(f"train.{key}", getattr(self, key))
        checks.non_negative("train.checkpoint_interval", self.checkpoint_interval)
        checks.non_negative("train.eval_batch_size", self.eval_batch_size)
        checks.non_negative("train.min_lr", self.min_lr)
        if not 0 <= self.seed <= checks.SEED_MAX:
            raise UsageError(
                f"train.seed must be in 0..{checks.SEED_MAX} (2**32-1), got {self.seed}"
            )
        checks.finite("train.learning_rate", self.learning_rate)
        if self.learning_rate <= 0:
            raise UsageError(f"train.learning_rate must be positive, got {self.learning_rate}")
        if self.min_lr > self.learning_rate:
            raise UsageError(
                f"train.min_lr ({self.min_lr}) must not exceed train.learning_rate "
                f"({self.learning_rate})"
            )
        if self.optimizer not in OPTIMIZERS:
            raise UsageError(
                f"train.optimizer must be one of {', '.join(OPTIMIZERS)}; got {self.optimizer!r}"
            )
        if self.lr_schedule not in SCHEDULES:
            raise UsageError(
                f"train.lr_schedule must be one of {', '.join(SCHEDULES)}; got {self.lr_schedule!r}"
            )
        checks.finite("train.muon_learning_rate", self.muon_learning_rate)
        if self.muon_learning_rate <= 0:
            raise UsageError(
                f"train.muon_learning_rate must be positive, got {self.muon_learning_rate}"
            )
        self._check_muon_options()
        if not 0 <= self.decay_fraction <= 1:  # also false for NaN
            raise UsageError(f"train.decay_fraction must be in [0, 1], got {self.decay_fraction}")
        for key, value in {"train.beta1": self.beta1, "train.beta2": self.beta2}.items():
            if not 0 <= value < 1:  # also false for NaN
                raise UsageError(f"{key} must be in [0, 1), got {value}")
        if self.batch_size % self.grad_accum:
            raise UsageError(
                f"train.batch_size ({self.batch_size}) must be divisible by train.grad_accum "
                f"({self.grad_accum})"
            )
        self._check_batch_size_schedule()
        if self.tracker not in TRACKERS:
            raise UsageError(
                f"train.tracker must be one of {', '.join(TRACKERS)}; got {self.tracker!r}"
            )
        check_cpu_devices(self.cpu_devices, self.shared_rows)
        if self.qat_bits not in (0, 4, 8):
            raise UsageError(f"train.qat_bits must be 0 (off), 8 or 4, got {self.qat_bits}")
        return self

    def _check_muon_options(self) -> None:
        for name in ("normuon", "cautious_weight_decay"):
            if not isinstance(getattr(self, name), bool):
                raise UsageError(f"train.{name} must be true or false, got {getattr(self, name)!r}")
        if self.muon_orthogonalizer not in ORTHOGONALIZERS:
            raise UsageError(
                f"train.muon_orthogonalizer must be one of {', '.join(ORTHOGONALIZERS)}; got "
                f"{self.muon_orthogonalizer!r}"
            )
        if self.muon_orthogonalizer == "polar_express" and self.muon_ns_steps != len(POLAR_EXPRESS):
            raise UsageError(
                f"train.muon_ns_steps must be {len(POLAR_EXPRESS)} with "
                f"train.muon_orthogonalizer='polar_express' (its coefficients are computed for "
                f"{len(POLAR_EXPRESS)} iterations), got {self.muon_ns_steps}"
            )
        if self.optimizer != "muon":
            for name, off in (("normuon", False), ("muon_orthogonalizer", "newton_schulz")):
                if getattr(self, name) != off:
                    value = str(off).lower() if isinstance(off, bool) else off
                    raise UsageError(
                        f"train.{name} needs train.optimizer='muon' (with "
                        f"{self.optimizer!r}, add train.{name}={value})"
                    )
