"""One prompt of an HTTP request as the engine sees it: its engine `Request`, and the events
that come back for it, carried from the engine thread onto the server's event loop and recorded
on the way (the text, the prompt's and tokens' scores, the end).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from model.serving.logprobs import Scored
from model.serving.openai_api import Completion
from model.serving.requests import Request


class Job:
    """One prompt's engine request and what comes back for it (events arrive on the loop)."""

    def __init__(
        self, index: int, ids: list[int], text: str, completion: Completion, loop,
        decode_bytes: Callable[[list[int]], bytes],
    ) -> None:  # fmt: skip
        self.index, self.ids, self.prompt_text = index, ids, text
        self.decode_bytes = decode_bytes
        self.events: asyncio.Queue = asyncio.Queue()
        self.request = Request(
            prompt_ids=ids,
            max_tokens=completion.max_tokens,
            on_event=lambda kind, data: loop.call_soon_threadsafe(
                self.events.put_nowait, (kind, data)
            ),
            sampling=completion.sampling_of(index),
            stop=completion.stop,
            logprobs=completion.logprobs,
            echo=completion.echo,
        )
        self.pieces: list[str] = []
        self.scored = Scored()
        self.done: dict | None = None
        self.queued_at = time.perf_counter()
        self.first_at: float | None = None

    async def next_event(self) -> tuple[str, Any]:
        """The next event, with the prompt's and tokens' scores recorded on the way."""
        kind, data = await self.events.get()
        if kind == "prompt":
            self.scored.add(self.ids[:1], None, self._pieces(self.ids[:1]))
            self.scored.add(self.ids[1:], data, self._pieces(self.ids[1:]))
            self.scored.end_prompt()
        elif kind in ("tokens", "text") and self.first_at is None:
            self.first_at = time.perf_counter()
        if kind == "tokens":
            self.scored.add(data["token"], data, self._pieces(data["token"]))
        elif kind == "text":
            self.pieces.append(data)
        elif kind == "done":
            self.done = data
        return kind, data

    def _pieces(self, ids) -> list[bytes]:
        return [self.decode_bytes([int(t)]) for t in ids]

    async def finish(self) -> str | None:
        """Wait for the end: None when done, else why not ("gone", or the error message)."""
        while True:
            kind, data = await self.next_event()
            if kind == "done":
                return None
            if kind in ("gone", "error"):
                return "gone" if kind == "gone" else data
