"""The `[serve]` section: where `--serve` listens and the limits it enforces.

>>> ServeConfig(batch_size=4).validate().port
8000
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Self

from plumbing import checks
from plumbing.errors import UsageError

API_KEY_ENV = "TINYLLM_API_KEY"  # the API key, when --api-key / serve.api_key is not given


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"  # loopback only; 0.0.0.0 serves the network (set an API key)
    port: int = 8000  # 0: any free port (the ready line says which)
    api_key: str = ""  # "" : TINYLLM_API_KEY, or no key at all
    batch_size: int = 16  # requests decoded together (rows of the batch)
    queue_size: int = 64  # requests waiting for a row; more are answered 429 at once
    max_prompt_tokens: int = 0  # 0: the model's context (block_size)
    max_tokens: int = 1024  # the most `max_tokens` a request may ask for
    default_max_tokens: int = 16  # when a request gives none (OpenAI's completions default)
    chunk_steps: int = 8  # decode steps per compiled call: throughput vs streaming latency
    stream_interval_s: float = 0.02  # a request's text is sent at most this often (0: each chunk)
    max_request_bytes: int = 4 << 20  # a larger body is refused (413) before it is read
    # Against hostile clients (docs/serving.md, "Security"):
    max_buffered_bytes: int = 64 << 20  # request bodies held at once, all requests together
    request_timeout_s: float = 30.0  # to send a whole body, once the head has arrived
    header_timeout_s: float = 10.0  # to send a request head, from connecting or the last answer
    max_connections: int = 256  # open connections; more are closed as they arrive
    allowed_hosts: list[str] = field(default_factory=list)  # Host names beyond the bound one
    metrics_public: bool = True  # false: /metrics wants the API key too

    def validate(self) -> Self:
        """Raise UsageError naming the first bad value; return self if all are good."""
        if not self.host:
            raise UsageError("serve.host must not be empty (127.0.0.1 serves this machine)")
        if not 0 <= self.port <= 65535:
            raise UsageError(f"serve.port must be in 0..65535 (0 = any free port), got {self.port}")
        for key in ("batch_size", "queue_size", "max_tokens", "default_max_tokens"):
            checks.positive(f"serve.{key}", getattr(self, key))
        checks.positive("serve.chunk_steps", self.chunk_steps)
        checks.non_negative("serve.stream_interval_s", self.stream_interval_s)
        for key in ("max_request_bytes", "max_buffered_bytes", "max_connections"):
            checks.positive(f"serve.{key}", getattr(self, key))
        for key in ("request_timeout_s", "header_timeout_s"):
            checks.finite(f"serve.{key}", getattr(self, key))
            if getattr(self, key) <= 0:
                raise UsageError(f"serve.{key} must be positive, got {getattr(self, key)}")
        if self.api_key and not (self.api_key.isascii() and self.api_key.isprintable()):
            raise UsageError(
                "the API key must be printable ASCII (HTTP headers carry it): choose another"
            )
        checks.non_negative("serve.max_prompt_tokens", self.max_prompt_tokens)
        if self.default_max_tokens > self.max_tokens:
            raise UsageError(
                f"serve.default_max_tokens ({self.default_max_tokens}) must not exceed "
                f"serve.max_tokens ({self.max_tokens})"
            )
        return self
