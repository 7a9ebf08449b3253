"""The clients of scripts/bench_serve.py: streamed completion requests, sent one at a time or
all at once (asyncio + httpx), and the figures of a wave of them (tokens/s, TTFT, latency
percentiles, failures, the CPU time the clients and the server spent) and of several rounds of
waves (medians).

Tokens are counted by the server (`/health`'s `tokens_served` before and after a wave), not
from the stream: bench_serve.py's docstring says why.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass
class Answer:
    """One streamed request: whether it succeeded, its latency and TTFT (s), its
    finish_reason, and what went wrong when it failed."""

    ok: bool
    latency_s: float
    ttft_s: float | None = None
    finish: str | None = None
    error: str = ""


async def stream_one(client, url: str, body: dict) -> Answer:
    import httpx

    start = time.perf_counter()
    ttft, finish = None, None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")
                error = f"HTTP {response.status_code}: {text[:200]}"
                return Answer(False, time.perf_counter() - start, error=error)
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    ok = finish is not None
                    error = "" if ok else "[DONE] without a finish_reason"
                    return Answer(ok, time.perf_counter() - start, ttft, finish, error)
                chunk = json.loads(data)
                if "error" in chunk:
                    error = chunk["error"].get("message", "an error chunk")
                    return Answer(False, time.perf_counter() - start, error=error)
                part = chunk["choices"][0]
                if ttft is None and part.get("text"):
                    ttft = time.perf_counter() - start
                finish = part.get("finish_reason") or finish
        return Answer(False, time.perf_counter() - start, error="the stream ended before [DONE]")
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as err:
        return Answer(False, time.perf_counter() - start, error=f"{type(err).__name__}: {err}")


async def health(client, url: str) -> dict:
    response = await client.get(f"{url}/health")
    response.raise_for_status()
    return response.json()


def percentile(values: list[float], q: float) -> float | None:
    """numpy's percentile (linear between the closest ranks); None for no values."""
    return float(np.percentile(values, q)) if values else None


def process_cpu_s(pid: int) -> float | None:
    """The CPU seconds (user + system, all threads) process `pid` has used so far, from Linux's
    /proc; None where that cannot be read (another OS, a process that has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the name, which may hold spaces
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def spent(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else after - before


async def wave(
    client,
    url: str,
    bodies: list[dict],
    concurrent: bool,
    server_cpu: Callable[[], float | None] = lambda: None,
) -> dict:
    """Send `bodies` all at once (or one after another): the wave's figures, as
    bench_serve.py's docstring defines them. `server_cpu` reads the server's CPU seconds so
    far (None when unknown)."""
    before = (await health(client, url))["tokens_served"]
    cpu_before = (time.process_time(), server_cpu())
    start = time.perf_counter()
    if concurrent:
        answers = await asyncio.gather(*(stream_one(client, url, b) for b in bodies))
    else:
        answers = [await stream_one(client, url, b) for b in bodies]
    wall_s = time.perf_counter() - start
    cpu_after = (time.process_time(), server_cpu())
    tokens = (await health(client, url))["tokens_served"] - before
    good = [a for a in answers if a.ok]
    # one request's decode rate after its first token (requests that ran to max_tokens)
    n = bodies[0]["max_tokens"]
    rates = [
        (n - 1) / (a.latency_s - a.ttft_s)
        for a in good
        if a.finish == "length" and a.ttft_s is not None and a.latency_s > a.ttft_s
    ]
    return {
        "decode_per_s": statistics.median(rates) if rates else None,
        "requests": len(answers),
        "failed": len(answers) - len(good),
        "ended_early": sum(a.finish == "stop" for a in good),
        "tokens": tokens,
        "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s,
        "ttft_p50_s": percentile([a.ttft_s for a in good if a.ttft_s is not None], 50),
        "latency_p50_s": percentile([a.latency_s for a in good], 50),
        "latency_p99_s": percentile([a.latency_s for a in good], 99),
        "client_cpu_s": cpu_after[0] - cpu_before[0],
        "server_cpu_s": spent(cpu_before[1], cpu_after[1]),
        "errors": sorted({a.error for a in answers if not a.ok})[:3],
    }


def summary(waves: list[dict]) -> dict:
    """Medians over the rounds; requests, failures and early ends summed."""

    def median(key: str) -> float | None:
        values = [w[key] for w in waves if w[key] is not None]
        return statistics.median(values) if values else None

    figures = ("tokens_per_s", "ttft_p50_s", "latency_p50_s", "latency_p99_s", "decode_per_s",
               "client_cpu_s", "server_cpu_s")  # fmt: skip
    totals = ("requests", "failed", "ended_early", "tokens")
    return {
        **{key: median(key) for key in figures},
        **{key: sum(w[key] for w in waves) for key in totals},
        "errors": sorted({e for w in waves for e in w["errors"]})[:3],
        "waves": waves,
    }
