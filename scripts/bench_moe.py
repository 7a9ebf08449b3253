"""Dense MLP vs mixture of experts at equal active parameters and equal steps.

The dense model is configs/shakespeare.toml (4 layers, width 128, GELU MLP 128 -> 512 -> 128).
The MoE model replaces every block's MLP with 4 GELU experts of hidden width 256, top-2: the two
experts a token uses hold as many weights and do as many FLOPs as one dense MLP (2 x 256 = 512
hidden units), so per-token compute is equal and total MLP parameters are 2x. Both train the
same number of steps on the same batches; the table reports validation bits-per-byte and
training tokens/s (median over log intervals, the compiling first one left out), and a
micro-benchmark of one MLP layer's forward + backward at the training batch's token count.

    python scripts/bench_moe.py --input ../shared/data/tinyshakespeare.txt --steps 300

Writes bench_moe.md into --out (default runs/bench_moe).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from configs.schema import load_config  # noqa: E402
from plumbing.cli import OneLineParser  # noqa: E402

EXPERTS, TOP_K = 4, 2
VARIANTS = {
    "dense (GELU 512)": [],
    f"MoE {EXPERTS}x256, top-{TOP_K}": [
        f"model.moe_experts={EXPERTS}",
        f"model.moe_top_k={TOP_K}",
        "model.moe_hidden=256",  # half of 4 * n_embd: two active experts = one dense MLP
    ],
}


def run_variant(name: str, extra: list[str], args, tokenizer_file: Path, out: Path) -> dict:
    from model.network.gpt import GPT, count_params
    from model.rundir.layout import TOKENIZER_FILE
    from model.train_stage import run_train
    from model.training.metrics import read_metrics
    from tokenizer import load_tokenizer

    overrides = [
        f"data.input={json.dumps([str(args.input)])}",
        f"train.max_steps={args.steps}",
        f"train.eval_interval={args.steps}",
        f"train.eval_steps={args.eval_steps}",
        f"train.warmup_steps={min(100, args.steps // 10)}",
        *extra,
    ]
    cfg = load_config(ROOT / "configs" / "shakespeare.toml", overrides)
    run_dir = out / ("moe" if extra else "dense")
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    shutil.copy(tokenizer_file, run_dir / TOKENIZER_FILE)  # one tokenizer for both runs
    final = run_train(cfg, run_dir)

    model_cfg = cfg.model.for_vocab(load_tokenizer(tokenizer_file).vocab_size)
    from flax import nnx

    total = count_params(nnx.eval_shape(lambda: GPT(model_cfg, rngs=nnx.Rngs(0))))
    idle = 0
    if model_cfg.moe_experts:  # the experts a token does not use
        per_expert = 2 * model_cfg.n_embd * model_cfg.moe_hidden
        idle = model_cfg.n_layer * (model_cfg.moe_experts - model_cfg.moe_top_k) * per_expert
    records = [r for r in read_metrics(run_dir) if "tokens_per_sec" in r]
    return {
        "name": name,
        "params": total,
        "active": total - idle,
        "val_bpb": final["val_bpb"],
        "val_loss": final["val_loss"],
        "tok_s": statistics.median(r["tokens_per_sec"] for r in records[1:] or records),
        "dropped": statistics.mean(r.get("moe_dropped_frac", 0.0) for r in records),
        "seconds": records[-1]["elapsed_s"],
        "cfg": model_cfg,
        "batch_tokens": cfg.train.batch_size * model_cfg.block_size,
    }


def time_layers(model_cfg, n_tokens: int, repeats: int = 20) -> list[tuple[str, float]]:
    """ms per forward + backward of one MLP layer on [n_tokens, D]: dense, MoE with capacity
    (training path), MoE dropless (evaluation / decoding path, C = all tokens)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from model.network.layers import DenseMLP
    from model.network.moe import MoEMLP

    x_NxD = jax.random.normal(jax.random.key(0), (n_tokens, model_cfg.n_embd))
    dense_cfg = dataclasses.replace(model_cfg, moe_experts=0)
    layers = [
        ("dense MLP", DenseMLP(dense_cfg, rngs=nnx.Rngs(0)), True),
        (
            f"MoE, capacity factor {model_cfg.moe_capacity_factor}",
            MoEMLP(model_cfg, hidden=model_cfg.moe_hidden, rngs=nnx.Rngs(0)),
            False,
        ),
        ("MoE, dropless", MoEMLP(model_cfg, hidden=model_cfg.moe_hidden, rngs=nnx.Rngs(0)), True),
    ]
    rows = []
    for name, layer, deterministic in layers:

        def loss(layer, x_NxD, deterministic=deterministic):
            y_NxD, aux = layer(x_NxD, deterministic=deterministic)
            return jnp.sum(y_NxD**2) + sum(v for k, v in aux.items() if k.endswith("_loss"))

        step = nnx.jit(nnx.grad(loss))
        jax.block_until_ready(step(layer, x_NxD))  # compile
        start = time.perf_counter()
        for _ in range(repeats):
            grads = step(layer, x_NxD)
        jax.block_until_ready(grads)
        rows.append((name, (time.perf_counter() - start) / repeats * 1e3))
    return rows


def table(rows: list[dict], layer_rows, steps: int, command: str) -> str:
    lines = [
        f"{steps} steps of {rows[0]['batch_tokens']:,} tokens, BPE 1024, 4 layers x 128 wide",
        "",
        "| model | params | active params | val bits/byte | val loss | train tokens/s | "
        "train dropped slots | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        dropped = f"{r['dropped']:.1%}" if r["cfg"].moe_experts else "-"
        lines.append(
            f"| {r['name']} | {r['params'] / 1e6:.3f}M | {r['active'] / 1e6:.3f}M | "
            f"{r['val_bpb']:.4f} | {r['val_loss']:.4f} | {r['tok_s']:,.0f} | {dropped} | "
            f"{r['seconds']:.0f} |"
        )
    lines += ["", f"One MLP layer, forward + backward on {rows[0]['batch_tokens']:,} tokens:", ""]
    lines += ["| layer | ms |", "|---|---|"]
    lines += [f"| {name} | {ms:.2f} |" for name, ms in layer_rows]
    lines += ["", f"command: `{command}`"]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = OneLineParser(
        prog="bench_moe.py", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--input", required=True, help="text file, e.g. tinyshakespeare.txt")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-steps", type=int, default=40)
    p.add_argument("--out", default="runs/bench_moe")
    args = p.parse_args()
    args.input = Path(args.input).resolve()

    from model.rundir.layout import TOKENIZER_FILE
    from tokenizer.stage import run_tokenize

    out = Path(args.out)
    tok_dir = out / "tokenizer"
    shutil.rmtree(tok_dir, ignore_errors=True)
    cfg = load_config(
        ROOT / "configs" / "shakespeare.toml", [f"data.input={json.dumps([str(args.input)])}"]
    )
    run_tokenize(cfg, tok_dir)
    rows = [
        run_variant(name, extra, args, tok_dir / TOKENIZER_FILE, out)
        for name, extra in VARIANTS.items()
    ]
    moe = rows[-1]
    layer_rows = time_layers(moe["cfg"], moe["batch_tokens"])
    command = f"python scripts/bench_moe.py {' '.join(sys.argv[1:])}"
    text = table(rows, layer_rows, args.steps, command)
    (out / "bench_moe.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
