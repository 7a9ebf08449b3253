"""Builds the optional C cores of the tokenizer, in place; all other metadata lives in
pyproject.toml.

- `tokenizer._encode_core` (tokenizer/csrc/encode_core.c): pre-tokenization, BPE encoding
  and chunk counting;
- `tokenizer._train_core` (tokenizer/csrc/train_core.c): the BPE training merge loop.

They are built beside the Python modules (`tokenizer/_encode_core.*.so`) by a command of their
own rather than declared as the distribution's extension modules: setuptools would otherwise
map the `tokenizer` package into the user's environment, and tinyllm installs no import names
(it runs from its checkout). `optional=True`: where a core cannot be built (no C compiler or
Python headers), the install still succeeds and tinyllm uses its pure-Python tokenizer
(slower, same results).
"""

import os

from setuptools import Extension, setup
from setuptools.command.build import build
from setuptools.command.build_ext import build_ext

FLAGS = ["-O3", "-std=c99"] if os.name != "nt" else []
C_CORES = [
    Extension(
        "tokenizer._encode_core",
        sources=["tokenizer/csrc/encode_core.c"],
        extra_compile_args=FLAGS,
        optional=True,
    ),
    Extension("tokenizer._train_core", sources=["tokenizer/csrc/train_core.c"], optional=True),
]


class BuildCCores(build_ext):
    """build_ext for C_CORES alone, always in place (next to tokenizer/*.py)."""

    def finalize_options(self) -> None:
        # build_ext reads its extensions from the distribution while it finalizes; they are
        # handed over only for that, so that the distribution itself declares none.
        self.distribution.ext_modules = C_CORES
        try:
            super().finalize_options()
        finally:
            self.distribution.ext_modules = []
        self.inplace = True


build.sub_commands.append(("build_c_cores", None))  # also run by `pip install -e .`
setup(cmdclass={"build_c_cores": BuildCCores})
