"""Decoding speed with and without the KV cache, on the same model: a Markdown table.

Random weights by default (speed does not depend on them), or a trained run with --run DIR.
Each mode is run once to compile (reported apart), then timed `--repeats` times; the table
shows medians. Time it alone on the machine, e.g.:

    flock /tmp/tinyllm-bench.lock python scripts/bench_generate.py
    flock /tmp/tinyllm-bench.lock python scripts/bench_generate.py --nanogpt-size
    flock /tmp/tinyllm-bench.lock python scripts/bench_generate.py --chunk-sizes 1,4,16,64
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
from flax import nnx

from model.config import ModelConfig
from model.generate import DEFAULT_CHUNK_SIZE, generate_all
from model.gpt import GPT, count_params

NANOGPT_CHAR = dict(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128)


def time_generation(
    model: GPT,
    *,
    new_tokens: int = 500,
    repeats: int = 5,
    use_cache: bool = True,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    num_samples: int = 1,
) -> dict:
    """Time `generate_all` on any GPT: {"compile_s", "median_s", "tokens_per_s", "runs_s"}.

    The first call compiles (its extra time is reported as compile_s); the others are timed.
    Sampling at temperature 1 so the tokens are not a fixed point of greedy decoding.
    """
    kwargs = dict(
        max_new_tokens=new_tokens,
        temperature=1.0,
        top_k=0,
        use_cache=use_cache,
        chunk_size=chunk_size,
        num_samples=num_samples,
    )
    prompt = [0]  # one token, as nanoGPT's sample.py starts from "\n"
    start = time.perf_counter()
    generate_all(model, prompt, seed=0, **kwargs)
    first = time.perf_counter() - start
    runs = []
    for i in range(repeats):
        start = time.perf_counter()
        out = generate_all(model, prompt, seed=i + 1, **kwargs)
        runs.append(time.perf_counter() - start)
        assert out.shape == (num_samples, new_tokens)
    median = statistics.median(runs)
    return {
        "compile_s": max(0.0, first - median),
        "median_s": median,
        "tokens_per_s": num_samples * new_tokens / median,
        "runs_s": runs,
    }


def random_model(cfg: ModelConfig, seed: int = 0) -> GPT:
    return GPT(cfg, rngs=nnx.Rngs(params=seed))


def trained_model(run_dir: str) -> GPT:
    """The model of a training run directory (needs the lead's inference stage)."""
    from model.inference_stage import load_trained

    _, model, _ = load_trained(Path(run_dir))
    return model


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    args = p.parse_args(argv)

    if args.run:
        model = trained_model(args.run)
    else:
        sizes = dict(
            vocab_size=args.vocab_size,
            block_size=args.block_size,
            n_layer=args.n_layer,
            n_head=args.n_head,
            n_embd=args.n_embd,
        )
        model = random_model(ModelConfig(**(NANOGPT_CHAR if args.nanogpt_size else sizes)))
    cfg = model.cfg
    print(f"command: python {' '.join(sys.argv)}")
    print(
        f"model: {count_params(model) / 1e6:.2f}M params, vocab {cfg.vocab_size}, "
        f"context {cfg.block_size}, {cfg.n_layer} layers x {cfg.n_head} heads x {cfg.n_embd}; "
        f"{args.new_tokens} new tokens x {args.num_samples} samples, median of {args.repeats}, "
        f"device {jax.devices()[0].platform}\n"
    )

    if args.chunk_sizes:
        print("| chunk size | tokens/s | median s | compile s |")
        print("|---:|---:|---:|---:|")
        for size in [int(s) for s in args.chunk_sizes.split(",")]:
            r = time_generation(
                model,
                new_tokens=args.new_tokens,
                repeats=args.repeats,
                chunk_size=size,
                num_samples=args.num_samples,
            )
            print(
                f"| {size} | {r['tokens_per_s']:.0f} | {r['median_s']:.3f} | {r['compile_s']:.1f} |"
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
        )
        rows.append(("KV cache" if use_cache else "no cache (full forward)", r))
    print("| mode | tokens/s | median s | compile s | speed-up |")
    print("|---|---:|---:|---:|---:|")
    slowest = min(r["tokens_per_s"] for _, r in rows)
    for name, r in rows:
        print(
            f"| {name} | {r['tokens_per_s']:.0f} | {r['median_s']:.3f} | "
            f"{r['compile_s']:.1f} | {r['tokens_per_s'] / slowest:.1f}x |"
        )


if __name__ == "__main__":
    main()
