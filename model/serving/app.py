"""The HTTP side of `--serve`: OpenAI-compatible routes on Starlette, answered by the engine.

Routes:
- `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (JSON, or server-sent
  events with `"stream": true`: chunks, then `data: [DONE]`);
- vLLM's tokenizer routes, which lm-evaluation-harness's `tokenizer_backend=remote` uses:
  `GET /tokenizer_info`, `POST /tokenize` (`{"prompt"}` -> `{"tokens", "count",
  "max_model_len"}`) and `POST /detokenize` (`{"tokens"}` -> `{"prompt"}`);
- `GET /health` (the model, the queue length, the rows in use, the tokens served),
  `GET /metrics` (Prometheus) and `GET /` (the playground page).

With an API key, every route but `/`, `/health` and (unless serve.metrics_public=false)
`/metrics` wants `Authorization: Bearer KEY` (401 otherwise).

Every refusal is JSON, `{"error": {"message": ...}}`: 400 for a bad body or field, 401, 404,
405, 408 for a body not sent within serve.request_timeout_s, 413 for a body over
serve.max_request_bytes, 415 for a body that is not JSON, 421 for a foreign Host (see
model/serving/guard.py), 429 when the queue is full, 503 while the server shuts down or
buffers too many bodies at once. Prompts are tokenized off the event loop; the engine thread
decodes.

    >>> app = build_app(engine, tokenizer, "shakespeare", ServeConfig())  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from pathlib import Path

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from model.decoding.prompts import END_OF_TEXT, check_text, encode_prompt, stop_token_of
from model.serving.bodies import BodyReader, Gone
from model.serving.config import ServeConfig
from model.serving.engine import Engine
from model.serving.guard import HostCheck, bound_hosts
from model.serving.job import Job
from model.serving.logprobs import chat_logprobs, completion_logprobs
from model.serving.metrics import ServeMetrics
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
from model.serving.requests import EngineStopping, QueueFull
from plumbing.errors import UsageError
from tokenizer import Tokenizer

PLAYGROUND = Path(__file__).with_name("playground.html")


class Server:
    """The routes' shared state: the engine, the tokenizer, the limits, the key, the counts."""

    def __init__(
        self, engine: Engine, tokenizer: Tokenizer, model_name: str, cfg: ServeConfig
    ) -> None:
        self.engine, self.tokenizer, self.model_name, self.cfg = engine, tokenizer, model_name, cfg
        self.block = engine.model.cfg.block_size
        self.vocab_size = engine.model.cfg.vocab_size
        self.max_prompt = min(cfg.max_prompt_tokens or self.block, self.block)
        longest = max(len(token) for token in tokenizer.vocab.values())
        # A prompt of more bytes than this cannot fit, whatever it is: refused before encoding.
        self.max_prompt_bytes = self.max_prompt * max(longest, 1)
        self.bodies = BodyReader(cfg)
        self.metrics = ServeMetrics(engine.stats)

    # -- routes ---------------------------------------------------------------------------------

    async def models(self, request: HttpRequest) -> JSONResponse:
        self.authorize(request)
        card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "tinyllm"}
        card["max_model_len"] = self.block
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self, request: HttpRequest) -> JSONResponse:
        stats = self.engine.stats()
        code = 200 if stats["status"] == "ok" else 503
        return JSONResponse({"model": self.model_name, **stats}, status_code=code)

    async def metrics_route(self, request: HttpRequest) -> Response:
        if not self.cfg.metrics_public:
            self.authorize(request)
        body, kind = self.metrics.render()
        return Response(body, media_type=kind)

    async def playground(self, request: HttpRequest) -> FileResponse:
        return FileResponse(PLAYGROUND, media_type="text/html")

    async def tokenizer_info(self, request: HttpRequest) -> JSONResponse:
        self.authorize(request)
        eos = END_OF_TEXT if stop_token_of(self.tokenizer) is not None else None
        return JSONResponse(
            {
                "tokenizer_class": type(self.tokenizer).__name__,
                "eos_token": eos,
                "bos_token": None,
                "pad_token": None,
                "model_max_length": self.block,
                "vocab_size": self.vocab_size,
            }
        )

    async def tokenize(self, request: HttpRequest) -> JSONResponse:
        self.authorize(request)
        body = await self.bodies.read(request)
        text = body.get("prompt") if isinstance(body, dict) else None
        if not isinstance(text, str):
            raise ApiError(400, "'prompt' is required and must be a string")
        try:
            check_text(text)  # a lone surrogate: refused as /v1/completions refuses it
            tokens = await run_in_threadpool(self.tokenizer.encode, text)
        except (UnicodeError, UsageError) as err:
            raise ApiError(400, f"'prompt' is not valid Unicode text: {err}"[:300]) from None
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": self.block})

    async def detokenize(self, request: HttpRequest) -> JSONResponse:
        self.authorize(request)
        body = await self.bodies.read(request)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list):
            raise ApiError(400, "'tokens' is required and must be a list of token ids")
        self.check_ids(tokens, "tokens")
        text = await run_in_threadpool(self.tokenizer.decode, tokens)  # off the event loop
        return JSONResponse({"prompt": text})

    async def completions(self, request: HttpRequest):
        self.authorize(request)
        body = await self.bodies.read(request)
        return await self.answer(request, parse_completion(body, self.cfg))

    async def chat(self, request: HttpRequest):
        self.authorize(request)
        return await self.answer(request, parse_chat(await self.bodies.read(request), self.cfg))

    # -- the parts ------------------------------------------------------------------------------

    def authorize(self, request: HttpRequest) -> None:
        key = self.cfg.api_key
        if not key:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        # Headers reach us as latin-1 text: compare their bytes (a non-ASCII one cannot match).
        matches = secrets.compare_digest(token.strip().encode("latin-1"), key.encode("ascii"))
        if scheme.lower() != "bearer" or not matches:
            raise ApiError(401, "missing or wrong API key: send Authorization: Bearer KEY", "auth")

    def check_ids(self, ids: list, what: str) -> None:
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool)]
        bad = bad or [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ApiError(
                400, f"'{what}' must be token ids in 0..{self.vocab_size - 1}, got {bad[0]!r}"[:200]
            )

    def encode(self, prompt: str | list[int]) -> tuple[list[int], str]:
        """(token ids, text) of one prompt, checked against the context."""
        if isinstance(prompt, list):
            self.check_ids(prompt, "prompt")
            ids = prompt
        else:
            if len(prompt.encode("utf-8", "surrogatepass")) > self.max_prompt_bytes:
                raise ApiError(400, self._prompt_too_long())
            try:
                ids = encode_prompt(self.tokenizer, prompt, None)  # the length: below, as for ids
            except UsageError as err:
                raise ApiError(400, f"the prompt cannot be used: {err}") from None
        if len(ids) > self.max_prompt:
            raise ApiError(400, self._prompt_too_long(len(ids)))
        # The text the ids spell: an empty prompt is the end-of-text token, which echo shows.
        text = prompt if isinstance(prompt, str) and prompt else self.tokenizer.decode(ids)
        return ids, text

    def _prompt_too_long(self, n: int | None = None) -> str:
        size = f"{n} tokens" if n is not None else "too long"
        return f"the prompt is {size}; this server takes at most {self.max_prompt} tokens"

    async def answer(self, http: HttpRequest, completion: Completion):
        prompts = await run_in_threadpool(lambda: [self.encode(p) for p in completion.prompts])
        loop = asyncio.get_running_loop()
        decode = self.tokenizer.decode_bytes
        jobs = [
            Job(i, ids, text, completion, loop, decode) for i, (ids, text) in enumerate(prompts)
        ]
        try:
            for job in jobs:
                self.engine.submit(job.request)
        except (QueueFull, EngineStopping) as busy:
            for job in jobs:
                job.request.cancel()
            status = 429 if isinstance(busy, QueueFull) else 503
            raise ApiError(status, str(busy), "server_busy") from None
        ident = new_id(completion.chat)
        watcher = asyncio.create_task(self.watch(http, jobs))
        if completion.stream:
            return StreamingResponse(
                self.stream(watcher, jobs[0], ident, completion),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            outcomes = await asyncio.gather(*(job.finish() for job in jobs))
        finally:
            watcher.cancel()
            for job in jobs:
                job.request.cancel()  # a no-op once done
        if "gone" in outcomes:
            return Response(status_code=499)  # nobody is there to read it
        failed = [o for o in outcomes if o is not None]
        if failed:
            raise ApiError(503, failed[0], "server_error")
        for job in jobs:
            self.record(job)
        choices = [self.choice_of(job, completion) for job in jobs]
        answer = envelope(ident, self.model_name, completion.chat, False, choices)
        return JSONResponse({**answer, "usage": usage([job.done for job in jobs])})

    def choice_of(self, job: Job, completion: Completion) -> dict:
        text = "".join(job.pieces)
        if completion.echo:
            text = job.prompt_text + text
        logprobs = None
        if completion.logprobs is not None:
            if completion.chat:
                logprobs = chat_logprobs(self.tokenizer, job.scored, completion.logprobs)
            else:
                logprobs = completion_logprobs(self.tokenizer, job.scored, completion.logprobs)
        finish = job.done["finish_reason"]
        return choice(text, finish, completion.chat, False, True, job.index, logprobs)

    def record(self, job: Job) -> None:
        done, now = job.done, time.perf_counter()
        first = None if job.first_at is None else job.first_at - job.queued_at
        rest = 0.0 if job.first_at is None else now - job.first_at
        self.metrics.finished(done["prompt_tokens"], done["completion_tokens"], first, rest)

    async def watch(self, http: HttpRequest, jobs: list[Job]) -> None:
        """A client that leaves, while its requests wait in the queue or are decoded, cancels
        them: their rows are freed at the next chunk boundary."""
        while (await http.receive())["type"] != "http.disconnect":
            pass
        for job in jobs:
            job.request.cancel()
            job.events.put_nowait(("gone", None))

    async def stream(self, watcher, job: Job, ident: str, completion: Completion):
        chat, first = completion.chat, True
        scored_sent = 0
        try:
            if completion.echo:
                text = job.prompt_text
                while completion.logprobs is not None and not job.scored.ids:
                    kind, data = await job.next_event()  # the prompt's scores come first
                    if kind in ("gone", "error"):
                        return
                logprobs, scored_sent = self._stream_logprobs(job, completion, 0)
                part = choice(text, None, chat, delta=True, first=True, logprobs=logprobs)
                first = False
                yield _sse(envelope(ident, self.model_name, chat, True, [part]))
            while True:
                kind, data = await job.next_event()
                if kind == "gone":
                    return
                if kind == "error":
                    yield _sse(ApiError(503, data, "server_error").body())
                    return
                if kind not in ("text", "done"):
                    continue
                text = data if kind == "text" else ""
                finish = data["finish_reason"] if kind == "done" else None
                logprobs, sent = self._stream_logprobs(job, completion, scored_sent)
                scored_sent += sent
                part = choice(text, finish, chat, True, first, logprobs=logprobs)
                first = False
                yield _sse(envelope(ident, self.model_name, chat, True, [part]))
                if kind == "done":
                    self.record(job)
                    if completion.include_usage:  # OpenAI's last chunk: no choices, the usage
                        last = envelope(ident, self.model_name, chat, True, [])
                        yield _sse({**last, "usage": usage([data])})
                    yield "data: [DONE]\n\n"
                    return
        finally:
            watcher.cancel()
            job.request.cancel()  # the client disconnected mid-stream: its row is freed

    def _stream_logprobs(self, job: Job, completion: Completion, start: int):
        """(the logprobs of the tokens scored since `start`, how many), or (None, 0)."""
        if completion.logprobs is None:
            return None, 0
        part = job.scored.since(start)
        if completion.chat:
            return chat_logprobs(self.tokenizer, part, completion.logprobs), len(part.ids)
        return completion_logprobs(self.tokenizer, part, completion.logprobs), len(part.ids)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _api_error(request: HttpRequest, err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


async def _gone(request: HttpRequest, err: Gone) -> Response:
    return Response(status_code=499)


async def _http_error(request: HttpRequest, err: HTTPException) -> JSONResponse:
    message = {404: "no such route", 405: "method not allowed"}.get(err.status_code, err.detail)
    return JSONResponse(
        ApiError(err.status_code, f"{message}: {request.method} {request.url.path}").body(),
        status_code=err.status_code,
    )


async def _server_error(request: HttpRequest, err: Exception) -> JSONResponse:
    """A bug: still JSON (the traceback goes to the server's log)."""
    body = ApiError(500, f"internal error ({type(err).__name__}): see the server's log").body()
    return JSONResponse(body, status_code=500)


def build_app(
    engine: Engine, tokenizer: Tokenizer, model_name: str, cfg: ServeConfig, port: int = 0
):
    """The ASGI application (see the module docstring): Starlette behind the Host check."""
    server = Server(engine, tokenizer, model_name, cfg)
    routes = [
        Route("/", server.playground, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.metrics_route, methods=["GET"]),
        Route("/tokenizer_info", server.tokenizer_info, methods=["GET"]),
        Route("/tokenize", server.tokenize, methods=["POST"]),
        Route("/detokenize", server.detokenize, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat, methods=["POST"]),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={
            ApiError: _api_error,
            Gone: _gone,
            HTTPException: _http_error,
            Exception: _server_error,
        },
    )
    app.router.redirect_slashes = False  # `/v1/completions/` is an unknown route: a JSON 404
    allowed = bound_hosts(cfg.host, port, cfg.allowed_hosts)
    guarded = HostCheck(app, allowed, cfg.allowed_hosts, keyed=bool(cfg.api_key))
    counted = _Counted(guarded, server.metrics)  # outermost: the guard's refusals count too
    counted.server = server  # for the stage's shutdown (server.bodies.close)
    return counted


class _Counted:
    """ASGI middleware: every answer counted by route and status."""

    def __init__(self, app, metrics: ServeMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                route = scope["path"] if scope["path"] in _ROUTES else "other"
                self.metrics.requests.labels(route, str(message["status"])).inc()
            await send(message)

        return await self.app(scope, receive, counting_send)


_ROUTES = {
    "/",
    "/health",
    "/metrics",
    "/tokenizer_info",
    "/tokenize",
    "/detokenize",
    "/v1/models",
    "/v1/completions",
    "/v1/chat/completions",
}
