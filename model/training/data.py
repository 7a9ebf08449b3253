"""The token cache and the batches drawn from it.

The corpus is encoded once with the run's tokenizer into `run_dir/tokens/tokens.bin` (uint16
when the vocab fits, as nanoGPT's train.bin) plus `meta.json`; training memory-maps it. The
cache is rebuilt when the corpus fingerprint or the tokenizer file changes. The last
`val_fraction` of the tokens is validation (nanoGPT's split).

Batches are random windows whose offsets come from a numpy Generator seeded by (seed, step),
so any step's batch can be recomputed after a resume without replaying the ones before it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from model.processes.distributed import is_primary, wait_for_primary
from model.rundir.layout import TOKENS_DIR
from plumbing.atomic import write_atomic
from plumbing.errors import UsageError
from plumbing.hashing import file_crc32, file_sha256

CACHE_VERSION = 1


@dataclass(frozen=True)
class TokenSplits:
    """Memory-mapped train/val token arrays and what bits-per-byte needs."""

    train: np.ndarray
    val: np.ndarray
    val_bytes: int  # UTF-8 bytes the validation tokens decode to

    @property
    def val_bytes_per_token(self) -> float:
        return self.val_bytes / max(len(self.val), 1)


def load_token_splits(
    corpus,
    tokenizer,
    tokenizer_path: Path,
    run_dir: Path,
    val_fraction: float,
    tokenizer_sha: str | None = None,
) -> TokenSplits:
    """Encode the corpus into the cache if it is missing, stale or damaged, then memory-map it.
    `tokenizer_sha` is the tokenizer file's hash when the caller has it already."""
    cache = run_dir / TOKENS_DIR
    key = {
        "version": CACHE_VERSION,
        "corpus": corpus.fingerprint,
        "tokenizer": tokenizer_sha or file_sha256(tokenizer_path),
    }
    meta_path = cache / "meta.json"
    meta = _read_meta(meta_path)
    if not is_primary():  # several processes: process 0 builds the cache, the others read it
        meta = wait_for_primary(
            lambda: _meta_if_whole(cache, meta_path, key, tokenizer.vocab_size),
            f"the cache {cache}",
        )
    else:
        problem = "" if meta is None else cache_problem(cache, meta, tokenizer.vocab_size)
        if meta is not None and meta.get("key") == key and problem:
            print(f"encode: the token cache in {cache} is damaged ({problem}): rebuilding it",
                  file=sys.stderr)  # fmt: skip
        if meta is None or meta.get("key") != key or problem:
            meta = _build_cache(corpus, tokenizer, cache, key)
            meta["crc32"] = file_crc32(cache / "tokens.bin")
            write_atomic(meta_path, json.dumps(meta, indent=1))
    tokens = np.memmap(cache / "tokens.bin", dtype=meta["dtype"], mode="r")
    n = len(tokens)
    n_val = int(n * val_fraction)
    if n - n_val < 2 or n_val < 2:
        raise UsageError(
            f"the corpus is too small: {n} tokens cannot be split into train and validation"
        )
    train, val = tokens[: n - n_val], tokens[n - n_val :]
    return TokenSplits(train=train, val=val, val_bytes=byte_count(tokenizer, val))


def cache_problem(cache: Path, meta: dict, vocab_size: int, check_crc: bool = True) -> str:
    """'' if the token cache is whole, else what is wrong with it: its dtype must be uint16
    or uint32 (wide enough for the vocab), tokens.bin must hold exactly n_tokens of it, and
    its CRC-32 must match the one recorded when it was built."""
    dtype, n_tokens = meta.get("dtype"), meta.get("n_tokens")
    if dtype not in ("uint16", "uint32"):
        return f"dtype {dtype!r} is not uint16 or uint32"
    if dtype == "uint16" and vocab_size > 1 << 16:
        return f"uint16 cannot hold the {vocab_size} token ids"
    if type(n_tokens) is not int or n_tokens <= 0:
        return f"n_tokens {n_tokens!r} is not a positive integer"
    path = cache / "tokens.bin"
    try:
        size = path.stat().st_size
    except OSError:
        return "tokens.bin is missing"
    expected = n_tokens * np.dtype(dtype).itemsize
    if size != expected:
        return f"tokens.bin has {size:,} bytes, {n_tokens:,} {dtype} tokens need {expected:,}"
    crc = meta.get("crc32")
    if check_crc and crc is not None and crc != file_crc32(path):
        return "tokens.bin does not match its checksum"
    return ""


def remove_cache_leftovers(run_dir: Path) -> None:
    """Delete temp files a killed cache build left behind (the caller is the only writer)."""
    cache = Path(run_dir) / TOKENS_DIR
    if cache.is_dir():
        for path in cache.glob("tokens.bin.tmp*"):
            path.unlink(missing_ok=True)
        for path in cache.glob(".meta.json.*.tmp"):
            path.unlink(missing_ok=True)


def byte_count(tokenizer, ids: np.ndarray) -> int:
    """len(tokenizer.decode_bytes(ids)), from a histogram of the ids: no Python list of a
    whole split and no joined bytes (a large validation split would take gigabytes)."""
    lengths = np.zeros(max(tokenizer.vocab) + 1, np.int64)
    for idx, token in tokenizer.vocab.items():
        lengths[idx] = len(token)
    return int(np.bincount(ids, minlength=len(lengths)) @ lengths)


def _read_meta(path: Path) -> dict | None:
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # missing, unreadable, not UTF-8, not JSON
        return None
    return meta if isinstance(meta, dict) else None


def _meta_if_whole(cache: Path, path: Path, key: dict, vocab_size: int) -> dict | None:
    """The cache's record once process 0 has built it for `key` (the size is checked; the
    CRC-32 was checked by process 0 when it wrote the record)."""
    meta = _read_meta(path)
    if meta is None or meta.get("key") != key:
        return None
    return meta if not cache_problem(cache, meta, vocab_size, check_crc=False) else None


def _build_cache(corpus, tokenizer, cache: Path, key: dict) -> dict:
    """Encode the corpus to tokens.bin on every core (tokenizer.pipeline: ids in order, memory
    bounded by unique chunks), via a temp file + rename, so a crash leaves no half."""
    from tokenizer.pipeline import encode_to_file

    cache.mkdir(parents=True, exist_ok=True)
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    tmp = cache / f"tokens.bin.tmp{os.getpid()}"
    start = time.perf_counter()
    try:
        with open(tmp, "wb") as f:
            n_tokens, n_chars = encode_to_file(
                tokenizer, corpus.iter_texts(), f, np.dtype(dtype).name, progress=True
            )
        if n_tokens == 0:
            raise UsageError(f"the corpus {corpus.name} is empty: nothing to train on")
        os.replace(tmp, cache / "tokens.bin")
    except OSError as err:
        if err.filename is None:  # a write(2) error (a full disk) carries no path: name it
            raise OSError(err.errno, err.strerror, str(cache / "tokens.bin")) from err
        raise
    finally:
        tmp.unlink(missing_ok=True)
    meta = {"key": key, "dtype": np.dtype(dtype).name, "n_tokens": n_tokens, "n_chars": n_chars}
    write_atomic(cache / "meta.json", json.dumps(meta, indent=1))
    seconds = time.perf_counter() - start
    print(
        f"encode: {n_chars:,} characters -> {n_tokens:,} tokens in {seconds:.1f} s "
        f"(cached in {cache})",
        file=sys.stderr,
    )
    return meta


def check_window(tokens: np.ndarray, block_size: int, split: str) -> None:
    """UsageError unless `tokens` holds one window of the context plus its next token.

    >>> check_window(np.arange(9), 8, "validation")  # 8 + 1 tokens: one window, enough
    """
    if len(tokens) <= block_size:
        # The two splits share the text: data.val_fraction moves tokens from one to the other.
        fraction = "larger" if split == "validation" else "smaller"
        raise UsageError(
            f"the {split} split has {len(tokens)} tokens, fewer than the context "
            f"({block_size} + 1): use more text, a {fraction} data.val_fraction or a smaller "
            "model.block_size"
        )


def check_splits(splits: TokenSplits, block_size: int) -> None:
    """Both splits hold a window of the context: checked before the first step, so that a
    validation split too short is not found at the first evaluation, after the training."""
    check_window(splits.train, block_size, "training")
    check_window(splits.val, block_size, "validation")


def sample_batch(
    tokens: np.ndarray, batch_size: int, block_size: int, seed: int, step: int, stream: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Random windows (x, y=x shifted by one), the same for the same (seed, step, stream).

    `stream` keeps training (0) and validation (1) windows independent.

    >>> x, y = sample_batch(np.arange(100, dtype=np.uint16), 2, 8, seed=0, step=3)
    >>> x.shape, bool((y[:, :-1] == x[:, 1:]).all())
    ((2, 8), True)
    """
    check_window(tokens, block_size, ("training", "validation")[stream])
    rng = np.random.default_rng([seed, stream, step])
    offsets = rng.integers(0, len(tokens) - block_size, size=batch_size)
    window = np.stack([tokens[o : o + block_size + 1] for o in offsets]).astype(np.int32)
    return window[:, :-1], window[:, 1:]
