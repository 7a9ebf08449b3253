"""Decoding speed with and without the KV cache, on the same model: a Markdown table.

Random weights by default (speed does not depend on them), or a trained run with --run DIR
(then sampled with the run's own [sample] settings, as `--inference` does, unless flags say
otherwise). Each mode is run once to compile (reported apart), then timed `--repeats` times;
the table shows medians of the steady-state decode rate: the tokens after the first over the
time after the first, measured by the same clock as the timing line of `--inference`
(model.decoding.generate.DecodeClock), so the two figures can be compared. Time it alone, e.g.:

    flock /tmp/tinyllm-bench.lock python scripts/bench_generate.py
    flock /tmp/tinyllm-bench.lock python scripts/bench_generate.py --nanogpt-size
    flock /tmp/tinyllm-bench.lock python scripts/bench_generate.py --run runs/shakespeare \
        --new-tokens 300 --skip-no-cache
    flock /tmp/tinyllm-bench.lock python scripts/bench_generate.py --chunk-sizes 1,4,16,64
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone, uninstalled

import jax
from flax import nnx

from model.decoding.clock import DecodeClock
from model.decoding.generate import generate
from model.decoding.programs import DEFAULT_CHUNK_SIZE
from model.network.config import ModelConfig
from model.network.gpt import GPT, count_params
from plumbing.cli import OneLineParser

NANOGPT_CHAR = dict(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128)


def timed_run(model: GPT, prompt: list[int], **kwargs) -> DecodeClock:
    """One generation, consumed as the CLI consumes it, with its clock."""
    clock = DecodeClock(start=time.perf_counter())
    for chunk in generate(model, prompt, **kwargs):
        clock.tick(chunk)
    return clock


def time_generation(
    model: GPT,
    *,
    new_tokens: int = 500,
    repeats: int = 5,
    use_cache: bool = True,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    num_samples: int = 1,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> dict:
    """Time generation on any GPT: {"tokens_per_s", "first_token_s", "compile_s", "runs"}.

    tokens_per_s is the median steady-state decode rate (after the first token); first_token_s
    the median time to the first token once compiled (prefill + one step); compile_s the
    first run's extra time to its first token. Temperature 1 by default, so the tokens are not
    a fixed point of greedy decoding.
    """
    kwargs = dict(
        max_new_tokens=new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        use_cache=use_cache,
        chunk_size=chunk_size,
        num_samples=num_samples,
    )
    prompt = [0]  # one token, as nanoGPT's sample.py starts from "\n"
    cold = timed_run(model, prompt, seed=0, **kwargs)
    runs = [timed_run(model, prompt, seed=i + 1, **kwargs) for i in range(repeats)]
    for clock in runs:
        assert clock.new_tokens == num_samples * new_tokens
    first = statistics.median(c.first_token_s for c in runs)
    return {
        "tokens_per_s": statistics.median(c.tokens_per_s for c in runs),
        "first_token_s": first,
        "compile_s": max(0.0, cold.first_token_s - first),
        "runs": [(c.first_token_s, c.tokens_per_s) for c in runs],
    }


def random_model(cfg: ModelConfig, seed: int = 0) -> GPT:
    return GPT(cfg, rngs=nnx.Rngs(params=seed))


def trained_model(run_dir: str):
    """(model, the run's saved [sample] settings) of a training run directory."""
    from configs.schema import config_from_dict
    from model.rundir.trained import open_trained_run

    _, model, meta = open_trained_run(run_dir).load()
    return model, config_from_dict(meta["config"]).sample


def main(argv: list[str] | None = None) -> None:
    p = OneLineParser(prog="bench_generate.py", description=__doc__.splitlines()[0])
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--nanogpt-size", action="store_true", help="nanoGPT's 0.8M char model")
    p.add_argument("--run", help="benchmark a trained run directory instead of random weights")
    p.add_argument("--new-tokens", type=int, default=500)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE)
    p.add_argument("--chunk-sizes", help="comma list: sweep chunk sizes (cache on) instead")
    p.add_argument("--skip-no-cache", action="store_true")
    p.add_argument("--temperature", type=float, help="default: the run's, else 1.0")
    p.add_argument("--top-k", type=int, dest="top_k", help="default: the run's, else 0 (off)")
    p.add_argument("--top-p", type=float, dest="top_p", help="default: the run's, else 1.0")
    args = p.parse_args(argv)

    sampling = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    if args.run:
        model, saved = trained_model(args.run)
        sampling = {k: getattr(saved, k) for k in sampling}
    else:
        sizes = dict(
            vocab_size=args.vocab_size,
            block_size=args.block_size,
            n_layer=args.n_layer,
            n_head=args.n_head,
            n_embd=args.n_embd,
        )
        model = random_model(ModelConfig(**(NANOGPT_CHAR if args.nanogpt_size else sizes)))
    sampling.update({k: getattr(args, k) for k in sampling if getattr(args, k) is not None})
    cfg = model.cfg
    print(f"command: python {' '.join(sys.argv)}")
    print(
        f"model: {count_params(model) / 1e6:.2f}M params, vocab {cfg.vocab_size}, "
        f"context {cfg.block_size}, {cfg.n_layer} layers x {cfg.n_head} heads x {cfg.n_embd}; "
        f"{args.new_tokens} new tokens x {args.num_samples} samples, median of {args.repeats}, "
        f"temperature {sampling['temperature']}, top-k {sampling['top_k']}, "
        f"top-p {sampling['top_p']}, device {jax.devices()[0].platform}\n"
    )

    if args.chunk_sizes:
        print("| chunk size | decode tokens/s | first token s | compile s |")
        print("|---:|---:|---:|---:|")
        for size in [int(s) for s in args.chunk_sizes.split(",")]:
            r = time_generation(
                model,
                new_tokens=args.new_tokens,
                repeats=args.repeats,
                chunk_size=size,
                num_samples=args.num_samples,
                **sampling,
            )
            print(
                f"| {size} | {r['tokens_per_s']:,.0f} | {r['first_token_s']:.3f} | "
                f"{r['compile_s']:.1f} |"
            )
        return

    rows = []
    for use_cache in (True, False):
        if not use_cache and args.skip_no_cache:
            continue
        r = time_generation(
            model,
            new_tokens=args.new_tokens,
            repeats=args.repeats,
            use_cache=use_cache,
            chunk_size=args.chunk_size,
            num_samples=args.num_samples,
            **sampling,
        )
        rows.append(("KV cache" if use_cache else "no cache (full forward)", r))
    print("| mode | decode tokens/s | first token s | compile s | speed-up |")
    print("|---|---:|---:|---:|---:|")
    slowest = min(r["tokens_per_s"] for _, r in rows)
    for name, r in rows:
        print(
            f"| {name} | {r['tokens_per_s']:,.0f} | {r['first_token_s']:.3f} | "
            f"{r['compile_s']:.1f} | {r['tokens_per_s'] / slowest:.1f}x |"
        )


if __name__ == "__main__":
    main()
