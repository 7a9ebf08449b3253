"""--serve: the OpenAI-compatible server, through the official `openai` client and raw HTTP.

A tiny BPE run is served by a real `tinyllm.py --serve` process. Checked: the routes, greedy
text equal to `--inference --temperature 0` for requests sharing the batch (past the context,
so rows slide), streaming as OpenAI's server-sent events, chat, every kind of bad input as a
4xx JSON error with the server still serving, the API key, a full queue (429 at once), a
client that leaves mid-stream (its row is freed), a flood of 200 requests, a quantized run,
and SIGTERM (ends in seconds, one line, no traceback).
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import tinyllm  # noqa: E402
from tests.serve_helpers import ServerProcess  # noqa: E402
from tests.tiny_runs import ROOT, served_run  # noqa: E402

# Short prompts, and one longer than the refill window (16 tokens): prefilled by --inference's
# own refill program rather than one short pass.
PROMPTS = ["to be", "the question", "whether tis not", "or", "to be or not to be that is"]
SMALL = ("serve.batch_size=2",)  # fewer programs to compile at start-up (row counts 1, 2)
ENDLESS = 200_000  # new tokens: a request that runs until it is cut short
LONG = 40  # new tokens: past the 32-token context, so every row slides at least once


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A tiny BPE run (the demo's config, shrunk), with an end-of-text token."""
    return served_run(tmp_path_factory, "serve")


@pytest.fixture(scope="module")
def server(run_dir):
    with ServerProcess(run_dir, "serve.batch_size=4", "serve.queue_size=16") as server:
        yield server


def client(server, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=kwargs.pop("key", "none"), **kwargs)


def inference_text(run_dir: Path, prompt: str, n: int, capsys, *sampling: str) -> str:
    """What `--inference` prints after the prompt (greedy unless `sampling` flags say)."""
    argv = ["--inference", "--out", str(run_dir), "--prompt", prompt, "--temperature", "0"]
    assert tinyllm.main([*argv, "--max-new-tokens", str(n), *sampling]) == 0
    out = capsys.readouterr().out
    assert out.startswith(prompt) and out.endswith("\n")
    return out[len(prompt) : -1]


def post(server, path: str, body, **kwargs) -> httpx.Response:
    content = body if isinstance(body, bytes | str) else json.dumps(body)
    headers = {"content-type": "application/json", **kwargs.pop("headers", {})}
    return httpx.post(server.url + path, content=content, timeout=60, headers=headers, **kwargs)


def test_models_health_and_a_completion(server):
    api = client(server)
    (model,) = api.models.list().data
    health = httpx.get(server.url + "/health").json()
    assert health["model"] == model.id and health["queue_length"] == 0
    done = api.completions.create(model=model.id, prompt="to be", max_tokens=5, temperature=0)
    assert done.choices[0].finish_reason in ("length", "stop")
    assert done.usage.completion_tokens <= 5 and done.usage.prompt_tokens >= 1
    assert httpx.get(server.url + "/health").json()["tokens_served"] >= 5 - 1


def test_greedy_text_equals_inference_whatever_shares_the_batch(server, run_dir, capsys):
    health = httpx.get(server.url + "/health").json()
    assert health["batch_rows"] < len(PROMPTS)  # some wait for a row, then join mid-stream
    expected = [inference_text(run_dir, p, LONG, capsys) for p in PROMPTS]

    async def all_at_once():
        api = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none")
        calls = [
            api.completions.create(model="m", prompt=p, max_tokens=LONG, temperature=0)
            for p in PROMPTS
        ]
        return await asyncio.gather(*calls)

    answers = asyncio.run(all_at_once())
    assert [a.choices[0].text for a in answers] == expected
    # A stop string ends the text before it.
    stop = expected[0][12:15]
    cut = client(server).completions.create(
        model="m", prompt=PROMPTS[0], max_tokens=LONG, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == expected[0][: expected[0].index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    # The same requests streamed: the chunks add up to the same text, then [DONE].
    api = client(server)
    for prompt, text in zip(PROMPTS[:2], expected[:2], strict=True):
        stream = api.completions.create(
            model="m", prompt=prompt, max_tokens=LONG, temperature=0, stream=True
        )
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks) == text
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        json={"prompt": "to", "max_tokens": 3, "stream": True},
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_16_concurrent_clients_of_64_tokens_all_succeed(server):
    async def sixteen():
        api = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        calls = [
            api.completions.create(model="m", prompt=PROMPTS[i % 4], max_tokens=64, seed=i)
            for i in range(16)
        ]
        return await asyncio.gather(*calls)

    answers = asyncio.run(sixteen())
    assert len(answers) == 16 and all(a.usage.completion_tokens >= 1 for a in answers)


def test_seeded_sampling_equals_inference_with_the_same_seed(server, run_dir, capsys):
    settings = [(7, 0.9, 0, 1.0), (8, 1.2, 5, 1.0), (9, 0.7, 0, 0.8)]  # seed, T, top-k, top-p
    expected = [
        inference_text(
            run_dir, "to be", 24, capsys,
            "--seed", str(seed), "--temperature", str(t), "--top-k", str(k), "--top-p", str(p),
        )
        for seed, t, k, p in settings
    ]  # fmt: skip

    async def all_at_once():
        api = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none")
        calls = [
            api.completions.create(
                model="m", prompt="to be", max_tokens=24, seed=seed, temperature=t, top_p=p,
                extra_body={"top_k": k},
            )
            for seed, t, k, p in settings
        ]  # fmt: skip
        return await asyncio.gather(*calls)

    answers = asyncio.run(all_at_once())
    assert [a.choices[0].text for a in answers] == expected


def test_chat_completions_with_the_plain_template(server):
    api = client(server)
    answer = api.chat.completions.create(
        model="m",
        messages=[{"role": "system", "content": "be"}, {"role": "user", "content": "to"}],
        max_tokens=8,
        temperature=0,
    )
    message = answer.choices[0].message
    assert message.role == "assistant" and isinstance(message.content, str)
    assert "\nUser:" not in message.content
    chunks = list(
        api.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "or"}], max_tokens=4, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"


BAD = {
    "malformed JSON": b'{"prompt": "to be",',
    "not an object": [1, 2],
    "no prompt": {"max_tokens": 4},
    "prompt not a string": {"prompt": 42},
    "max_tokens a string": {"prompt": "to", "max_tokens": "5"},
    "max_tokens 10**9": {"prompt": "to", "max_tokens": 10**9},
    "max_tokens 0": {"prompt": "to", "max_tokens": 0},
    "temperature below 0": {"prompt": "to", "temperature": -0.5},
    "temperature a string": {"prompt": "to", "temperature": "hot"},
    "top_p 0": {"prompt": "to", "top_p": 0},
    "top_k negative": {"prompt": "to", "top_k": -1},
    "seed a float": {"prompt": "to", "seed": 1.5},
    "stream a string": {"prompt": "to", "stream": "yes"},
    "stop a number": {"prompt": "to", "stop": 5},
    "n 2": {"prompt": "to", "n": 2},
    "1 MB prompt": {"prompt": "to be " * 200_000},
    "prompt over the context": {"prompt": "to be or not " * 20},
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_a_4xx_json_error_and_the_server_goes_on(server, case):
    started = time.monotonic()
    response = post(server, "/v1/completions", BAD[case])
    assert 400 <= response.status_code < 500, response.text
    message = response.json()["error"]["message"]
    assert isinstance(message, str) and message and "Traceback" not in message
    assert time.monotonic() - started < 10
    assert post(server, "/v1/completions", {"prompt": "to", "max_tokens": 2}).status_code == 200


def test_without_the_serve_extra_it_is_one_line(run_dir, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import uvicorn now fails
    assert tinyllm.main(["--serve", "--out", str(run_dir), "--port", "0"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("tinyllm: error: --serve needs the serve extra") and "[serve]" in line


def test_unknown_routes_and_methods_are_json_errors(server):
    assert httpx.get(server.url + "/v1/nothing").json()["error"]["message"]
    response = httpx.get(server.url + "/v1/completions")
    assert response.status_code == 405 and response.json()["error"]["message"]
    # a trailing slash is another route, not a bodiless 307 redirect
    slash = httpx.post(server.url + "/v1/completions/", json={"prompt": "to"})
    assert slash.status_code == 404 and slash.json()["error"]["message"]


def test_a_client_that_leaves_mid_stream_frees_its_row(run_dir):
    with ServerProcess(run_dir, "serve.batch_size=1", f"serve.max_tokens={ENDLESS}") as server:
        body = {"prompt": "to", "max_tokens": ENDLESS, "stream": True, "temperature": 0}
        with httpx.stream("POST", server.url + "/v1/completions", json=body) as response:
            lines = response.iter_lines()  # kept: a dropped iterator closes the response
            next(line for line in lines if line.startswith("data: {"))
            assert httpx.get(server.url + "/health").json()["active"] == 1
        deadline = time.monotonic() + 5
        while httpx.get(server.url + "/health").json()["active"] and time.monotonic() < deadline:
            time.sleep(0.05)
        health = httpx.get(server.url + "/health").json()
        assert health["active"] == 0 and health["tokens_served"] < ENDLESS
        # The one row serves the next request (it would wait for the endless one otherwise).
        answer = post(server, "/v1/completions", {"prompt": "to", "max_tokens": 3})
        assert answer.status_code == 200 and time.monotonic() < deadline + 10


def test_a_client_that_gives_up_on_a_whole_answer_frees_its_row(run_dir):
    with ServerProcess(run_dir, "serve.batch_size=1", f"serve.max_tokens={ENDLESS}") as server:
        body = {"prompt": "to", "max_tokens": ENDLESS, "temperature": 0}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=body, timeout=1.0)
        deadline = time.monotonic() + 5
        while httpx.get(server.url + "/health").json()["active"] and time.monotonic() < deadline:
            time.sleep(0.05)
        health = httpx.get(server.url + "/health").json()
        assert health["active"] == 0 and health["tokens_served"] < ENDLESS


async def _flood(url: str, n: int, body: dict) -> list[int]:
    limits = httpx.Limits(max_connections=n)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        answers = await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(n)))
    return [a.status_code for a in answers]


def test_a_full_queue_answers_429_at_once_and_a_flood_gets_only_2xx_429_503(run_dir):
    args = ("serve.batch_size=1", "serve.queue_size=2")
    with ServerProcess(run_dir, *args) as server:
        started = time.monotonic()
        codes = asyncio.run(_flood(server.url, 200, {"prompt": "to", "max_tokens": 32}))
        assert time.monotonic() - started < 120
        assert set(codes) <= {200, 429, 503} and 429 in codes and 200 in codes
        refused = post(server, "/health", b"")  # the server still answers
        assert refused.status_code == 405
        assert post(server, "/v1/completions", {"prompt": "to", "max_tokens": 2}).status_code == 200


def test_api_key_from_the_environment(run_dir):
    env = {"TINYLLM_API_KEY": "s3cret"}
    with ServerProcess(run_dir, *SMALL, env=env) as server:
        body = {"prompt": "to", "max_tokens": 2}
        assert post(server, "/v1/completions", body).status_code == 401
        wrong = post(server, "/v1/completions", body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["message"]
        with pytest.raises(openai.AuthenticationError):
            client(server, key="nope").models.list()
        assert client(server, key="s3cret").models.list().data
        assert httpx.get(server.url + "/health").status_code == 200


def test_a_public_address_without_a_key_is_warned_about_and_ctrl_c_ends_it(run_dir):
    with ServerProcess(run_dir, *SMALL, "--host", "0.0.0.0") as server:
        assert any("no API key is set" in line for line in server.lines)
        assert server.url.startswith("http://0.0.0.0:")
        started = time.monotonic()
        assert server.stop(signal.SIGINT) == 130 and time.monotonic() - started < 10
    assert server.lines[-1] == "tinyllm: interrupted", server.lines
    assert not any("Traceback" in line for line in server.lines)


def test_the_ready_line_comes_only_once_ctrl_c_reaches_the_server(monkeypatch):
    """A Ctrl-C right after the ready line must stop the server, not interrupt its start
    (which left a never-awaited coroutine's warning as the last line). In process: when the
    line is written, uvicorn has started and holds SIGINT."""
    import io
    import socket
    from types import SimpleNamespace

    import uvicorn

    from model.serve_stage import stopping_server_class

    seen = {}

    class Stderr(io.StringIO):
        def write(self, text: str) -> int:
            seen["sigint"], seen["started"] = signal.getsignal(signal.SIGINT), server.started
            server.should_exit = True  # stop at once: the line is all this test needs
            return super().write(text)

    async def app(scope, receive, send):  # never called: nothing connects
        raise AssertionError(scope)

    monkeypatch.setattr(sys, "stderr", Stderr())
    listener = socket.create_server(("127.0.0.1", 0))
    config = uvicorn.Config(app, lifespan="off", log_config=None)
    engine = SimpleNamespace(drain=lambda: None, stop=lambda: None)
    server = stopping_server_class()(config, engine, SimpleNamespace(), "serve: ready\n")
    try:
        server.run(sockets=[listener])
    finally:
        listener.close()
    assert sys.stderr.getvalue() == "serve: ready\n"
    assert seen == {"sigint": server.handle_exit, "started": True}


def test_a_quantized_run_is_served(run_dir, tmp_path, capsys):
    """An int8 run answers with the greedy text that `--inference` gives on it. (Greedy, not
    sampled: a request without a seed may draw end-of-text first and make no tokens.)"""
    import shutil

    quantized = tmp_path / "q8"
    shutil.copytree(run_dir, quantized)
    script = [sys.executable, str(ROOT / "scripts" / "quantize.py"), "--run", str(quantized)]
    subprocess.run([*script, "--bits", "8"], check=True, capture_output=True, timeout=300)
    expected = inference_text(quantized, "to be", 6, capsys)
    assert expected  # the comparison below is of some text, not of two empty answers
    with ServerProcess(quantized, *SMALL) as server:
        answer = client(server).completions.create(
            model="m", prompt="to be", max_tokens=6, temperature=0
        )
    assert answer.choices[0].text == expected and answer.usage.completion_tokens >= 1


def test_sigterm_ends_the_server_within_10_s_with_one_line(run_dir):
    with ServerProcess(run_dir, *SMALL, f"serve.max_tokens={ENDLESS}") as server:
        body = {"prompt": "to", "max_tokens": ENDLESS, "stream": True, "temperature": 0}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as live:
            lines = live.iter_lines()  # kept: a dropped iterator closes the response
            next(line for line in lines if line.startswith("data: {"))
            started = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            tail = list(lines)  # ends: finished, cut, or an error event
        code = server.wait(timeout_s=15)  # no second signal: SIGTERM alone ends it
        assert time.monotonic() - started < 10
    assert code == 143, server.lines
    assert not any("Traceback" in line for line in server.lines), server.lines
    assert server.lines[-1] == "tinyllm: interrupted by SIGTERM", server.lines
    # The endless stream was ended by an error event, in time, on a clean connection.
    events = [line for line in tail if line]
    assert all(line.startswith("data: ") for line in events)
    assert "shutting down" in json.loads(events[-1][6:])["error"]["message"]
