"""A request's generated text as it streams: bytes to UTF-8, and stop strings.

Tokens are byte strings, so a character can be split across tokens: an incremental decoder
holds the partial bytes until the character is complete, as `--inference` prints. A stop
string (OpenAI's `stop`) ends the text before it: the first stop string to appear in full
ends it (at the same character, the one that starts first). No text that could still turn out
to be the start of a stop string is sent early.

Each stop string is matched by its own Knuth-Morris-Pratt automaton, fed one character at a
time, so the scan is linear in the text whatever the stop strings' lengths; an automaton's
state is also the longest end of the text that starts that stop string, which is what must
be held back.

    >>> text = StopText(["\\n\\n"])
    >>> text.feed(b"Hello\\n"), text.feed(b"\\nWorld"), text.stopped
    ('Hello', '', True)

A decode chunk's tokens for one request go through `read_tokens`, which also says whether
the request ended among them.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Collection


class StopMatcher:
    """Knuth-Morris-Pratt over one stop string: `step(char)` gives the length of the longest
    end of the text so far that is a start of the string (its length: found)."""

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.state = 0
        # fail[i]: the longest proper border of stop[:i + 1]
        self.fail = [0] * len(stop)
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self.fail[k - 1]
            if stop[i] == stop[k]:
                k += 1
            self.fail[i] = k

    def step(self, char: str) -> int:
        k, stop = self.state, self.stop
        if k == len(stop):
            k = self.fail[k - 1]
        while k and char != stop[k]:
            k = self.fail[k - 1]
        if char == stop[k]:
            k += 1
        self.state = k
        return k


class StopText:
    """Feed token bytes, get the text that is safe to send (see the module docstring)."""

    def __init__(self, stop: list[str]) -> None:
        self.matchers = [StopMatcher(s) for s in stop if s]
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.unsent = ""  # decoded, held back: it may be the start of a stop string
        self.stopped = False

    def feed(self, data: bytes) -> str:
        """The new text safe to send after `data` (empty once a stop string was seen)."""
        if self.stopped:
            return ""
        return self._scan(self.decoder.decode(data), final=False)

    def finish(self) -> str:
        """The rest of the text at the end of generation (partial bytes replaced)."""
        if self.stopped:
            return ""
        return self._scan(self.decoder.decode(b"", final=True), final=True)

    def _scan(self, new: str, final: bool) -> str:
        text = self.unsent + new
        for j in range(len(self.unsent), len(text)):
            ends = [j + 1 - len(m.stop) for m in self.matchers if m.step(text[j]) == len(m.stop)]
            if ends:
                self.stopped, self.unsent = True, ""
                return text[: min(ends)]
        held = 0 if final else max((m.state for m in self.matchers), default=0)
        cut = len(text) - held
        self.unsent = text[cut:]
        return text[:cut]


def read_tokens(
    tokens: list[int],
    text: StopText,
    decode: Callable[[list[int]], bytes],
    ends: Collection[int],
    room: int,
) -> tuple[str, int, str | None]:
    """Feed a request's new `tokens` to its `text`, at most `room` (>= 1) of them: (the text
    safe to send, how many tokens it used, why the request ended: "stop" at a token of `ends`
    (not counted) or a stop string, "length" when `room` ran out, None while it goes on).

    >>> read_tokens([72, 105, 0, 33], StopText([]), bytes, ends={0}, room=8)
    ('Hi', 2, 'stop')
    >>> read_tokens([72, 105, 33], StopText([]), bytes, ends={0}, room=2)
    ('Hi', 2, 'length')
    >>> read_tokens([72, 105, 33], StopText(["i!"]), bytes, ends={0}, room=8)
    ('H', 3, 'stop')
    """
    pieces, used, finish = [], 0, None
    for token in tokens:
        if token in ends:
            finish = "stop"
            break
        used += 1
        pieces.append(text.feed(decode([token])))
        if text.stopped:
            finish = "stop"
            break
        if used >= room:
            finish = "length"
            break
    if finish is not None:
        pieces.append(text.finish())
    return "".join(pieces), used, finish
