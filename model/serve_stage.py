"""The --serve stage: a trained run (float or quantized) served over HTTP until Ctrl-C.

It loads the run, starts the engine (model/serving/engine.py: continuous batching through
the KV cache; its programs are compiled before the server answers), binds the address, and
serves the OpenAI-compatible routes (model/serving/app.py) with uvicorn; once uvicorn serves
the socket, it prints one ready line on stderr with the URL. Ctrl-C or SIGTERM stops it: the
listening socket closes at once (a new connection is refused), a new request on a connection
already open gets 503, requests in flight may finish for up to `GRACE_S` - 1 seconds, then
the engine answers what is left with an error event, and the stage ends with one line.

    >>> run_serve(cfg, Path("runs/shakespeare"))                      # doctest: +SKIP
    serve: ready on http://127.0.0.1:8000 (model shakespeare, 16 rows, queue 64); Ctrl-C stops
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import threading
from pathlib import Path

from configs.schema import Config
from model.rundir.trained import load_for_sampling
from model.serving.config import API_KEY_ENV, ServeConfig
from plumbing.collector import start_up_done
from plumbing.errors import UsageError

GRACE_S = 3  # how long requests in flight may finish after Ctrl-C or SIGTERM


def run_serve(cfg: Config, run_dir: Path) -> int:
    """Serve `run_dir` (or, with --init-from, GPT-2 itself) until a signal stops it."""
    serve = dataclasses.replace(
        cfg.serve, api_key=cfg.serve.api_key or os.environ.get(API_KEY_ENV, "")
    ).validate()
    require_serve_extra()
    import uvicorn

    from model.serving.app import build_app
    from model.serving.engine import Engine
    from model.serving.guard import MAX_HEAD_BYTES, guarded_h11, is_loopback

    tokenizer, model = load_for_sampling(run_dir, cfg.init_from, cfg.model)
    start_up_done()  # the collector leaves start-up's objects alone from here
    name = (
        (Path(cfg.init_from).name or cfg.init_from)
        if cfg.init_from
        else Path(run_dir).resolve().name
    )
    listener = bind(serve)
    engine = Engine(
        model,
        tokenizer,
        rows=serve.batch_size,
        queue_size=serve.queue_size,
        chunk_steps=serve.chunk_steps,
        stream_interval_s=serve.stream_interval_s,
    )
    engine.start()
    host, port = listener.getsockname()[:2]
    app = build_app(engine, tokenizer, name, serve, port=port)
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=GRACE_S,
        http=guarded_h11(serve.max_connections, serve.header_timeout_s),
        timeout_keep_alive=5,
        # No limit_concurrency: the guard caps connections (each runs one request at a time),
        # and uvicorn's cap would answer requests on open connections with a plain-text 503.
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,  # a head trickling in past it: 400
    )
    url = f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"
    if not serve.api_key and not is_loopback(serve.host):
        sys.stderr.write(
            f"serve: warning: {serve.host} is reachable from other machines and no API key is "
            f"set: anyone there can use this server (set --api-key or {API_KEY_ENV})\n"
        )
    ready = (
        f"serve: ready on {url} (model {name}, {serve.batch_size} rows, queue "
        f"{serve.queue_size}); Ctrl-C stops\n"
    )
    try:
        stopping_server_class()(config, engine, app.server, ready).run(sockets=[listener])
    finally:
        engine.stop()
        listener.close()
    return 0


def stopping_server_class():
    """uvicorn.Server that, on Ctrl-C or SIGTERM, also drains the engine: new requests get
    503 at once, and so do requests whose bodies are still being sent; requests in flight may
    finish for GRACE_S - 1 s, then get an error event (so their streams end cleanly before
    uvicorn's own grace period cuts connections)."""
    import uvicorn

    class StoppingServer(uvicorn.Server):
        def __init__(self, config, engine, server, ready: str) -> None:
            super().__init__(config)
            self.engine, self.server, self.ready = engine, server, ready

        async def startup(self, sockets=None) -> None:
            # The ready line only once the socket is served and uvicorn's signal handlers are
            # in place: a Ctrl-C before that would land outside the server's own shutdown.
            await super().startup(sockets=sockets)
            if not self.should_exit:
                sys.stderr.write(self.ready)
                sys.stderr.flush()

        def handle_exit(self, sig, frame) -> None:
            if not self.should_exit:
                self.engine.drain()
                self.server.bodies.close()
                timer = threading.Timer(GRACE_S - 1, self.engine.stop)
                timer.daemon = True
                timer.start()
            super().handle_exit(sig, frame)

    return StoppingServer


def require_serve_extra() -> None:
    """UsageError in one line when the serve extra (Starlette, uvicorn, prometheus-client) is
    not installed."""
    try:
        import prometheus_client  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise UsageError(
            f"--serve needs the serve extra ({err.name} is missing): pip install -e '.[serve]'"
        ) from None


def bind(serve: ServeConfig) -> socket.socket:
    """A listening socket on serve.host:serve.port, bound before the engine compiles (a taken
    port is refused at once); UsageError when the address is taken or cannot be used."""
    try:
        infos = socket.getaddrinfo(serve.host, serve.port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise UsageError(
            f"--host {serve.host}: not an address of this machine ({err.strerror})"
        ) from None
    family, _, _, _, address = infos[0]
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(address)
        listener.listen(2048)
    except OSError as err:
        listener.close()
        raise UsageError(
            f"cannot listen on {serve.host}:{serve.port} ({err.strerror}): pick another --port "
            "or stop what uses it"
        ) from None
    return listener
