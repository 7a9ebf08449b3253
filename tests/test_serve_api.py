"""--serve for evaluation harnesses and scrapers, and against hostile clients.

A tiny BPE run is served by a real `tinyllm.py --serve` process with tight limits. Checked:
`echo` + `logprobs` against the model's own log-likelihoods (prompts as text, as token ids, as
a list of either), chat logprobs, vLLM's tokenizer routes, Prometheus `/metrics`, every kind
of bad input to the new fields as a 4xx JSON error, and each defense: range checks where a
field is parsed, idle and slow connections, the connection cap, the cap on buffered bodies,
JSON-only bodies, the Host check.
"""

from __future__ import annotations

import json
import signal
import socket
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")

from model.rundir.trained import open_trained_run  # noqa: E402
from tests.serve_helpers import ServerProcess  # noqa: E402
from tests.tiny_models import forward  # noqa: E402
from tests.tiny_runs import served_run  # noqa: E402

LIMITS = (
    "serve.batch_size=4",
    "serve.queue_size=16",
    "serve.header_timeout_s=1",
    "serve.request_timeout_s=2",
    "serve.max_connections=12",
    "serve.max_request_bytes=60000",
    "serve.max_buffered_bytes=100000",
)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return served_run(tmp_path_factory, "serve_api")


@pytest.fixture(scope="module")
def trained(run_dir):
    tokenizer, model, _ = open_trained_run(run_dir).load()
    return tokenizer, model


@pytest.fixture(scope="module")
def server(run_dir):
    with ServerProcess(run_dir, *LIMITS) as server:
        yield server


def post(server, path: str, body, headers=None) -> httpx.Response:
    content = body if isinstance(body, bytes | str) else json.dumps(body)
    headers = {"content-type": "application/json", **(headers or {})}
    return httpx.post(server.url + path, content=content, headers=headers, timeout=60)


def log_likelihoods(model, ids: list[int]) -> np.ndarray:
    """log p(ids[i] | ids[:i]) for i >= 1, from one full forward pass."""
    logits = forward(model, jnp.asarray([ids], jnp.int32))[0]
    logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
    return logp[np.arange(len(ids) - 1), np.asarray(ids[1:])]


def test_a_null_max_completion_tokens_leaves_max_tokens_in_force(server):
    # present but null, it won: the default length was used, and a limit went unchecked
    chat = {"messages": [{"role": "user", "content": "to"}]}
    for route, base in (("/v1/completions", {"prompt": "to"}), ("/v1/chat/completions", chat)):
        body = {**base, "max_tokens": 2, "max_completion_tokens": None, "temperature": 0}
        assert post(server, route, body).json()["usage"]["completion_tokens"] == 2
        over = post(server, route, {**body, "max_tokens": 10**6})
        assert over.status_code == 400 and "'max_tokens'" in over.json()["error"]["message"]


def test_a_repeated_prompt_without_a_seed_gives_several_samples(server):
    # one seed for every prompt of a list: the choices were identical
    body = {"prompt": ["to"] * 4, "max_tokens": 12, "temperature": 1.0}
    texts = {c["text"] for c in post(server, "/v1/completions", body).json()["choices"]}
    assert len(texts) > 1
    seeded = {
        c["text"] for c in post(server, "/v1/completions", {**body, "seed": 7}).json()["choices"]
    }
    assert len(seeded) == 1  # a seed given is every prompt's, as vLLM's


def test_echo_logprobs_equal_the_models_own_for_text_and_token_prompts(server, trained):
    tokenizer, model = trained
    ids = tokenizer.encode("to be or not to be")
    body = {"prompt": [ids, "whether tis"], "echo": True, "logprobs": 2, "max_tokens": 0}
    answer = post(server, "/v1/completions", body).json()
    first, second = sorted(answer["choices"], key=lambda c: c["index"])
    assert first["text"] == "to be or not to be" and second["text"] == "whether tis"
    lp = first["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert len(lp["tokens"]) == len(ids) and "".join(lp["tokens"]) == first["text"]
    np.testing.assert_allclose(lp["token_logprobs"][1:], log_likelihoods(model, ids), atol=1e-4)
    assert all(len(top) == 2 for top in lp["top_logprobs"][1:])
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert answer["usage"]["completion_tokens"] == 0
    assert answer["usage"]["prompt_tokens"] == len(ids) + len(tokenizer.encode("whether tis"))
    # max_tokens 1, as lm-eval asks: the prompt's scores, then the new token's
    one = post(server, "/v1/completions", {**body, "prompt": ids, "max_tokens": 1,
                                           "temperature": 0}).json()  # fmt: skip
    scored = one["choices"][0]["logprobs"]
    assert len(scored["tokens"]) == len(ids) + 1
    assert scored["token_logprobs"][-1] == pytest.approx(max(scored["top_logprobs"][-1].values()))


def test_text_offsets_point_at_each_tokens_text_past_a_lone_utf8_byte(server, trained):
    # A lone continuation byte decodes to one U+FFFD: the offsets after it count it.
    tokenizer, _ = trained
    lone = next(i for i in range(256) if tokenizer.decode_bytes([i]) == b"\xa9")
    ids = [lone, *tokenizer.encode("to be")]
    body = {"prompt": ids, "echo": True, "logprobs": 0, "max_tokens": 0}
    choice = post(server, "/v1/completions", body).json()["choices"][0]
    assert choice["text"] == "\ufffdto be"
    offsets, tokens = choice["logprobs"]["text_offset"], choice["logprobs"]["tokens"]
    assert offsets[:2] == [0, 1]
    for at, token in zip(offsets[1:], tokens[1:], strict=True):
        assert choice["text"][at : at + len(token)] == token
    # An empty prompt is the end-of-text token: echo shows it, and the offsets count it.
    empty = {"prompt": "", "echo": True, "logprobs": 0, "max_tokens": 3, "temperature": 0}
    choice = post(server, "/v1/completions", empty).json()["choices"][0]
    assert choice["text"].startswith("<|endoftext|>") and choice["logprobs"]["text_offset"][0] == 0
    for at, token in zip(choice["logprobs"]["text_offset"], choice["logprobs"]["tokens"],
                         strict=True):  # fmt: skip
        if not token.startswith("bytes:"):
            assert choice["text"][at : at + len(token)] == token, choice
    # A prompt that ends mid-character: its U+FFFD is counted, then the generated text's own.
    cut = next(i for i in range(256) if tokenizer.decode_bytes([i]) == b"\xe2")
    body = {"prompt": [ids[1], cut], "echo": True, "logprobs": 0, "max_tokens": 4,
            "temperature": 0}  # fmt: skip
    for stream in (False, True):
        choice = post(server, "/v1/completions", {**body, "stream": stream})
        if stream:  # the events' offsets, joined
            events = [json.loads(line[6:]) for line in choice.text.splitlines()
                      if line.startswith("data: {")]  # fmt: skip
            text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
            logprobs = [e["choices"][0]["logprobs"] for e in events if e["choices"]]
            offsets = [at for lp in logprobs if lp for at in lp["text_offset"]]
            tokens = [t for lp in logprobs if lp for t in lp["tokens"]]
        else:
            choice = choice.json()["choices"][0]
            text, offsets = choice["text"], choice["logprobs"]["text_offset"]
            tokens = choice["logprobs"]["tokens"]
        assert text.startswith("t\ufffd") and offsets[:3] == [0, 1, 2], (text, offsets)
        for at, token in zip(offsets[2:], tokens[2:], strict=True):
            if not token.startswith("bytes:"):
                assert text[at : at + len(token)] == token, (text, offsets, tokens)


def test_a_stream_with_include_usage_ends_with_the_usage(server):
    body = {"prompt": "to", "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as reply:
        events = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] <= 3
    assert (
        last["usage"]["total_tokens"]
        == last["usage"]["prompt_tokens"] + last["usage"]["completion_tokens"]
    )
    assert all("usage" not in json.loads(e) for e in events[:-2])


def test_chat_logprobs(server):
    body = {"messages": [{"role": "user", "content": "to"}], "max_tokens": 3,
            "logprobs": True, "top_logprobs": 2, "temperature": 0}  # fmt: skip
    answer = post(server, "/v1/chat/completions", body).json()
    content = answer["choices"][0]["logprobs"]["content"]
    assert 1 <= len(content) <= 3
    for entry in content:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][1]["logprob"]


def test_tokenizer_routes_as_vllm_has_them(server, trained):
    tokenizer, _ = trained
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert info["eos_token"] == "<|endoftext|>" and info["model_max_length"] == 32
    tokens = post(server, "/tokenize", {"prompt": "to be<|endoftext|>"}).json()
    assert tokens["tokens"] == tokenizer.encode("to be<|endoftext|>")
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 32
    text = post(server, "/detokenize", {"tokens": tokens["tokens"]}).json()
    assert text == {"prompt": "to be<|endoftext|>"}


def test_metrics_in_prometheus_format(server):
    post(server, "/v1/completions", {"prompt": "to be", "max_tokens": 4})
    post(server, "/v1/completions", {"prompt": "to be", "max_tokens": 4})
    post(server, "/v1/completions", {"prompt": 5})
    text = httpx.get(server.url + "/metrics").text
    assert 'tinyllm_requests_total{route="/v1/completions",status="200"}' in text
    assert 'tinyllm_requests_total{route="/v1/completions",status="400"}' in text
    values = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert values["tinyllm_generated_tokens_total"] >= 8
    assert values["tinyllm_prompt_tokens_total"] >= 2
    assert values["tinyllm_time_to_first_token_seconds_count"] >= 2
    assert values["tinyllm_time_per_output_token_seconds_count"] >= 2
    assert values["tinyllm_queue_length"] == 0 and values["tinyllm_batch_rows"] == 4
    assert values["tinyllm_prefix_cache_hits_total"] >= 1  # the second "to be" reused the first


BAD = {
    "token id outside the vocabulary": {"prompt": [1, 2, 100_000]},
    "negative token id": {"prompt": [[1, -1]]},
    "10,000 prompts": {"prompt": ["a"] * 10_000},
    "logprobs 99": {"prompt": "to", "logprobs": 99},
    "logprobs a string": {"prompt": "to", "logprobs": "5"},
    "echo a string": {"prompt": "to", "echo": "yes"},
    "echo over the context": {"prompt": "to be or not " * 20, "echo": True, "max_tokens": 0},
    "max_tokens 0 without echo": {"prompt": "to", "max_tokens": 0},
    "stream with two prompts": {"prompt": ["a", "b"], "stream": True},
    "top_k past int32": {"prompt": "hi", "top_k": 2147483648},
    "seed past int32": {"prompt": "hi", "seed": 2**31},
    "negative seed": {"prompt": "hi", "seed": -1},
    "logit_bias": {"prompt": "hi", "logit_bias": {"5": 10}},
    "frequency_penalty": {"prompt": "hi", "frequency_penalty": 0.5},
    "presence_penalty": {"prompt": "hi", "presence_penalty": -1},
    "best_of 2": {"prompt": "hi", "best_of": 2},
    "suffix": {"prompt": "hi", "suffix": "x"},
    "temperature past a float": {"prompt": "hi", "temperature": 10**400},
    "top_p past a float": {"messages": [{"role": "user", "content": "hi"}], "top_p": -(10**400)},
    "temperature past float32": {"prompt": "hi", "temperature": 1e39},
    "top_p under float32": {"prompt": "hi", "top_p": 1e-300},
    "a stop string of 5,000 characters": {"prompt": "hi", "stop": ["a" * 5000]},
    "response_format json": {"prompt": "hi", "response_format": {"type": "json_object"}},
    "stream_options without stream": {"prompt": "hi", "stream_options": {"include_usage": True}},
    "tokenize a lone surrogate": {"prompt": "\ud800"},
    "nested 100,000 deep": b"[" * 100_000 + b"]" * 100_000,
    "chat role a list": {"messages": [{"role": ["user"], "content": "hi"}]},
    "top_logprobs without logprobs": {
        "messages": [{"role": "user", "content": "hi"}],
        "top_logprobs": 2,
    },
    "tokenize without a prompt": {"text": "hi"},
    "detokenize bad ids": {"tokens": [1, "a"]},
}
NEUTRAL = {
    "logit_bias": {},
    "frequency_penalty": 0,
    "presence_penalty": 0.0,
    "logprobs": None,
    "n": 1.0,
    "seed": 5.0,
    "response_format": {"type": "text"},
}  # 1.0 is 1, as for max_tokens


def test_a_prompt_over_the_context_is_refused_alike_as_text_and_as_ids(server, trained):
    tokenizer, model = trained
    block = model.cfg.block_size
    text = "to be or not " * block
    ids = tokenizer.encode(text)
    assert len(ids) > block
    for prompt in (text, ids):
        response = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
        assert response.status_code == 400, response.text
        message = response.json()["error"]["message"]
        assert (
            message == f"the prompt is {len(ids)} tokens; this server takes at most {block} tokens"
        )


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_a_4xx_json_error_and_the_server_goes_on(server, case):
    path = "/v1/chat/completions" if "messages" in str(BAD[case])[:20] else "/v1/completions"
    if case.startswith(("tokenize", "detokenize")):
        path = "/" + case.split()[0]
    response = post(server, path, BAD[case])
    assert 400 <= response.status_code < 500, response.text
    message = response.json()["error"]["message"]
    assert message and "Traceback" not in message
    names = ("logit_bias", "frequency_penalty", "presence_penalty", "top_k", "seed", "top_p",
             "temperature", "stop", "response_format", "stream_options", "suffix")  # fmt: skip
    for name in names:
        if name in case:
            assert name in message  # the refusal names the field
    assert not message.endswith(("be ", "be")), message  # and, where it says one, the value
    ok = post(server, "/v1/completions", {"prompt": "to", "max_tokens": 2, **NEUTRAL})
    assert ok.status_code == 200, ok.text
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_only_json_bodies_and_only_this_servers_host(server):
    plain = post(server, "/v1/completions", '{"prompt": "to"}', {"content-type": "text/plain"})
    assert plain.status_code == 415 and "application/json" in plain.json()["error"]["message"]
    foreign = post(server, "/v1/completions", {"prompt": "to"}, {"host": "evil.example:80"})
    assert foreign.status_code == 421 and "allowed_hosts" in foreign.json()["error"]["message"]
    port = server.url.rsplit(":", 1)[1]
    local = post(server, "/v1/completions", {"prompt": "to"}, {"host": f"localhost:{port}"})
    assert local.status_code == 200
    big = post(server, "/v1/completions", {"prompt": "to"}, {"x-filler": "a" * 20_000})
    assert big.status_code == 431 and "headers" in big.json()["error"]["message"]
    counted = httpx.get(server.url + "/metrics").text  # the guard's refusals are counted too
    for status in (415, 421, 431):
        assert f'route="/v1/completions",status="{status}"' in counted


def connect(server) -> socket.socket:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes the connection (recv gives b"") within `seconds`."""
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
        return True
    except (TimeoutError, ConnectionResetError):
        return False
    finally:
        sock.close()


def test_a_silent_connection_is_closed_after_the_head_timeout(server):
    sock = connect(server)
    started = time.monotonic()
    assert closed_within(sock, 8)
    assert time.monotonic() - started < 5  # serve.header_timeout_s=1, not never


def test_connections_past_the_cap_are_closed_and_the_server_recovers(server):
    idle = [connect(server) for _ in range(12)]  # serve.max_connections=12
    time.sleep(0.3)
    extra = connect(server)
    assert closed_within(extra, 0.8)  # at once, not after the head timeout
    for sock in idle:
        sock.close()
    time.sleep(0.5)
    assert post(server, "/v1/completions", {"prompt": "to", "max_tokens": 2}).status_code == 200


def test_a_request_just_under_the_connection_cap_gets_its_answer(server):
    idle = [connect(server) for _ in range(11)]  # one under serve.max_connections=12
    time.sleep(0.2)
    try:  # uvicorn's own concurrency limit answered it with a plain-text 503
        reply = post(server, "/v1/completions", {"prompt": "to", "max_tokens": 2})
        assert reply.status_code == 200, reply.text
    finally:
        for sock in idle:
            sock.close()


def head(length: int) -> bytes:
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def test_a_body_sent_too_slowly_is_a_408(server):
    sock = connect(server)
    sock.sendall(head(100) + b'{"prompt": ')
    reply = sock.recv(65536)
    sock.close()
    assert reply.startswith(b"HTTP/1.1 408"), reply[:100]


def test_bodies_held_at_once_have_a_cap(server):
    first, second = connect(server), connect(server)
    first.sendall(head(59_000) + b" " * 55_000)  # held: the body is not complete
    time.sleep(0.3)
    second.sendall(head(59_000) + b" " * 55_000)  # 110,000 bytes > serve.max_buffered_bytes
    reply = second.recv(65536)
    assert reply.startswith(b"HTTP/1.1 503"), reply[:100]
    first.close()
    second.close()
    assert post(server, "/v1/completions", {"prompt": "to", "max_tokens": 2}).status_code == 200


def test_a_non_ascii_authorization_header_is_a_401(run_dir):
    with ServerProcess(run_dir, "serve.batch_size=1", "--api-key", "sekret") as keyed:
        response = httpx.post(
            keyed.url + "/v1/completions",
            content=b'{"prompt": "to"}',
            headers=[
                (b"content-type", b"application/json"),
                (b"authorization", "Bearer sékret".encode()),
            ],
        )
        assert response.status_code == 401 and response.json()["error"]["message"]
        # With a key, any Host may ask (the key is the defense); /metrics stays open.
        other = httpx.get(keyed.url + "/metrics", headers={"host": "example.org"})
        assert other.status_code == 200


def test_a_half_sent_body_at_sigterm_ends_cleanly(run_dir):
    with ServerProcess(run_dir, "serve.batch_size=1") as fresh:
        sock = connect(fresh)
        sock.sendall(head(1000) + b'{"prompt": "to be')  # the rest never comes
        time.sleep(0.5)
        assert fresh.stop(signal.SIGTERM) == 143
        sock.close()
    assert not any("Traceback" in line for line in fresh.lines), fresh.lines
    assert fresh.lines[-1] == "tinyllm: interrupted by SIGTERM", fresh.lines[-3:]
