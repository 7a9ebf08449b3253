"""Log-probabilities as OpenAI's answers carry them.

The engine gives, per token, its log-probability under the model and the five most likely
tokens with theirs (model.decoding.sampling `token_scores`: the raw distribution, before
temperature, top-k or top-p, as vLLM reports them). Here they become a completion choice's
`logprobs` (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`: with `echo`, the
prompt's tokens first, the first of them scored `null`) or a chat choice's `logprobs.content`.

A token is a byte string; one that is not whole UTF-8 text on its own (part of a character)
is named as OpenAI names it, `bytes:\\xe2\\x80`, so that every token has a distinct name.

A token's `text_offset` is where its own text starts in the choice's text, decoded as the
text itself is, by an incremental UTF-8 decoder that replaces bad bytes: the echoed prompt on
its own (a character it leaves unfinished is one U+FFFD), then the generated text, as the
engine decodes it (model/serving/text.py). A token that ends a character begun before it
stands at that character, as vLLM counts; one after an unfinished character stands after the
U+FFFD that the character becomes.

    >>> scored = Scored()
    >>> scored.add([1, 2, 3, 4], None, [b"a", b"\\xe2\\x82", b"\\xac", b"\\xa9"])
    >>> scored.end_prompt()
    >>> scored.add([5, 6], None, [b"\\xe2", b"b"])
    >>> scored.offsets  # the lone byte is one U+FFFD; so is the generated text's cut-off one
    [0, 1, 1, 2, 3, 4]
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from typing import Any

import numpy as np


def _utf8_decoder() -> Any:
    return codecs.getincrementaldecoder("utf-8")(errors="replace")


@dataclass
class Scored:
    """Tokens, their scores and their text offsets (see the module docstring), appended to
    as they arrive (prompt, then generated)."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top: list[list[tuple[int, float]] | None] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    _decoder: Any = field(default_factory=_utf8_decoder, repr=False)
    _at: int = 0

    def since(self, start: int) -> Scored:
        """The tokens from `start` on (a stream's new ones)."""
        return Scored(self.ids[start:], self.logprobs[start:], self.top[start:],
                      self.offsets[start:])  # fmt: skip

    def add(self, ids, scores: dict | None, pieces: list[bytes]) -> None:
        """Tokens `ids`, their bytes `pieces`; `scores` (`token_scores` arrays, one row per
        token) or None (no score: the prompt's first token)."""
        for data in pieces:
            emitted = len(self._decoder.decode(data))
            own = len(_utf8_decoder().decode(data))  # what the token decodes to on its own
            self.offsets.append(self._at + max(0, emitted - own))  # past what it ends of before
            self._at += emitted
        self.ids.extend(int(i) for i in ids)
        if scores is None:
            self.logprobs.extend([None] * len(ids))
            self.top.extend([None] * len(ids))
            return
        self.logprobs.extend(float(x) for x in np.asarray(scores["logprob"]))
        for ids_5, lps_5 in zip(scores["top_ids"], scores["top_logprobs"], strict=True):
            self.top.append([(int(i), float(lp)) for i, lp in zip(ids_5, lps_5, strict=True)])

    def end_prompt(self) -> None:
        """The echoed prompt ends here: it is decoded on its own, and the generated text
        afresh."""
        self._at += len(self._decoder.decode(b"", final=True))
        self._decoder = _utf8_decoder()


def token_name(tokenizer, token: int) -> str:
    data = tokenizer.decode_bytes([token])
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def completion_logprobs(tokenizer, scored: Scored, n: int) -> dict:
    """A completion choice's `logprobs` with `n` alternatives per token."""
    names = [token_name(tokenizer, t) for t in scored.ids]
    tops = [
        None if top is None else {token_name(tokenizer, i): lp for i, lp in top[:n]}
        for top in scored.top
    ]
    return {
        "tokens": names,
        "token_logprobs": scored.logprobs,
        "top_logprobs": tops,
        "text_offset": scored.offsets,
    }


def chat_logprobs(tokenizer, scored: Scored, n: int) -> dict:
    """A chat choice's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def entry(token: int, logprob: float) -> dict:
        data = tokenizer.decode_bytes([token])
        return {"token": token_name(tokenizer, token), "logprob": logprob, "bytes": list(data)}

    content = []
    for token, logprob, top in zip(scored.ids, scored.logprobs, scored.top, strict=True):
        alternatives = [entry(i, lp) for i, lp in (top or [])[:n]]
        content.append({**entry(token, logprob), "top_logprobs": alternatives})
    return {"content": content}
