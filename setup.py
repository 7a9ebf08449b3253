"""Builds the optional compiled cores; all other metadata lives in pyproject.toml.

- `tokenizer._encode_core` (tokenizer/csrc/encode_core.c): pre-tokenization, BPE encoding
  and chunk counting;
- `tokenizer._train_core` (tokenizer/csrc/train_core.c): the BPE training merge loop.

`optional=True`: where an extension cannot be built (no C compiler or Python headers), the
install still succeeds and tinyllm uses its pure-Python tokenizer (slower, same results).
"""

import os

from setuptools import Extension, setup

FLAGS = ["-O3", "-std=c99"] if os.name != "nt" else []

setup(
    ext_modules=[
        Extension(
            "tokenizer._encode_core",
            sources=["tokenizer/csrc/encode_core.c"],
            extra_compile_args=FLAGS,
            optional=True,
        ),
        Extension(
            "tokenizer._train_core",
            sources=["tokenizer/csrc/train_core.c"],
            optional=True,
        ),
    ]
)
