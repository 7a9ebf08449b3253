#!/usr/bin/env python3
"""Lower every compiled program for GPUs and TPUs on this machine, and check what is in them.

    python scripts/check_lowering.py                               # the demo config, 1 device
    python scripts/check_lowering.py --config gpt2_124m --devices 8
    python scripts/check_lowering.py --platforms cuda --config shakespeare model.n_layer=2

For each compute dtype (float32, bfloat16) and platform (cuda, rocm, tpu), the train step (the
config's optimizer, the other one, gradient accumulation, mixture of experts, int4 QAT; with
--devices N each data-parallel and FSDP over N CPU devices), the evaluation, --inference's
decode programs and the server's programs are traced as that platform's host would trace them
(cuDNN flash attention on an H100 in bf16) and lowered with nothing allocated
(model/accelerators/lowering.py has what is checked: no float64, no host callbacks, cuDNN
where the model picks it, no float32 x bf16 products in bf16). Prints a table, program x
platform x dtype, then each problem; exit code 0 only if every program lowers clean.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone, uninstalled

from plumbing.cli import OneLineParser, one_line_errors

PLATFORMS = ("cuda", "rocm", "tpu")
GROUPS = ("train", "decode", "serve")


def build_parser() -> OneLineParser:
    p = OneLineParser(prog="check_lowering.py", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None, help="config name or TOML file (default shakespeare)")
    p.add_argument(
        "--platforms", default=",".join(PLATFORMS), help="comma-separated: cuda, rocm, tpu"
    )
    p.add_argument("--devices", type=int, default=1, help="CPU devices to shard over (DP, FSDP)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="compute dtypes to lower")
    p.add_argument(
        "--programs", default=",".join(GROUPS), help="comma-separated: train, decode, serve"
    )
    p.add_argument(
        "--variants",
        default=None,
        help="train-step variants (default all: adamw, muon, accumulation, moe, qat int4; "
        "'none' for the config alone)",
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks for user errors")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    return p


def _choices(text: str, allowed: tuple[str, ...], what: str) -> tuple[str, ...]:
    from plumbing.errors import UsageError

    chosen = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [x for x in chosen if x not in allowed]
    if bad or not chosen:
        raise UsageError(f"--{what} takes {', '.join(allowed)}; got {text!r}")
    return chosen


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with one_line_errors("check_lowering", args.debug):
        from plumbing.errors import UsageError

        if not 1 <= args.devices <= 512:
            raise UsageError(f"--devices must be in 1..512, got {args.devices}")
        platforms = _choices(args.platforms, PLATFORMS, "platforms")
        dtypes = _choices(args.dtypes, ("float32", "bfloat16"), "dtypes")
        groups = _choices(args.programs, GROUPS, "programs")
        # Before JAX starts: the CPU device count is read once, when its backend starts.
        from model.processes.cpu_devices import DEVICE_COUNT_FLAG
        from model.processes.xla_flags import add_xla_flag, without_xla_flag, xla_flags

        os.environ["XLA_FLAGS"] = without_xla_flag(DEVICE_COUNT_FLAG, xla_flags())
        add_xla_flag(DEVICE_COUNT_FLAG, str(args.devices))
        import jax

        if jax.device_count() != args.devices:  # JAX started before (called in-process)
            raise UsageError(
                f"JAX already runs with {jax.device_count()} devices, not {args.devices}"
            )
        from configs.schema import load_config, resolve_config_path
        from model.accelerators.lowering import VARIANTS
        from model.accelerators.plan import planned_config

        cfg = planned_config(load_config(resolve_config_path(args.config), args.overrides))
        if args.variants is None:
            variants = tuple(VARIANTS)
        elif args.variants == "none":
            variants = ()
        else:
            variants = _choices(args.variants, tuple(VARIANTS), "variants")
        return report(cfg, platforms, dtypes, groups, variants, args.devices)
    return 2


def report(cfg, platforms, dtypes, groups, variants, devices: int) -> int:
    import jax

    from model.accelerators.lowering import lower_all

    started = time.perf_counter()
    m = cfg.model
    print(
        f"check_lowering: config {cfg.name}, {m.n_layer} layers x {m.n_embd}, context "
        f"{m.block_size}, vocab {m.vocab_size:,}; {jax.device_count()} CPU device(s) standing "
        f"in for {devices} accelerator(s); jax {jax.__version__}",
        file=sys.stderr,
    )
    results = lower_all(cfg, platforms, dtypes, groups, variants)
    columns = [(p, d) for d in dtypes for p in platforms]
    cells: dict[str, dict[tuple[str, str], str]] = {}
    for r in results:
        cell = "n/a" if r.attention == "n/a" else ("ok" if r.ok else "FAIL")
        if r.attention == "cudnn" and r.ok:
            cell = "ok cuDNN"
        cells.setdefault(r.program, {})[(r.platform, r.dtype)] = cell
    width = max(len(name) for name in cells) + 2
    short = {"float32": "f32", "bfloat16": "bf16"}
    print("program".ljust(width) + "".join(f"{p} {short[d]}".ljust(11) for p, d in columns))
    for name, row in cells.items():
        print(name.ljust(width) + "".join(row.get(c, "-").ljust(11) for c in columns))
    failed = [r for r in results if not r.ok]
    for r in failed:
        for problem in r.problems:
            print(f"FAIL {r.program} / {r.platform} / {r.dtype}: {problem}")
    lowered = sum(r.attention != "n/a" for r in results)
    print(
        f"check_lowering: {lowered - len(failed)} of {lowered} lowerings clean "
        f"({time.perf_counter() - started:.0f} s)",
        file=sys.stderr,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.exit(main())
