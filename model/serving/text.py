"""A request's generated text as it streams: bytes to UTF-8, and stop strings.

Tokens are byte strings, so a character can be split across tokens: an incremental decoder
holds the partial bytes until the character is complete, as `--inference` prints. A stop
string (OpenAI's `stop`) ends the text before it, and no text that could still turn out to be
the start of a stop string is sent early.

    >>> text = StopText(["\\n\\n"])
    >>> text.feed(b"Hello\\n"), text.feed(b"\\nWorld"), text.stopped
    ('Hello', '', True)
"""

from __future__ import annotations

import codecs


class StopText:
    """Feed token bytes, get the text that is safe to send (see the module docstring)."""

    def __init__(self, stop: list[str]) -> None:
        self.stop = [s for s in stop if s]
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""
        self.sent = 0  # characters of self.text already returned
        self.stopped = False

    def feed(self, data: bytes) -> str:
        """The new text safe to send after `data` (empty once a stop string was seen)."""
        if self.stopped:
            return ""
        self.text += self.decoder.decode(data)
        return self._release(final=False)

    def finish(self) -> str:
        """The rest of the text at the end of generation (partial bytes replaced)."""
        if self.stopped:
            return ""
        self.text += self.decoder.decode(b"", final=True)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        longest = max((len(s) for s in self.stop), default=0)
        start = max(0, self.sent - longest + 1)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            end = min(hits)
        elif final:
            end = len(self.text)
        else:
            end = len(self.text) - self._held_back()
        end = max(end, self.sent)
        out, self.sent = self.text[self.sent : end], end
        return out

    def _held_back(self) -> int:
        """Length of the longest end of the text that is the start of a stop string."""
        for n in range(min(len(self.text), max((len(s) for s in self.stop), default=1)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) and s != tail for s in self.stop):
                return n
        return 0
