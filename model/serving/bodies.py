"""Reading request bodies with bounds: the size of one, the bytes buffered across all requests
being read, and the time a client takes to send one.

A body over serve.max_request_bytes gets 413 (at once when its Content-Length says so), one
that would push the buffered bytes of all requests over serve.max_buffered_bytes gets 503, one
not sent within serve.request_timeout_s gets 408, and one still being sent when shutdown begins
gets 503. Then it must be JSON (400 otherwise). A client that leaves mid-body raises `Gone`.
`BodyReader` owns the count of buffered bytes and the reads' deadlines; its reads run on the
server's event loop, and `close` may come from any thread.

    >>> bodies = BodyReader(ServeConfig())                              # doctest: +SKIP
    >>> payload = await bodies.read(request)                            # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest

from model.serving.config import ServeConfig
from model.serving.openai_api import ApiError


class Gone(Exception):
    """The client left before its request was read: nobody to answer."""


class BodyReader:
    """The JSON bodies of one server's requests, read within `cfg`'s bounds."""

    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.buffered = 0  # request-body bytes held by all requests now being read
        self.closing = False  # shutting down: bodies still being sent get 503
        self._deadlines: set = set()  # the reads' timeouts (the event loop's own)
        self._loop: asyncio.AbstractEventLoop | None = None

    async def read(self, request: HttpRequest) -> Any:
        """The request's body as JSON, within the bounds (see the module docstring)."""
        limit = self.cfg.max_request_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, self._too_large())
        data = bytearray()
        self._loop = asyncio.get_running_loop()
        deadline = None
        try:
            async with asyncio.timeout(self.cfg.request_timeout_s) as deadline:
                self._deadlines.add(deadline)
                if self.closing:
                    deadline.reschedule(self._loop.time())
                async for part in request.stream():
                    if self.buffered + len(part) > self.cfg.max_buffered_bytes:
                        raise ApiError(
                            503, "the server is reading too many bodies: retry later", "server_busy"
                        )
                    data += part
                    self.buffered += len(part)
                    if len(data) > limit:
                        raise ApiError(413, self._too_large())
        except TimeoutError:
            if self.closing:
                raise ApiError(503, "the server is shutting down", "server_busy") from None
            raise ApiError(408, "the request body was not sent in time") from None
        except ClientDisconnect:
            raise Gone from None
        finally:
            self.buffered -= len(data)
            self._deadlines.discard(deadline)
        try:
            return json.loads(data)
        except (ValueError, UnicodeDecodeError):
            raise ApiError(400, "the request body is not valid JSON") from None
        except RecursionError:
            raise ApiError(400, "the request body is nested too deeply") from None

    def close(self) -> None:
        """Shutdown began (any thread, a signal handler too): requests whose bodies are still
        being sent get 503 now, rather than being cancelled mid-read when the grace ends."""
        self.closing = True
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._expire_deadlines)

    def _expire_deadlines(self) -> None:
        for deadline in list(self._deadlines):
            deadline.reschedule(self._loop.time())

    def _too_large(self) -> str:
        return f"the request body is larger than {self.cfg.max_request_bytes} bytes"
