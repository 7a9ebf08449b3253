"""The --tokenize stage: corpus -> trained (or loaded) tokenizer -> run_dir/tokenizer.pkl.

>>> run_tokenize(load_config("configs/shakespeare.toml"), Path("runs/x"))  # doctest: +SKIP
{'vocab_size': 1024, 'bytes_per_token': 3.1, ...}
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

from tokenizer import BPETokenizer, CharTokenizer, Tokenizer
from tokenizer.config import DataConfig, TokenizerConfig
from tokenizer.corpus import corpus_for
from tokenizer.gpt2_files import pretrained_gpt2_paths
from tokenizer.io import TOKENIZER_FILE

SUMMARY_SAMPLE_CHARS = 8 << 20  # bytes/token is measured on at most the first 8M characters


class TokenizeSettings(Protocol):
    """What this stage reads of a run's config (configs.schema.Config has both sections)."""

    tokenizer: TokenizerConfig
    data: DataConfig


def build_tokenizer(tok: TokenizerConfig, texts: Iterable[str], progress: bool = True) -> Tokenizer:
    """Train (bpe, char) on `texts` or load (gpt2) the tokenizer the section asks for."""
    if tok.kind == "gpt2":
        vocab_json, merges_txt = pretrained_gpt2_paths(tok.gpt2_files)
        return BPETokenizer.from_gpt2_files(vocab_json, merges_txt, tok.special_tokens)
    if tok.kind == "char":
        trained = CharTokenizer.train(texts, special_tokens=tok.special_tokens)
        return trained.padded(tok.pad_to_multiple)
    return BPETokenizer.train(
        texts,
        vocab_size=tok.vocab_size,
        special_tokens=tok.special_tokens,
        pattern=tok.pattern,
        progress=progress,
    )


def run_tokenize(cfg: TokenizeSettings, run_dir: Path) -> dict:
    """Train the tokenizer, save it atomically in the run directory, print a summary."""
    corpus = corpus_for(cfg.data)
    start = time.perf_counter()
    print(f"tokenize: {cfg.tokenizer.kind} tokenizer on {corpus.name}", file=sys.stderr)
    if cfg.tokenizer.kind != "char":
        from tokenizer import c_core

        if not c_core.built():
            print(f"tokenize: {c_core.UNAVAILABLE}", file=sys.stderr)
        elif c_core.forced_pure_python():
            print(f"tokenize: {c_core.PURE_PYTHON_ENV} is set: using the pure-Python path",
                  file=sys.stderr)  # fmt: skip
    head: list[str] = []  # the corpus's first characters, kept as training reads them
    tokenizer = build_tokenizer(cfg.tokenizer, _keep_head(corpus.iter_texts(), head), progress=True)
    seconds = time.perf_counter() - start

    # gpt2 reads no corpus to build: read the head for the summary now.
    sample = "".join(head) if head else _head(corpus.iter_texts(), SUMMARY_SAMPLE_CHARS)
    n_bytes = len(sample.encode("utf-8"))
    n_tokens = max(tokenizer.count_tokens(sample), 1)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / TOKENIZER_FILE
    tokenizer.save(path)
    summary = {
        "vocab_size": tokenizer.vocab_size,
        "bytes_per_token": n_bytes / n_tokens,
        "seconds": seconds,
        "path": str(path),
    }
    print(
        f"tokenize: vocab size {summary['vocab_size']}, "
        f"{summary['bytes_per_token']:.2f} bytes/token on the corpus"
        f"{'' if len(sample) < SUMMARY_SAMPLE_CHARS else ' (first 8M characters)'}, "
        f"{seconds:.1f} s -> {path}",
        file=sys.stderr,
    )
    if cfg.tokenizer.kind == "char" and cfg.tokenizer.pad_to_multiple > 1:
        print(
            f"tokenize: padded to a multiple of {cfg.tokenizer.pad_to_multiple} tokens with "
            "placeholder characters the text does not hold (tokenizer.pad_to_multiple)",
            file=sys.stderr,
        )
    if cfg.tokenizer.kind == "bpe" and tokenizer.vocab_size < cfg.tokenizer.vocab_size:
        print(
            f"tokenize: note: {cfg.tokenizer.vocab_size} tokens were asked for; the text has "
            f"no pair left to merge at {tokenizer.vocab_size}",
            file=sys.stderr,
        )
    return summary


def _keep_head(texts: Iterable[str], head: list[str]) -> Iterator[str]:
    """Pass `texts` through, appending their first SUMMARY_SAMPLE_CHARS characters to head."""
    size = 0
    for piece in texts:
        if size < SUMMARY_SAMPLE_CHARS:
            head.append(piece[: SUMMARY_SAMPLE_CHARS - size])
            size += len(head[-1])
        yield piece


def _head(texts: Iterable[str], limit: int) -> str:
    parts, size = [], 0
    for piece in texts:
        parts.append(piece[: limit - size])
        size += len(parts[-1])
        if size >= limit:
            break
    return "".join(parts)
