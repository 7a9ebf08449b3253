"""--serve's Host check alone, without a server: the names a bind address answers to, in any
case, and IPv6 literals (a served run's Host refusals: tests/test_serve_api.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")  # guard.py builds on its HTTP protocol


def test_a_server_bound_to_localhost_answers_to_its_addresses():
    from model.serving.guard import bound_hosts, is_ip_literal, is_loopback

    assert is_loopback("LocalHost") and not is_loopback("localhost.evil.example")
    names = bound_hosts("localhost", 8000, [])
    assert {"127.0.0.1:8000", "localhost:8000", "[::1]:8000"} <= names
    assert "localhost:8000" in bound_hosts("127.0.0.1", 8000, [])
    assert "evil.example:8000" not in names
    # Names in any case (a Host header is compared in lower case); IPv6 literals with a port
    # on a wildcard bind (each of these was refused with 421).
    assert "127.0.0.1:8000" in bound_hosts("LOCALHOST", 8000, [])
    assert "mybox:8000" in bound_hosts("10.0.0.5", 8000, ["MyBox"])
    assert all(map(is_ip_literal, ["[::1]:8000", "[fe80::1]:80", "[::1]", "::1", "10.0.0.5:80"]))
    assert not any(map(is_ip_literal, ["[::1]x", "[::1]:", "evil.example:80", "[evil]"]))


@pytest.mark.parametrize("bind", ["0.0.0.0", "10.0.0.5"])
def test_allowed_hosts_match_in_any_case(bind):
    import asyncio

    from model.serving.guard import HostCheck, bound_hosts

    answered = []

    async def app(scope, receive, send):
        answered.append(scope["headers"])

    async def refused(message):
        answered.append(message)

    check = HostCheck(app, bound_hosts(bind, 8000, ["MyBox"]), ["MyBox"], keyed=False)
    scope = {"type": "http", "method": "GET", "headers": [(b"host", b"MyBox:8000")]}
    asyncio.run(check(scope, None, refused))
    assert answered == [[(b"host", b"MyBox:8000")]], answered
