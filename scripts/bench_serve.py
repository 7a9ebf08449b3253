"""Serving throughput under concurrent clients (continuous batching) vs one request at a time.

For each `--run` (give several: the demo model and a larger one) it starts
`tinyllm.py --serve --out RUN --port 0` itself (the queue made big enough for the
most clients; key=value overrides after the flags go to the server, last), waits for its ready
line, and always stops it at the end with SIGINT; or, with --url, it uses a server that is
already running (it must be otherwise idle: see "tokens" below). One warm-up request, then
`--repeats` rounds; each round sends, for every client count C, one wave of C concurrent
clients (asyncio + httpx), each sending one streaming `POST /v1/completions` (client i: prompt
i mod the prompts, seed i, temperature 0.8, `max_tokens` N, `"stop": null`), and then the
baseline: the first `--sequential` of those requests (16) one after another. Rounds interleave
the client counts, so a change in the machine's load touches them all alike. Per wave:

- tokens: the completion tokens the server generated for the wave, read as the difference of
  its `/health` `tokens_served` before and after (the engine counts a request's tokens before
  it sends its end). Exact, also for a request that ends early at end-of-text (the API has no
  way to forbid it; such requests are counted apart below the table). Counting stream chunks
  would be wrong: one chunk carries all the text of one decode chunk (up to serve.chunk_steps
  tokens), and re-encoding the text need not give back the same BPE tokens.
- tokens/s: those tokens over the wall time from the first send to the last response's end.
- TTFT: per request, the time to the first chunk with non-empty text; latency: to `[DONE]`.
- CPU s: the CPU time (all threads, user + system) the wave took in this script's clients
  and in the server (read from Linux's /proc, for a server this script started; "-"
  otherwise). Beside the wall time it says which side a wave waited on: a server whose
  Python spends most of the wave on its streams is bound by its event loop, not the model.
- failed: anything but HTTP 200 and a stream that ends with a finish_reason and `[DONE]`
  (429 from a full queue, an error chunk, a dropped connection, a timeout).

The table gives, per C, the medians over the rounds of tokens/s, TTFT p50 and latency p50 and
p99 (of that wave's successful requests), and the requests and failures of all rounds; then
the sequential rate and the ratio C=16 concurrent / sequential (the target is >= 5x). Then one
request against `--inference`: the decode rate after the first token of the sequential
requests (median), and the rate `tinyllm.py --inference` prints for the same run, prompt,
temperature and token count (median of `--repeats` processes; the target is >= 0.9x).
Client and server share the machine's cores: time it alone, e.g.

    flock /tmp/tinyllm-bench.lock python scripts/bench_serve.py --run runs/shakespeare \
        --run runs/char11m
    python scripts/bench_serve.py --run runs/shakespeare --clients 1 16 serve.batch_size=32
    python scripts/bench_serve.py --url http://127.0.0.1:8000 --json serve.json
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone, uninstalled

from serve_clients import health, process_cpu_s, stream_one, summary, wave  # beside this script

from plumbing.atomic import write_atomic
from plumbing.cli import OneLineParser, one_line_errors
from plumbing.errors import UsageError
from plumbing.machine import machine_facts, machine_line

ROOT = Path(__file__).resolve().parents[1]
READY = re.compile(r"serve: ready on (http://\S+)")
START_TIMEOUT_S = 600  # loading and compiling on a busy machine
PROMPTS = [
    "ROMEO:\nBut soft, what light through yonder window breaks?",
    "KING HENRY:\nOnce more unto the breach, dear friends, once more;",
    "HAMLET:\nTo be, or not to be, that is the question:",
    "JULIET:\nO gentle night, come, and give me my love.",
]


# -- the server --------------------------------------------------------------------------------


class ServerProcess:
    """`tinyllm.py --serve` on a free port; its stderr is read on a thread (kept: the last 40
    lines, shown if it fails to start). `stop` sends SIGINT, then SIGKILL after 30 s."""

    def __init__(self, run: str, overrides: list[str]) -> None:
        self.cmd = [sys.executable, str(ROOT / "tinyllm.py"), "--serve", "--out", run]
        self.cmd += ["--port", "0", *overrides]
        self.lines: deque[str] = deque(maxlen=40)
        self.url = ""
        self.proc: subprocess.Popen | None = None
        self._ready = threading.Event()

    def start(self, timeout_s: float = START_TIMEOUT_S) -> str:
        self.proc = subprocess.Popen(
            self.cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
        )
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                last = " | ".join(line for line in self.lines if line.strip())[-1500:]
                raise UsageError(f"the server did not start (its stderr: {last or 'empty'})")
        return self.url

    def _read(self) -> None:
        for line in self.proc.stderr:  # drained to the end: a full pipe would block the server
            self.lines.append(line.rstrip("\n"))
            found = READY.search(line)
            if found and not self.url:
                self.url = found.group(1)
                self._ready.set()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


async def measure(args, url: str, server_pid: int | None = None) -> dict:
    import httpx

    def server_cpu() -> float | None:
        return None if server_pid is None else process_cpu_s(server_pid)

    def body(i: int) -> dict:
        return {
            "model": server["model"],
            "prompt": args.prompt[i % len(args.prompt)],
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "seed": i,
            "stop": None,
            "stream": True,
        }

    most = max([*args.clients, args.sequential])
    limits = httpx.Limits(max_connections=most + 2, max_keepalive_connections=most + 2)
    async with httpx.AsyncClient(
        limits=limits, timeout=args.timeout, trust_env=args.url is not None
    ) as client:
        server = await health(client, url)
        warm = await stream_one(client, url, body(0))
        if not warm.ok:
            raise UsageError(f"the warm-up request failed: {warm.error}")
        rounds: dict[Any, list[dict]] = {c: [] for c in args.clients}
        rounds["sequential"] = []
        for _ in range(args.repeats):
            for c in args.clients:
                bodies = [body(i) for i in range(c)]
                rounds[c].append(await wave(client, url, bodies, True, server_cpu))
            if args.sequential:
                bodies = [body(i) for i in range(args.sequential)]
                rounds["sequential"].append(await wave(client, url, bodies, False, server_cpu))
    return {
        "clients": {c: {"clients": c, **summary(rounds[c])} for c in args.clients},
        "sequential": summary(rounds["sequential"]) if args.sequential else None,
        "server": server,
    }


# -- facts and the table -----------------------------------------------------------------------


def model_facts(run: str | None) -> dict:
    """The run's network from its saved config (no weights read): sizes and parameter count."""
    if run is None:
        return {}
    import jax

    from model.network.config import model_config_of
    from model.network.params import abstract_model
    from model.rundir.trained import open_trained_run

    trained = open_trained_run(run)
    cfg = model_config_of(trained.saved_config())
    _, params, _ = abstract_model(cfg)
    return {
        "params": sum(int(x.size) for x in jax.tree.leaves(params)),
        "quantized": trained.quantized,
        "platform": jax.default_backend(),
        **{k: getattr(cfg, k) for k in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")},
    }


def inference_rate(args, run: str) -> float | None:
    """The decode rate `tinyllm.py --inference` prints for this run and one request's settings
    (median over --repeats processes)."""
    rates = []
    for _ in range(args.repeats):
        cmd = [sys.executable, str(ROOT / "tinyllm.py"), "--inference", "--out", run,
               "--prompt", args.prompt[0], "--max-new-tokens", str(args.max_tokens),
               "--temperature", str(args.temperature), "--top-k", "0", "--seed", "0"]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
        found = re.search(r"decode ([\d,]+) tokens/s", done.stderr)
        if done.returncode == 0 and found:
            rates.append(float(found.group(1).replace(",", "")))
    return statistics.median(rates) if rates else None


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def report(args, url: str, machine: dict, model: dict, result: dict) -> None:
    server = result["server"]
    print(f"command: python {' '.join(sys.argv)}")
    print(machine_line(machine))
    if model:
        print(
            f"model: {server['model']}, {model['params'] / 1e6:.2f}M params"
            f"{' (quantized)' if model['quantized'] else ''}, vocab {model['vocab_size']}, "
            f"context {model['block_size']}, {model['n_layer']} layers x {model['n_head']} "
            f"heads x {model['n_embd']}, JAX {model['platform']}"
        )
    else:
        print(f"model: {server['model']} (give --run for its size)")
    print(f"server: {url}, {server['batch_rows']} batch rows")
    print(
        f"requests: streaming /v1/completions, max_tokens {args.max_tokens}, temperature "
        f"{args.temperature}, seed = client index, {len(args.prompt)} prompt(s); each client "
        f"sends 1 request per round; medians over {args.repeats} round(s) after 1 warm-up request\n"
    )
    print(
        "| clients | requests | tokens/s | TTFT p50 s | latency p50 s | latency p99 s | "
        "CPU s: clients | server | failed |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c, s in result["clients"].items():
        print(
            f"| {c} | {s['requests']} | {s['tokens_per_s']:,.0f} | {seconds(s['ttft_p50_s'])} | "
            f"{seconds(s['latency_p50_s'])} | {seconds(s['latency_p99_s'])} | "
            f"{seconds(s['client_cpu_s'])} | {seconds(s['server_cpu_s'])} | {s['failed']} |"
        )
    sequential = result["sequential"]
    everything = [*result["clients"].values(), *([sequential] if sequential else [])]
    if sequential:
        print(
            f"\nsequential: {args.sequential} requests one after another: "
            f"{sequential['tokens_per_s']:,.0f} tokens/s, latency p50 "
            f"{seconds(sequential['latency_p50_s'])} s, CPU s: clients "
            f"{seconds(sequential['client_cpu_s'])}, server {seconds(sequential['server_cpu_s'])}; "
            f"failed {sequential['failed']}"
        )
        same = result["clients"].get(args.sequential)
        if same and sequential["tokens_per_s"]:
            ratio = same["tokens_per_s"] / sequential["tokens_per_s"]
            print(f"{args.sequential} concurrent / sequential: {ratio:.1f}x (target >= 5x)")
        one, alone = sequential["decode_per_s"], result.get("inference_per_s")
        if one and alone:
            print(
                f"one request: decode {one:,.0f} tokens/s after its first token over HTTP; "
                f"--inference prints {alone:,.0f} tokens/s: {one / alone:.2f}x (target >= 0.9x)"
            )
    early = sum(s["ended_early"] for s in everything)
    if early:
        total = sum(s["requests"] for s in everything)
        print(
            f"note: {early} of {total} requests ended at end-of-text before max_tokens "
            "(tokens/s counts the tokens generated)"
        )
    errors = sorted({e for s in everything for e in s["errors"]})[:3]
    if errors:
        print("failures, e.g.: " + "; ".join(errors))


def main(argv: list[str] | None = None) -> None:
    p = OneLineParser(prog="bench_serve.py", description=__doc__.splitlines()[0])
    p.add_argument(
        "--run", action="append", help="a trained run directory (repeat: one table each)"
    )
    p.add_argument("--url", help="use this running server instead of starting one")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request")
    p.add_argument("--repeats", type=int, default=3, help="rounds; the table shows medians")
    p.add_argument("--sequential", type=int, default=16, help="baseline requests (0: none)")
    p.add_argument("--prompt", action="append", help="a prompt (repeat: clients take turns)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--timeout", type=float, default=600, help="seconds per request")
    p.add_argument("--json", type=Path, help="also write the figures, every round's, here")
    p.add_argument(
        "overrides", nargs="*", help="key=value for the server, e.g. serve.batch_size=32"
    )
    args = p.parse_args(argv)
    if args.run is None and args.url is None:
        p.error("give --run RUN (the server is started on it) or --url of a running server")
    if args.url and args.overrides:
        p.error("key=value overrides are for a server this script starts, not for --url")
    if min(args.clients) < 1 or args.max_tokens < 1 or args.repeats < 1 or args.sequential < 0:
        p.error("--clients, --max-tokens and --repeats must be >= 1, --sequential >= 0")
    args.prompt = args.prompt or PROMPTS
    try:
        import httpx
    except ImportError:
        p.error("this benchmark needs httpx: pip install httpx")

    with one_line_errors("bench_serve"):
        machine = machine_facts()
        records = []
        for run in args.run or [None]:
            model = model_facts(run)
            server = None
            if args.url:
                url = args.url.rstrip("/")
            else:
                queue = f"serve.queue_size={max([*args.clients, args.sequential, 64])}"
                server = ServerProcess(run, [queue, *args.overrides])
                url = server.start()
            try:
                pid = server.proc.pid if server is not None else None
                result = asyncio.run(measure(args, url, pid))
            except httpx.HTTPError as err:
                raise UsageError(f"the server at {url} does not answer ({err!r})") from None
            finally:
                if server is not None:
                    server.stop()
            if run is not None and args.sequential:
                result["inference_per_s"] = inference_rate(args, run)
            report(args, url, machine, model, result)
            print()
            result = {**result, "clients": list(result["clients"].values())}
            records.append({"run": run, "url": url, "model": model, "result": result})
        if args.json:
            record = {"command": sys.argv, "machine": machine, "runs": records}
            record.update({k: v for k, v in vars(args).items() if k not in ("json", "url", "run")})
            write_atomic(args.json, json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
