"""Build script for the optional compiled core; all metadata lives in pyproject.toml.

`optional=True`: where the extension cannot be built (no C compiler or Python headers), the
install still succeeds and the pure-Python modules run instead.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("tokenizer._train_core", ["tokenizer/csrc/train_core.c"], optional=True),
    ],
)
