"""What the server does against hostile clients before a route runs.

- `HostCheck` (ASGI middleware): without an API key, a request whose `Host` header names
  anything but the bound address (or `serve.allowed_hosts`) gets 421, so that a web page
  cannot reach a keyless local server through DNS rebinding. A POST must say
  `Content-Type: application/json` (415 otherwise): a page can send a cross-origin
  `text/plain` POST without asking, but not a JSON one.
- `GuardedH11` (uvicorn's h11 protocol, tightened): at most `max_connections` open
  connections (more are closed as they arrive), and a connection that has not sent a whole
  request head within `header_timeout_s` of opening, or of its last answer, is closed.

The body's own limits (its size, the bytes buffered across all requests, the time to send
it) are the body reader's (model/serving/bodies.py).
"""

from __future__ import annotations

import ipaddress
import json

from uvicorn.protocols.http.h11_impl import H11Protocol

from model.serving.openai_api import ApiError

MAX_HEAD_BYTES = 16 * 1024  # a request head: uvicorn refuses a larger one only as it trickles in


def bound_hosts(host: str, port: int, extra: list[str]) -> set[str] | None:
    """Host header values that name this server (lower case, as HostCheck compares them), or
    None (any) for a wildcard address."""
    host = host.lower()
    if host in ("0.0.0.0", "::", ""):
        return None
    names = {host, f"{host}:{port}", f"[{host}]", f"[{host}]:{port}"}
    if is_loopback(host):  # bound by name or number: answer to the names of loopback too
        for name in ("localhost", "127.0.0.1", "[::1]"):
            names |= {name, f"{name}:{port}"}
    for name in extra:
        names |= {name.lower(), f"{name.lower()}:{port}"}
    return names


def is_loopback(host: str) -> bool:
    """Whether `host` only serves this machine (127.0.0.0/8, ::1, localhost in any case)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_ip_literal(host: str) -> bool:
    """A Host header that names an address: `1.2.3.4`, `1.2.3.4:80`, `[::1]`, `[::1]:80`."""
    if host.startswith("["):
        name, closed, rest = host[1:].partition("]")
        if not closed or (rest and not (rest[:1] == ":" and rest[1:].isdigit())):
            return False
    else:
        name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


class HostCheck:
    """Refuse foreign Host headers (no key set) and POSTs that are not JSON."""

    def __init__(self, app, allowed: set[str] | None, extra: list[str], keyed: bool) -> None:
        self.app, self.allowed, self.keyed = app, allowed, keyed
        self.extra = {name.lower() for name in extra}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if sum(len(k) + len(v) + 4 for k, v in scope["headers"]) > MAX_HEAD_BYTES:
            return await _refuse(send, 431, f"the request headers are over {MAX_HEAD_BYTES} bytes")
        headers = dict(scope["headers"])
        host = headers.get(b"host", b"").decode("latin-1").lower()
        if not self.keyed and not self._host_ok(host):
            message = f"this server does not answer to Host {host!r}: add it to serve.allowed_hosts"
            return await _refuse(send, 421, message[:300])
        if scope["method"] == "POST":
            kind = headers.get(b"content-type", b"").decode("latin-1").split(";")[0].strip()
            if kind.lower() != "application/json":
                return await _refuse(send, 415, "the request body must be application/json")
        return await self.app(scope, receive, send)

    def _host_ok(self, host: str) -> bool:
        if self.allowed is None:  # a wildcard bind: any address of this machine, by number
            return is_ip_literal(host) or host.split(":")[0] in self.extra | {"localhost"}
        return host in self.allowed


async def _refuse(send, status: int, message: str) -> None:
    body = json.dumps(ApiError(status, message).body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def guarded_h11(max_connections: int, header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a connection cap and a request-head timeout."""

    class GuardedH11(H11Protocol):
        def connection_made(self, transport) -> None:
            if len(self.connections) >= max_connections:
                transport.close()  # over the cap: not served, not counted
                self.transport = transport
                return
            super().connection_made(transport)
            self._arm_head_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_head_timer()

        def _arm_head_timer(self) -> None:
            cycle = self.cycle  # a new request head makes a new cycle
            self.loop.call_later(header_timeout_s, self._head_overdue, cycle)

        def _head_overdue(self, cycle) -> None:
            if self.cycle is cycle and not self.transport.is_closing():
                self.transport.close()

        def connection_lost(self, exc) -> None:
            if self in self.connections or self.flow is not None:
                super().connection_lost(exc)

    return GuardedH11
