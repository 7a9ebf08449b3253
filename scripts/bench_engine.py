"""The serving engine without HTTP: where a batch's time goes, on this machine's JAX device.

It loads a trained `--run` as `--serve` does and starts the engine (model.serving.engine) on
it. Two tables follow:

- Waves: for each client count C, C requests submitted at once (seed i, temperature 0.8,
  `--max-tokens` each, one shared `--prompt`), medians over `--repeats` rounds of the generated
  tokens/s (from the engine's own `tokens_served`) and of the engine thread's time per
  generated token, split by what it does: launching chunks (returns when the chunk is queued;
  on a GPU once the step counts were fixed, see docs/serving.md), delivering the
  previous chunk (waiting for it, then handing out text), admitting requests (their prompts'
  prefill).
- Chunks: each compiled decode chunk alone (`--chunk-steps` steps), per row count at its
  shortest and longest cache length: ms per step, median of 15 after one run.
- With `--profile DIR`: 5 chunks of 1 row and of all rows at the longest cache length under
  `jax.profiler` (Perfetto traces in DIR), and, on a GPU, what the device did per step: its
  kernels, the time they kept it busy, and the costliest ones (scripts/device_trace.py).

Compare one machine's figures with `scripts/bench_serve.py` (the same engine over HTTP).
Time it alone:

    python scripts/bench_engine.py --run runs/bpe11m
    python scripts/bench_engine.py --run runs/shakespeare --clients 1 16 64 --rows 64
    python scripts/bench_engine.py --run runs/bpe11m --profile /tmp/engine-profile
"""

from __future__ import annotations

import shlex
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone, uninstalled

from device_trace import summary as device_summary  # beside this script

from plumbing.cli import OneLineParser, one_line_errors
from plumbing.machine import machine_line

PARTS = {"_chunk": "launching", "_deliver_chunk": "delivering", "_admit": "admitting"}
PROMPT = "ROMEO:\nWhat light through yonder window breaks?"


def timed_parts(engine) -> dict[str, float]:
    """Wrap the engine's own steps (on this instance) to add up seconds per part."""
    spent: dict[str, float] = defaultdict(float)

    def wrap(name, method):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start

        return timed

    for name in PARTS:
        setattr(engine, name, wrap(name, getattr(engine, name)))
    return spent


def wave(engine, spent: dict, clients: int, max_tokens: int, prompt: list[int]) -> dict:
    """`clients` requests at once; their tokens/s and the engine thread's ms per token."""
    from model.decoding.sampling_params import SamplingParams
    from model.serving.requests import Request

    ended = threading.Semaphore(0)
    failures = []

    def on_event(kind, data):
        if kind == "error":
            failures.append(data)
        if kind in ("done", "error"):
            ended.release()

    before = engine.stats()["tokens_served"]
    spent.clear()
    start = time.perf_counter()
    for i in range(clients):
        sampling = SamplingParams(temperature=0.8, seed=i)
        engine.submit(Request(list(prompt), max_tokens, on_event, sampling))
    for _ in range(clients):
        ended.acquire()
    wall = time.perf_counter() - start
    if failures:
        raise RuntimeError(f"a request failed: {failures[0]}")
    tokens = engine.stats()["tokens_served"] - before
    per_token = {part: 1e3 * spent[name] / tokens for name, part in PARTS.items()}
    return {"tokens_per_s": tokens / wall, **per_token}


def run_chunks(engine, rows: int, length: int, steps: int, runs: int) -> list[float]:
    """`runs` compiled chunks alone (the engine thread stopped), each from the start of the
    rows again: the seconds of each."""
    import jax

    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(engine._chunk(steps, rows, length))
        times.append(time.perf_counter() - start)
        engine.pos[:] = 0
    return times


def chunk_ms_per_step(engine, rows: int, length: int, steps: int) -> float:
    """One compiled chunk alone: ms per step, median of 15 after one run."""
    return 1e3 * statistics.median(run_chunks(engine, rows, length, steps, 16)[1:]) / steps


def profile_chunks(engine, rows: int, length: int, steps: int, folder: Path) -> None:
    """5 chunks under jax.profiler; the device's work per step, where the trace has it."""
    import jax

    run_chunks(engine, rows, length, steps, 1)  # compiled and warm
    with jax.profiler.trace(str(folder), create_perfetto_trace=True):
        ms = 1e3 * sum(run_chunks(engine, rows, length, steps, 5)) / (5 * steps)
    trace = max(folder.glob("**/perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    found = device_summary(trace, steps=5 * steps)
    print(f"\n{rows} row(s), cache length {length}: {ms:.3f} ms a step under the profiler; "
          f"trace {trace}")  # fmt: skip
    if found is None:
        print("no device timeline in the trace (a CPU runs XLA's ops on host threads): open "
              "it in Perfetto")  # fmt: skip
        return
    print(f"a step: {found['kernels_per_step']:.0f} device kernels, busy "
          f"{found['busy_ms_per_step']:.3f} ms of {found['span_ms_per_step']:.3f} ms from the "
          "first kernel's start to the last one's end")  # fmt: skip
    for name, ms_step, launches in found["top"]:
        print(f"  {ms_step:.4f} ms a step, {launches:g} launches: {name[:80]}")


def main(argv: list[str] | None = None) -> None:
    p = OneLineParser(prog="bench_engine.py", description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, help="a trained run directory")
    p.add_argument("--rows", type=int, default=16, help="batch rows (serve.batch_size)")
    p.add_argument("--chunk-steps", type=int, default=8, help="steps per chunk")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="rounds; the table shows medians")
    p.add_argument("--prompt", default=PROMPT, help="every request's prompt")
    p.add_argument("--profile", type=Path, help="also trace chunks with jax.profiler, here")
    args = p.parse_args(argv)
    if min(args.clients) < 1 or min(args.rows, args.chunk_steps, args.max_tokens) < 1:
        p.error("--clients, --rows, --chunk-steps and --max-tokens must be >= 1")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")

    with one_line_errors("bench_engine"):
        from model.processes.cpu_kernels import configure_cpu_kernels

        configure_cpu_kernels()  # as `--serve` does, before JAX starts its backend
        import jax

        from model.processes.compilation_cache import enable_compilation_cache

        enable_compilation_cache()  # as `--serve`: a second start skips compiling

        from model.rundir.trained import load_for_sampling
        from model.serving.engine import Engine

        tokenizer, model = load_for_sampling(Path(args.run), None, None)
        engine = Engine(
            model, tokenizer, rows=args.rows, queue_size=max(args.clients),
            chunk_steps=args.chunk_steps,
        )  # fmt: skip
        start = time.perf_counter()
        engine.start()
        cfg = model.cfg
        print("command: python " + shlex.join(["scripts/bench_engine.py", *(argv or sys.argv[1:])]))
        print(machine_line())
        print(
            f"model: {Path(args.run).name}, {cfg.n_layer} layers x {cfg.n_embd}, context "
            f"{cfg.block_size}, vocab {cfg.vocab_size}; JAX {jax.default_backend()}; "
            f"{args.rows} rows, {args.chunk_steps} steps a chunk; started in "
            f"{time.perf_counter() - start:.1f} s"
        )
        spent = timed_parts(engine)
        prompt = tokenizer.encode(args.prompt)
        wave(engine, spent, 1, args.max_tokens, prompt)  # warm-up
        rounds = defaultdict(list)
        for _ in range(args.repeats):  # rounds interleave the client counts
            for clients in args.clients:
                rounds[clients].append(wave(engine, spent, clients, args.max_tokens, prompt))
        print(f"\n{args.max_tokens} tokens a request, medians of {args.repeats} round(s)\n")
        print("| requests at once | tokens/s | engine thread ms per token: "
              + " | ".join(PARTS.values()) + " |")  # fmt: skip
        print("|---:|---:|" + "---:|" * len(PARTS))
        for clients, results in rounds.items():
            cells = [statistics.median(r[k] for r in results) for k in results[0]]
            print(f"| {clients} | {cells[0]:,.0f} | " + " | ".join(f"{c:.3f}" for c in cells[1:])
                  + " |")  # fmt: skip
        engine.stop()  # from here on this thread owns the batch
        print(f"\n| rows | cache length | ms per step (a {args.chunk_steps}-step chunk alone) |")
        print("|---:|---:|---:|")
        for rows, lengths in engine.programs.lengths.items():
            for length in sorted({min(lengths), max(lengths)}):
                ms = chunk_ms_per_step(engine, rows, length, args.chunk_steps)
                print(f"| {rows} | {length} | {ms:.3f} |")
        if args.profile:
            for rows in sorted({1, max(engine.programs.lengths)}):
                length = max(engine.programs.lengths[rows])
                folder = args.profile / f"rows{rows}"
                profile_chunks(engine, rows, length, args.chunk_steps, folder)


if __name__ == "__main__":
    main()
