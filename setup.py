"""Builds the optional compiled core (tokenizer/_encode_core); everything else is in pyproject.toml.

`optional=True`: without a C compiler the build of the extension fails quietly and the install
still succeeds; tinyllm then uses its pure-Python tokenizer (slower, same results).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tokenizer._encode_core",
            sources=["tokenizer/csrc/encode_core.c"],
            extra_compile_args=["-O3", "-std=c99"] if __import__("os").name != "nt" else [],
            optional=True,
        )
    ]
)
