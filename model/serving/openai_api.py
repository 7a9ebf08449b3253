"""OpenAI's completion and chat-completion requests, checked, and the objects answered.

`parse_completion` / `parse_chat` turn a request body (already JSON-decoded) into a
`Completion`: the prompt text and the sampling settings, every field type-checked, with an
`ApiError` (HTTP status + message, answered as `{"error": {"message": ...}}`) for anything
wrong. Fields OpenAI defines that change nothing here (`user`, `logit_bias` left empty,
`presence_penalty` 0, ...) are accepted and ignored; ones that would change the answer and
are not supported (`n` > 1, `echo`, `logprobs`, `suffix`, `best_of` > 1, tools) are refused.

Chat messages become one plain prompt for a base model (`chat_prompt`): each message on a
line as "Role: content", then "Assistant:" for the model to continue; generation stops where
the model starts the next "User:" or "System:" line.

    >>> chat_prompt([{"role": "system", "content": "Be brief."},
    ...              {"role": "user", "content": "Hello"}])
    'System: Be brief.\\nUser: Hello\\nAssistant:'
"""

from __future__ import annotations

import math
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from model.serving.config import ServeConfig

CHAT_STOP = ["\nUser:", "\nSystem:"]
ROLES = {"system": "System", "user": "User", "assistant": "Assistant", "developer": "System"}
_UNSUPPORTED = {"echo": False, "suffix": None, "logprobs": None, "tools": None}
_SEED_MAX = 2**31 - 1


class ApiError(Exception):
    """A request the server refuses: `status` (4xx/5xx) and a one-line message."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": None, "code": None}}


@dataclass
class Completion:
    """A checked request: the prompt text and how to continue it."""

    prompt: str
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    chat: bool = False


def parse_completion(body: Any, limits: ServeConfig) -> Completion:
    """`POST /v1/completions`: `prompt` (a string, or a list of one string) and the settings."""
    body = _object(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise ApiError(400, "'prompt' is required and must be a string")
    return _settings(body, prompt, limits, chat=False)


def parse_chat(body: Any, limits: ServeConfig) -> Completion:
    """`POST /v1/chat/completions`: `messages` as a plain prompt (`chat_prompt`)."""
    body = _object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' is required and must be a non-empty list")
    completion = _settings(body, chat_prompt(messages), limits, chat=True)
    completion.stop = [*completion.stop, *CHAT_STOP]
    return completion


def chat_prompt(messages: list[Any]) -> str:
    """The documented template: "Role: content" lines, then "Assistant:"."""
    lines = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ApiError(400, f"messages[{i}] must be an object with 'role' and 'content'")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
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
    for name, allowed in _UNSUPPORTED.items():
        if body.get(name, allowed) not in (allowed, None, False, ""):
            raise ApiError(400, f"'{name}' is not supported by this server")
    for name in ("n", "best_of"):
        if body.get(name, 1) not in (1, None):
            raise ApiError(400, f"'{name}' must be 1: this server returns one choice")
    return body


def _settings(body: dict[str, Any], prompt: str, limits: ServeConfig, chat: bool) -> Completion:
    tokens_key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = _integer(body, tokens_key, limits.default_max_tokens, low=1)
    if max_tokens > limits.max_tokens:
        raise ApiError(
            400,
            f"'{tokens_key}' is {max_tokens}, above this server's limit of {limits.max_tokens}",
        )
    temperature = _number(body, "temperature", 1.0)
    if temperature < 0:
        raise ApiError(400, f"'temperature' must be >= 0, got {temperature}")
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise ApiError(400, f"'top_p' must be in (0, 1], got {top_p}")
    seed = body.get("seed")
    if seed is None:
        seed = random.randrange(_SEED_MAX)  # a fresh draw per request, as OpenAI's
    elif not _is_int(seed) or not -(2**31) <= seed <= _SEED_MAX:
        raise ApiError(400, "'seed' must be an integer in -2147483648..2147483647")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be true or false")
    return Completion(
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=_integer(body, "top_k", 0, low=0),
        seed=int(seed),
        stop=_stop(body.get("stop")),
        stream=stream,
        chat=chat,
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _integer(body: dict[str, Any], name: str, default: int, low: int) -> int:
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
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ApiError(400, f"'{name}' must be a number, got {value!r}"[:200])
    return float(value)


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and len(value) <= 4 and all(isinstance(s, str) for s in value):
        return [s for s in value if s]
    raise ApiError(400, "'stop' must be a string or a list of at most 4 strings")


# -- answers ---------------------------------------------------------------------------------


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def choice(text: str, finish: str | None, chat: bool, delta: bool, first: bool) -> dict:
    if not chat:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    if not delta:
        message = {"role": "assistant", "content": text}
        return {"index": 0, "message": message, "finish_reason": finish}
    part = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
    return {"index": 0, "delta": part, "finish_reason": finish}


def envelope(ident: str, model: str, chat: bool, chunk: bool, choices: list[dict]) -> dict:
    kind = ("chat.completion" if chat else "text_completion") + (".chunk" if chunk and chat else "")
    return {
        "id": ident,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }


def usage(done: dict) -> dict:
    return {
        "prompt_tokens": done["prompt_tokens"],
        "completion_tokens": done["completion_tokens"],
        "total_tokens": done["prompt_tokens"] + done["completion_tokens"],
    }
