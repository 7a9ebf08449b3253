"""The HTTP side of `--serve`: OpenAI-compatible routes on Starlette, answered by the engine.

Routes: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (JSON, or
server-sent events with `"stream": true`: chunks, then `data: [DONE]`), `GET /health` (the
model, the queue length, the rows in use and the tokens served) and `GET /` (the playground
page). With an API key, the `/v1` routes want `Authorization: Bearer KEY` (401 otherwise).

Every refusal is JSON, `{"error": {"message": ...}}`: 400 for a bad body or field, 401, 404,
405, 413 for a body over `serve.max_request_bytes`, 429 when the queue is full and 503 while
the server shuts down. Prompts are tokenized off the event loop; the engine thread decodes.

    >>> app = build_app(engine, tokenizer, "shakespeare", ServeConfig())  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import json
import secrets
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from model.decoding.prompts import encode_prompt
from model.serving.config import ServeConfig
from model.serving.engine import Engine, QueueFull, Request
from model.serving.openai_api import (
    ApiError,
    Completion,
    choice,
    envelope,
    new_id,
    parse_chat,
    parse_completion,
    usage,
)
from plumbing.errors import UsageError
from tokenizer import Tokenizer

PLAYGROUND = Path(__file__).with_name("playground.html")


class Server:
    """The routes' shared state: the engine, the tokenizer, the limits and the key."""

    def __init__(
        self, engine: Engine, tokenizer: Tokenizer, model_name: str, cfg: ServeConfig
    ) -> None:
        self.engine, self.tokenizer, self.model_name, self.cfg = engine, tokenizer, model_name, cfg
        block = engine.model.cfg.block_size
        self.max_prompt = min(cfg.max_prompt_tokens or block, block)
        longest = max(len(token) for token in tokenizer.vocab.values())
        # A prompt of more bytes than this cannot fit, whatever it is: refused before encoding.
        self.max_prompt_bytes = self.max_prompt * max(longest, 1)

    # -- routes ---------------------------------------------------------------------------------

    async def models(self, request: HttpRequest) -> JSONResponse:
        self.authorize(request)
        card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "tinyllm"}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self, request: HttpRequest) -> JSONResponse:
        stats = self.engine.stats()
        code = 200 if stats["status"] == "ok" else 503
        return JSONResponse({"model": self.model_name, **stats}, status_code=code)

    async def playground(self, request: HttpRequest) -> FileResponse:
        return FileResponse(PLAYGROUND, media_type="text/html")

    async def completions(self, request: HttpRequest):
        self.authorize(request)
        return await self.answer(request, parse_completion(await self.body(request), self.cfg))

    async def chat(self, request: HttpRequest):
        self.authorize(request)
        return await self.answer(request, parse_chat(await self.body(request), self.cfg))

    # -- the parts ------------------------------------------------------------------------------

    def authorize(self, request: HttpRequest) -> None:
        key = self.cfg.api_key
        if not key:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), key):
            raise ApiError(401, "missing or wrong API key: send Authorization: Bearer KEY", "auth")

    async def body(self, request: HttpRequest) -> Any:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > self.cfg.max_request_bytes:
            raise ApiError(413, self._too_large())
        data = bytearray()
        async for part in request.stream():
            data += part
            if len(data) > self.cfg.max_request_bytes:
                raise ApiError(413, self._too_large())
        try:
            return json.loads(data)
        except (ValueError, UnicodeDecodeError):
            raise ApiError(400, "the request body is not valid JSON") from None

    def _too_large(self) -> str:
        return f"the request body is larger than {self.cfg.max_request_bytes} bytes"

    def encode(self, prompt: str) -> list[int]:
        if len(prompt.encode("utf-8", "surrogatepass")) > self.max_prompt_bytes:
            raise ApiError(400, self._prompt_too_long())
        try:
            ids = encode_prompt(self.tokenizer, prompt, self.engine.model.cfg.block_size)
        except UsageError as err:
            raise ApiError(400, f"the prompt cannot be used: {err}") from None
        if len(ids) > self.max_prompt:
            raise ApiError(400, self._prompt_too_long(len(ids)))
        return ids

    def _prompt_too_long(self, n: int | None = None) -> str:
        size = f"{n} tokens" if n is not None else "too long"
        return f"the prompt is {size}; this server takes at most {self.max_prompt} tokens"

    async def answer(self, http: HttpRequest, completion: Completion):
        ids = await run_in_threadpool(self.encode, completion.prompt)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        job = Request(
            prompt_ids=ids,
            max_tokens=completion.max_tokens,
            on_event=lambda kind, data: loop.call_soon_threadsafe(events.put_nowait, (kind, data)),
            temperature=completion.temperature,
            top_k=completion.top_k,
            top_p=completion.top_p,
            seed=completion.seed,
            stop=completion.stop,
        )
        try:
            self.engine.submit(job)
        except QueueFull as full:
            stopping = "queue is full" not in str(full)
            raise ApiError(503 if stopping else 429, str(full), "server_busy") from None
        ident = new_id(completion.chat)
        if completion.stream:
            return StreamingResponse(
                self.stream(http, job, events, ident, completion.chat),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await self.whole(http, job, events, ident, completion.chat)

    async def whole(self, http, job: Request, events: asyncio.Queue, ident: str, chat: bool):
        watcher = asyncio.create_task(self.watch(http, job, events))
        pieces = []
        try:
            while True:
                kind, data = await events.get()
                if kind == "text":
                    pieces.append(data)
                elif kind == "gone":
                    return Response(status_code=499)  # nobody is there to read it
                elif kind == "error":
                    raise ApiError(503, data, "server_error")
                else:
                    answer = envelope(
                        ident,
                        self.model_name,
                        chat,
                        chunk=False,
                        choices=[choice("".join(pieces), data["finish_reason"], chat, False, True)],
                    )
                    return JSONResponse({**answer, "usage": usage(data)})
        finally:
            watcher.cancel()
            job.cancel()  # a no-op once done

    async def watch(self, http: HttpRequest, job: Request, events: asyncio.Queue) -> None:
        """A client that leaves, while its request waits in the queue or is decoded, cancels
        it: its row is freed at the next chunk boundary."""
        while (await http.receive())["type"] != "http.disconnect":
            pass
        job.cancel()
        events.put_nowait(("gone", None))

    async def stream(self, http, job: Request, events: asyncio.Queue, ident: str, chat: bool):
        watcher = asyncio.create_task(self.watch(http, job, events))
        first = True
        try:
            while True:
                kind, data = await events.get()
                if kind == "gone":
                    return
                if kind == "error":
                    yield _sse(ApiError(503, data, "server_error").body())
                    return
                text = data if kind == "text" else ""
                finish = data["finish_reason"] if kind == "done" else None
                part = choice(text, finish, chat, delta=True, first=first)
                first = False
                yield _sse(envelope(ident, self.model_name, chat, True, [part]))
                if kind == "done":
                    yield "data: [DONE]\n\n"
                    return
        finally:
            watcher.cancel()
            job.cancel()  # the client disconnected mid-stream: its row is freed


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _api_error(request: HttpRequest, err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


async def _http_error(request: HttpRequest, err: HTTPException) -> JSONResponse:
    message = {404: "no such route", 405: "method not allowed"}.get(err.status_code, err.detail)
    return JSONResponse(
        ApiError(err.status_code, f"{message}: {request.method} {request.url.path}").body(),
        status_code=err.status_code,
    )


def build_app(engine: Engine, tokenizer: Tokenizer, model_name: str, cfg: ServeConfig) -> Starlette:
    """The Starlette application (see the module docstring)."""
    server = Server(engine, tokenizer, model_name, cfg)
    routes = [
        Route("/", server.playground, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat, methods=["POST"]),
    ]
    return Starlette(
        routes=routes,
        exception_handlers={ApiError: _api_error, HTTPException: _http_error},
    )
