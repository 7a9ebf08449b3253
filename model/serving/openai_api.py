"""OpenAI's completion and chat-completion requests, checked, and the objects answered.

`parse_completion` / `parse_chat` turn a request body (already JSON-decoded) into a
`Completion`: the prompts and the sampling settings, every field type- and range-checked
where it is parsed (so no request reaches the engine with a value it cannot hold), with an
`ApiError` (HTTP status + message, answered as `{"error": {"message": ...}}`) for anything
wrong. Fields OpenAI defines that change nothing here (`user`, an empty `logit_bias`,
`presence_penalty` 0, ...) are accepted and ignored; a value that would change OpenAI's answer
and is not supported here (`n` > 1, `best_of` > 1, `suffix`, tools, a non-empty `logit_bias`,
non-zero penalties, a `response_format` other than text) is refused with a 400 that names the
field. A stream with `stream_options.include_usage` ends with OpenAI's usage chunk.

Completions take `prompt` as a string, a list of token ids, or a list of either (one choice
per prompt, as lm-evaluation-harness sends them), `echo`, and `logprobs` (0-5 alternatives:
the harness's log-likelihood requests are `echo` + `logprobs` + `max_tokens` 0 or 1). Chat
takes `logprobs` and `top_logprobs`.

Chat messages become one plain prompt for a base model (`chat_prompt`): each message on a
line as "Role: content", then "Assistant:" for the model to continue; generation stops where
the model starts the next "User:" or "System:" line.

    >>> chat_prompt([{"role": "system", "content": "Be brief."},
    ...              {"role": "user", "content": "Hello"}])
    'System: Be brief.\\nUser: Hello\\nAssistant:'
"""

from __future__ import annotations

import dataclasses
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from model.decoding.sampling import MAX_LOGPROBS
from model.decoding.sampling_params import SEED_MAX, SamplingParams
from model.serving.config import ServeConfig
from plumbing.errors import UsageError

CHAT_STOP = ["\nUser:", "\nSystem:"]
ROLES = {"system": "System", "user": "User", "assistant": "Assistant", "developer": "System"}
# Fields accepted only at their neutral value (or absent): anything else changes the answer.
_NEUTRAL = {
    "suffix": ('"" (empty)', lambda v: v == ""),
    "tools": ("[]", lambda v: v == []),
    "functions": ("[]", lambda v: v == []),
    "logit_bias": ("{}", lambda v: v == {}),
    "frequency_penalty": ("0", lambda v: _is_number(v) and v == 0),
    "presence_penalty": ("0", lambda v: _is_number(v) and v == 0),
    "n": ("1: this server returns one choice per prompt", lambda v: _is_number(v) and v == 1),
    "best_of": ("1", lambda v: _is_number(v) and v == 1),
    "response_format": ('{"type": "text"}', lambda v: v == {"type": "text"}),
}
MAX_STOPS = 4
MAX_STOP_CHARS = 4096  # a stop string's matcher is built on the engine thread: ~2 ms per 1,000


class ApiError(Exception):
    """A request the server refuses: `status` (4xx/5xx) and a one-line message."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": None, "code": None}}


@dataclass
class Completion:
    """A checked request: its prompts (text, or token ids) and how to continue them."""

    prompts: list[str | list[int]]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    chat: bool = False
    echo: bool = False
    logprobs: int | None = None  # alternatives per token, 0..5; None: no log-probabilities
    seed_drawn: bool = False  # no `seed` in the request: each prompt samples with its own draw

    def sampling_of(self, index: int) -> SamplingParams:
        """Prompt `index`'s settings: a request's seed for every prompt, or without one, a
        draw per prompt (a list that repeats a prompt gets several samples, as OpenAI's)."""
        if not self.seed_drawn or index == 0:
            return self.sampling
        return dataclasses.replace(self.sampling, seed=random.randrange(SEED_MAX))


def parse_completion(body: Any, limits: ServeConfig) -> Completion:
    """`POST /v1/completions`: `prompt` and the settings (see the module docstring)."""
    body = _object(body)
    prompts = _prompts(body.get("prompt"), limits)
    echo = _flag(body, "echo")
    logprobs = body.get("logprobs")
    if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= MAX_LOGPROBS):
        raise ApiError(400, f"'logprobs' must be an integer in 0..{MAX_LOGPROBS}")
    completion = _settings(body, prompts, limits, chat=False, low=0 if echo else 1)
    completion.echo, completion.logprobs = echo, logprobs
    if completion.stream and len(prompts) > 1:
        raise ApiError(400, "'stream' takes one prompt: send a list of prompts without it")
    return completion


def parse_chat(body: Any, limits: ServeConfig) -> Completion:
    """`POST /v1/chat/completions`: `messages` as a plain prompt (`chat_prompt`)."""
    body = _object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' is required and must be a non-empty list")
    completion = _settings(body, [chat_prompt(messages)], limits, chat=True, low=1)
    completion.stop = [*completion.stop, *CHAT_STOP]
    if _flag(body, "logprobs"):
        completion.logprobs = _integer(body, "top_logprobs", 0, low=0)
        if completion.logprobs > MAX_LOGPROBS:
            raise ApiError(400, f"'top_logprobs' must be in 0..{MAX_LOGPROBS}")
    elif body.get("top_logprobs") is not None:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true")
    return completion


def chat_prompt(messages: list[Any]) -> str:
    """The documented template: "Role: content" lines, then "Assistant:"."""
    lines = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ApiError(400, f"messages[{i}] must be an object with 'role' and 'content'")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or role not in ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}")
        if isinstance(content, list):  # content parts: keep the text ones
            parts = [p.get("text") for p in content if isinstance(p, dict)]
            if not parts or not all(isinstance(p, str) for p in parts):
                raise ApiError(400, f"messages[{i}].content parts must be text parts")
            content = "".join(parts)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string")
        lines.append(f"{ROLES[role]}: {content}")
    return "\n".join(lines) + "\nAssistant:"


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name, (neutral, is_neutral) in _NEUTRAL.items():
        if body.get(name) is not None and not is_neutral(body[name]):
            raise ApiError(400, f"'{name}' is not supported by this server: it must be {neutral}")
    return body


def _prompts(prompt: Any, limits: ServeConfig) -> list[str | list[int]]:
    """A string, a list of token ids, or a non-empty list of either (at most queue_size)."""
    if isinstance(prompt, str) or _is_token_list(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if len(prompt) > limits.queue_size:
            raise ApiError(
                400,
                f"'prompt' is a list of {len(prompt)} prompts; this server takes at most "
                f"{limits.queue_size} in one request",
            )
        if all(isinstance(p, str) or _is_token_list(p) for p in prompt):
            return list(prompt)
    raise ApiError(400, "'prompt' is required: a string, a list of token ids, or a list of either")


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(_is_int(t) for t in value)


def _settings(
    body: dict[str, Any], prompts: list, limits: ServeConfig, chat: bool, low: int
) -> Completion:
    # null is "not given", as for every field: max_tokens then counts
    given = body.get("max_completion_tokens") is not None
    tokens_key = "max_completion_tokens" if given else "max_tokens"
    max_tokens = _integer(body, tokens_key, limits.default_max_tokens, low=low)
    if max_tokens > limits.max_tokens:
        raise ApiError(
            400,
            f"'{tokens_key}' is {max_tokens}, above this server's limit of {limits.max_tokens}",
        )
    seed = _integer(body, "seed", None, low=0)  # its upper bound: SamplingParams.checked
    drawn = seed is None
    if drawn:
        seed = random.randrange(SEED_MAX)  # a fresh draw, as OpenAI's (each prompt its own)
    sampling = SamplingParams(
        temperature=_number(body, "temperature", 1.0),
        top_k=_integer(body, "top_k", 0, low=0),
        top_p=_number(body, "top_p", 1.0),
        seed=seed,
    )
    try:
        sampling.checked()
    except UsageError as err:
        raise ApiError(400, f"'{str(err).split()[0]}' {str(err).split(' ', 1)[1]}"[:300]) from None
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not (isinstance(options, dict) and stream):
        raise ApiError(400, "'stream_options' must be an object, and only with 'stream': true")
    return Completion(
        prompts=prompts,
        max_tokens=max_tokens,
        sampling=sampling,
        stop=_stop(body.get("stop")),
        stream=stream,
        include_usage=_flag(options or {}, "include_usage"),
        chat=chat,
        seed_drawn=drawn,
    )


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be true or false")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _integer(body: dict[str, Any], name: str, default: int | None, low: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not _is_int(value) or value < low:
        raise ApiError(400, f"'{name}' must be an integer >= {low}, got {value!r}"[:200])
    return value


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value):
        raise ApiError(400, f"'{name}' must be a number, got {value!r}"[:200])
    return value  # its range: SamplingParams.checked (an int too large for a float included)


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if (
        isinstance(value, list)
        and len(value) <= MAX_STOPS
        and all(isinstance(s, str) for s in value)
    ):
        if any(len(s) > MAX_STOP_CHARS for s in value):
            raise ApiError(400, f"'stop' strings must be at most {MAX_STOP_CHARS} characters")
        return [s for s in value if s]
    raise ApiError(400, f"'stop' must be a string or a list of at most {MAX_STOPS} strings")


# -- answers ---------------------------------------------------------------------------------


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def choice(
    text: str,
    finish: str | None,
    chat: bool,
    delta: bool,
    first: bool,
    index: int = 0,
    logprobs: dict | None = None,
) -> dict:
    if not chat:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    if not delta:
        message = {"role": "assistant", "content": text}
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}
    part = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
    return {"index": index, "delta": part, "logprobs": logprobs, "finish_reason": finish}


def envelope(ident: str, model: str, chat: bool, chunk: bool, choices: list[dict]) -> dict:
    kind = ("chat.completion" if chat else "text_completion") + (".chunk" if chunk and chat else "")
    return {
        "id": ident,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }


def usage(dones: list[dict]) -> dict:
    prompt = sum(d["prompt_tokens"] for d in dones)
    completion = sum(d["completion_tokens"] for d in dones)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
