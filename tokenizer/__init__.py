"""tinyllm's tokenizers: byte-level BPE (trainable, or GPT-2's), character-level, persistence.

BPE's hot loops run in an optional compiled core (`tokenizer.compiled`) when `pip install`
could build it; TINYLLM_PURE_PYTHON=1 forces the pure-Python modules (same results).

>>> from tokenizer import BPETokenizer
>>> tok = BPETokenizer.train("hello hello world", vocab_size=260)
>>> tok.decode(tok.encode("hello")) == "hello"
True
"""

from tokenizer.base import Tokenizer
from tokenizer.bpe import BPETokenizer
from tokenizer.char import CharTokenizer
from tokenizer.errors import UsageError
from tokenizer.io import load_tokenizer

__all__ = ["BPETokenizer", "CharTokenizer", "Tokenizer", "UsageError", "load_tokenizer"]
