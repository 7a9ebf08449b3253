"""Log-probabilities as OpenAI's answers carry them.

The engine gives, per token, its log-probability under the model and the five most likely
tokens with theirs (model.decoding.sampling `token_scores`: the raw distribution, before
temperature, top-k or top-p, as vLLM reports them). Here they become a completion choice's
`logprobs` (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`: with `echo`, the
prompt's tokens first, the first of them scored `null`) or a chat choice's `logprobs.content`.

A token is a byte string; one that is not whole UTF-8 text on its own (part of a character)
is named as OpenAI names it, `bytes:\\xe2\\x80`, so that every token has a distinct name.

    >>> _offsets([b"a", b"\\xe2\\x82", b"\\xac", b"b"], start=0)
    [0, 1, 1, 2]
    >>> _offsets([b"\\xa9", b"A"], start=0)  # a lone continuation byte: one U+FFFD
    [0, 1]
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Scored:
    """Tokens and their scores, appended to as they arrive (prompt, then generated)."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top: list[list[tuple[int, float]] | None] = field(default_factory=list)

    def add(self, ids, scores: dict | None) -> None:
        """Tokens `ids`; `scores` (`token_scores` arrays, one row per token) or None (no
        score: the prompt's first token)."""
        self.ids.extend(int(i) for i in ids)
        if scores is None:
            self.logprobs.extend([None] * len(ids))
            self.top.extend([None] * len(ids))
            return
        self.logprobs.extend(float(x) for x in np.asarray(scores["logprob"]))
        for ids_5, lps_5 in zip(scores["top_ids"], scores["top_logprobs"], strict=True):
            self.top.append([(int(i), float(lp)) for i, lp in zip(ids_5, lps_5, strict=True)])


def token_name(tokenizer, token: int) -> str:
    data = tokenizer.decode_bytes([token])
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def completion_logprobs(tokenizer, scored: Scored, n: int, start_offset: int = 0) -> dict:
    """A completion choice's `logprobs` with `n` alternatives per token."""
    names = [token_name(tokenizer, t) for t in scored.ids]
    pieces = [tokenizer.decode_bytes([t]) for t in scored.ids]
    tops = [
        None if top is None else {token_name(tokenizer, i): lp for i, lp in top[:n]}
        for top in scored.top
    ]
    return {
        "tokens": names,
        "token_logprobs": scored.logprobs,
        "top_logprobs": tops,
        "text_offset": _offsets(pieces, start_offset),
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


def _offsets(pieces: list[bytes], start: int) -> list[int]:
    """Each token's character offset in the text the pieces decode to: the characters
    decoded before it by the incremental UTF-8 decoder that writes the text (bad bytes
    replaced by U+FFFD, model/serving/text.py). A token that ends a character begun before
    it stands at that character, as vLLM counts."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    offsets, at = [], start
    for data in pieces:
        offsets.append(at)
        at += len(decoder.decode(data))
    return offsets
