"""tinyllm's tokenizers: byte-level BPE (trainable, or GPT-2's), character-level, persistence.

BPE's hot loops run in an optional C core (`tokenizer.c_core`) when `pip install` could build
it; TINYLLM_PURE_PYTHON=1 forces the pure-Python modules (same results).

>>> from tokenizer import BPETokenizer
>>> tok = BPETokenizer.train("hello hello world", vocab_size=260)
>>> tok.decode(tok.encode("hello")) == "hello"
True
"""

from plumbing.lazy import exports_on_first_use

# Exports load on first use: importing a submodule (tokenizer.config, which every config load
# needs) pulls in neither numpy, regex nor the C core.
_EXPORTS = {
    "BPETokenizer": "tokenizer.bpe",
    "CharTokenizer": "tokenizer.char",
    "Tokenizer": "tokenizer.base",
    "load_tokenizer": "tokenizer.io",
}

__all__ = sorted(_EXPORTS)

__getattr__ = exports_on_first_use(__name__, _EXPORTS)
