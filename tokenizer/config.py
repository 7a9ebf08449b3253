"""The `[tokenizer]` and `[data]` sections of a run's config: which tokenizer, on what text.

>>> TokenizerConfig(kind="bpe", vocab_size=300).validate().vocab_size
300
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Self

from plumbing import checks
from plumbing.errors import UsageError
from tokenizer.pretokenize import PATTERNS

KINDS = ("bpe", "char", "gpt2")
MAX_PAD_MULTIPLE = 4096  # placeholders come from Unicode's private use area (6,400 points)


@dataclass
class TokenizerConfig:
    kind: str = "bpe"  # bpe (trained here) | char (nanoGPT's baseline) | gpt2 (pretrained r50k)
    vocab_size: int = 2048  # 256 bytes + merges + special tokens (bpe only)
    special_tokens: list[str] = field(default_factory=lambda: ["<|endoftext|>"])
    pattern: str = "gpt2"  # pre-tokenization regex: gpt2 | gpt4 | llama3 | qwen2
    gpt2_files: list[str] = field(default_factory=list)  # vocab.json + merges.txt (kind=gpt2)
    # char only: unused placeholder ids round the vocabulary up to a multiple of this, so
    # that texts of different character sets give the model one shape (tokenizer/char.py)
    pad_to_multiple: int = 1

    def validate(self) -> Self:
        """Raise UsageError naming the first bad value; return self if all are good."""
        if self.kind not in KINDS:
            raise UsageError(f"tokenizer.kind must be bpe, char or gpt2, got {self.kind!r}")
        if self.pattern not in PATTERNS:
            raise UsageError(
                f"tokenizer.pattern must be one of {', '.join(PATTERNS)}, got {self.pattern!r}"
            )
        smallest = 256 + len(self.special_tokens)
        if self.kind == "bpe" and self.vocab_size < smallest:
            raise UsageError(
                f"tokenizer.vocab_size {self.vocab_size} is below 256 bytes + "
                f"{len(self.special_tokens)} special tokens; use at least {smallest}"
            )
        if self.kind == "bpe":
            checks.at_most("tokenizer.vocab_size", self.vocab_size, checks.INT32_MAX)
        if not all(self.special_tokens):
            raise UsageError("tokenizer.special_tokens holds an empty string: remove it")
        if len(set(self.special_tokens)) != len(self.special_tokens):
            raise UsageError(f"tokenizer.special_tokens lists a token twice: {self.special_tokens}")
        checks.positive("tokenizer.pad_to_multiple", self.pad_to_multiple)
        checks.at_most("tokenizer.pad_to_multiple", self.pad_to_multiple, MAX_PAD_MULTIPLE)
        if self.pad_to_multiple > 1 and self.kind != "char":
            raise UsageError(
                "tokenizer.pad_to_multiple pads a char tokenizer's vocabulary; a bpe or gpt2 "
                "vocabulary is set by tokenizer.vocab_size or fixed: leave it at 1"
            )
        if self.gpt2_files and len(self.gpt2_files) != 2:
            raise UsageError("tokenizer.gpt2_files must name two files: vocab.json, merges.txt")
        for name in self.gpt2_files:
            checks.file_name("tokenizer.gpt2_files", name)
        return self

    def smallest_vocab(self) -> int:
        """The fewest tokens this tokenizer can have before it is trained: a BPE's bytes and
        special tokens (a small text can stop its merges early), GPT-2's fixed vocabulary, or
        one character for `char`."""
        if self.kind == "gpt2":
            return 50257
        return (256 if self.kind == "bpe" else 1) + len(self.special_tokens)


@dataclass
class DataConfig:
    input: list[str] = field(default_factory=list)  # text files; empty = dataset or the plays
    dataset: str = ""  # Hugging Face dataset id, local dataset dir or data file
    dataset_config: str = ""
    split: str = "train"
    text_field: str = "text"
    val_fraction: float = 0.1  # the last tokens are validation, as nanoGPT does

    def validate(self) -> Self:
        """Raise UsageError naming the first bad value; return self if all are good."""
        if not 0 < self.val_fraction < 1:
            raise UsageError(f"data.val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.input and self.dataset:
            raise UsageError(
                "data.input and data.dataset both name the training text: set one "
                "(--input or --dataset on the command line replaces the config file's)"
            )
        for name in self.input:
            checks.file_name("data.input", name)
        if self.dataset:
            checks.file_name("data.dataset", self.dataset)
            if not (self.split and self.text_field):
                raise UsageError(
                    "data.split and data.text_field must be non-empty with data.dataset"
                )
        return self
