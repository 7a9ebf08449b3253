"""The serving engine: one thread that decodes every request in one batch (continuous batching).

Requests wait in a bounded queue (`submit` refuses at once when it is full). Between decode
chunks the engine thread admits waiting requests into free rows of the batch (each prompt is
prefilled into its row on its own), slides rows whose context is full, runs one compiled chunk
of decode steps for all rows together, and hands each request its new text. A request leaves
its row when it ends (its stop token, a stop string, max_tokens) or is cancelled (the client
went away), and the next waiting request takes the row at the next chunk boundary.

A chunk right after an admission is one step long, so a new request's first token comes after
one step, not a whole chunk; otherwise chunks are `chunk_size` steps (fewer when a row's
context fills up first).

    >>> engine = Engine(model, tokenizer, rows=16, queue_size=64)     # doctest: +SKIP
    >>> engine.start()
    >>> engine.submit(Request(prompt_ids=[1, 2], max_tokens=8, on_event=print))
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from flax import nnx

from model.decoding.budget import check_memory
from model.decoding.generate import refill_pieces
from model.decoding.programs import jit_programs
from model.decoding.prompts import stop_token_of
from model.decoding.steps import PAD_ID, start_carry, window_size
from model.network.gpt import GPT
from model.serving.batch import (
    batch_chunk,
    batch_settings,
    empty_batch,
    prefill_row,
    put_row,
    take_row,
)
from model.serving.text import StopText
from tokenizer import Tokenizer

DEFAULT_CHUNK_STEPS = 8


class QueueFull(Exception):
    """The waiting queue is full (or the engine is stopping): answer 429/503 at once."""


@dataclass
class Request:
    """One completion to generate. `on_event(kind, data)` is called on the engine thread with
    ("text", str) pieces, then ("done", {"finish_reason", "prompt_tokens",
    "completion_tokens"}) or ("error", message)."""

    prompt_ids: list[int]
    max_tokens: int
    on_event: Callable[[str, object], None]
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop: list[str] = field(default_factory=list)
    cancelled: bool = False
    generated: int = 0

    def cancel(self) -> None:
        """The client is gone: the engine frees the row at the next chunk boundary."""
        self.cancelled = True


class Engine:
    """Continuous batching over `rows` batch rows (see the module docstring)."""

    def __init__(
        self,
        model: GPT,
        tokenizer: Tokenizer,
        *,
        rows: int,
        queue_size: int,
        chunk_steps: int = DEFAULT_CHUNK_STEPS,
    ) -> None:
        check_memory(model.cfg, rows + 1, use_cache=True)
        self.model, self.tokenizer = model, tokenizer
        self.rows, self.queue_size, self.chunk_steps = rows, queue_size, chunk_steps
        self.size = model.cfg.block_size
        self.window = window_size(self.size)
        self.stop_token = stop_token_of(tokenizer)
        self.graphdef, self.state = nnx.split(model)
        self.refill = jit_programs(model, use_cache=True, chunk_size=1).refill
        # Prompt widths a prefill may run: 16, 32, ... up to --inference's refill window.
        self.prefill_widths = sorted({min(2**i, self.window) for i in range(4, 16)} | {self.window})
        self.batch = empty_batch(model, rows)
        # Row counts a chunk may run: powers of two below `rows`, and `rows` (admission takes
        # the lowest free slot, so few requests stay in few rows).
        self.row_counts = sorted({*(2**i for i in range(rows.bit_length()) if 2**i < rows), rows})
        self.settings = batch_settings(rows)
        self.pos = np.zeros(rows, np.int32)  # host copy of each row's position
        self.slots: list[Request | None] = [None] * rows
        self.texts: list[StopText | None] = [None] * rows
        self.waiting: collections.deque[Request] = collections.deque()
        self.tokens_served = 0
        self._wake = threading.Condition()
        self._stopping: str | None = None
        self._draining: str | None = None
        self._thread = threading.Thread(target=self._run, name="tinyllm-engine", daemon=True)
        self._failure: BaseException | None = None

    # -- the public side (any thread) ---------------------------------------------------------

    def start(self) -> None:
        """Compile the programs (a one-token request through every path), then serve."""
        for width in self.prefill_widths:
            prompt_ids = [0] * (width + 1)
            self._admit_one(0, Request(prompt_ids, 2, on_event=lambda kind, data: None))
        long = [0] * min(self.window + 2, self.size)  # past the window: --inference's refill
        self._admit_one(0, Request(long, 2, on_event=lambda kind, data: None))
        for rows in self.row_counts:
            self._chunk(1, rows)
        self._slide(0, force=True)
        self._release(0)
        self._thread.start()

    def submit(self, request: Request) -> None:
        """Queue a request; QueueFull when the queue holds `queue_size` requests already."""
        with self._wake:
            if self._stopping is not None or self._draining is not None:
                raise QueueFull(self._stopping or self._draining)
            if len(self.waiting) >= self.queue_size:
                raise QueueFull(f"the queue is full ({self.queue_size} requests waiting)")
            self.waiting.append(request)
            self._wake.notify()

    def drain(self, reason: str = "the server is shutting down") -> None:
        """Refuse new requests (QueueFull with `reason`); the ones taken go on."""
        with self._wake:
            self._draining = reason

    def stop(self, reason: str = "the server is shutting down", timeout_s: float = 5.0) -> None:
        """Stop decoding; every request not yet done gets ("error", reason)."""
        with self._wake:
            self._stopping = reason
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def stats(self) -> dict[str, int]:
        with self._wake:
            status = "ok"
            if self._failure is not None:
                status = "failed"
            elif self._stopping is not None or self._draining is not None:
                status = "shutting down"
            return {
                "status": status,
                "queue_length": len(self.waiting),
                "active": sum(r is not None for r in self.slots),
                "batch_rows": self.rows,
                "tokens_served": self.tokens_served,
            }

    # -- the engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._step():
                pass
        except BaseException as err:  # a bug or a device failure: tell every client, keep it
            self._failure = err
            self._stopping = f"the server failed ({type(err).__name__}): see its log"
            raise
        finally:
            self._fail_all(self._stopping or "the server stopped")

    def _step(self) -> bool:
        """Admit, slide, decode one chunk, deliver. False once stopping."""
        with self._wake:
            while self._stopping is None and not self.waiting and not any(self.slots):
                self._wake.wait()
            if self._stopping is not None:
                return False
            admitted = []
            for slot in range(self.rows):
                if self.slots[slot] is None or self.slots[slot].cancelled:
                    if self.slots[slot] is not None:
                        self._release(slot)
                    while self.waiting and self.waiting[0].cancelled:
                        self.waiting.popleft()
                    if not self.waiting:
                        break
                    admitted.append((slot, self.waiting.popleft()))
        for slot, request in admitted:
            self._admit_one(slot, request)
        live = [s for s in range(self.rows) if self.slots[s] is not None]
        if not live:
            return True
        for slot in live:
            self._slide(slot)
        steps = 1 if admitted else self.chunk_steps
        steps = min(steps, *(self.size - int(self.pos[s]) for s in live))
        tokens_BxC = self._chunk(steps)
        for slot in live:
            self._deliver(slot, tokens_BxC[slot])
        return True

    def _admit_one(self, slot: int, request: Request) -> None:
        prompt = np.asarray(request.prompt_ids, np.int32)
        row = start_carry(self.model, prompt, 1, use_cache=True)
        keep = len(prompt) - 1
        if keep <= self.window:
            width = next(w for w in self.prefill_widths if w >= keep)
            row = prefill_row(self.graphdef, self.state, row, np.int32(keep), width=width)
        else:
            row = refill_pieces(
                self.refill, self.state, row, shift=0, keep=keep, window=self.window
            )
        self.batch = put_row(self.batch, row, np.int32(slot))
        self.pos[slot] = keep
        s = self.settings
        s["seed"][slot] = request.seed
        s["temperature"][slot] = request.temperature
        s["top_k"][slot] = request.top_k
        s["top_p"][slot] = request.top_p
        s["stop"][slot] = -1 if self.stop_token is None else self.stop_token
        self.slots[slot] = request
        self.texts[slot] = StopText(request.stop)

    def _slide(self, slot: int, force: bool = False) -> None:
        """A full context keeps its last window - 1 tokens and the pending one, as
        `--inference` does (model.decoding.generate)."""
        if self.pos[slot] != self.size and not force:
            return
        keep = self.window - 1
        row = take_row(self.batch, np.int32(slot))
        shift = max(int(self.pos[slot]) - keep, 0)
        row = refill_pieces(
            self.refill, self.state, row, shift=shift, keep=keep, window=self.window
        )
        self.batch = put_row(self.batch, row, np.int32(slot))
        self.pos[slot] = keep

    def _chunk(self, steps: int, rows: int | None = None) -> np.ndarray:
        """One compiled chunk over the first rows that hold every busy slot (the smallest
        count in `row_counts` that does)."""
        active = np.array([r is not None for r in self.slots])
        if rows is None:
            needed = int(np.flatnonzero(active).max()) + 1 if active.any() else 1
            rows = next(n for n in self.row_counts if n >= needed)
        self.batch, tokens_BxC = batch_chunk(
            self.graphdef,
            self.state,
            self.batch,
            self.settings,
            active,
            np.int32(steps),
            chunk_size=self.chunk_steps,
            rows=rows,
        )
        self.pos[active] += steps
        return np.asarray(tokens_BxC)[:, :steps]

    def _deliver(self, slot: int, tokens: np.ndarray) -> None:
        request, text = self.slots[slot], self.texts[slot]
        if request.cancelled:
            self._release(slot)
            return
        finish = None
        pieces = []
        before = request.generated
        for token in tokens.tolist():
            if token == PAD_ID or token == self.stop_token:
                finish = "stop"
                break
            request.generated += 1
            pieces.append(text.feed(self.tokenizer.decode_bytes([token])))
            if text.stopped:
                finish = "stop"
                break
            if request.generated >= request.max_tokens:
                finish = "length"
                break
        if finish is not None:
            pieces.append(text.finish())
        with self._wake:
            self.tokens_served += request.generated - before
        piece = "".join(pieces)
        if piece:
            request.on_event("text", piece)
        if finish is not None:
            request.on_event(
                "done",
                {
                    "finish_reason": finish,
                    "prompt_tokens": len(request.prompt_ids),
                    "completion_tokens": request.generated,
                },
            )
            self._release(slot)

    def _release(self, slot: int) -> None:
        self.slots[slot] = None
        self.texts[slot] = None
        self.pos[slot] = 0

    def _fail_all(self, reason: str) -> None:
        with self._wake:
            pending = [r for r in self.slots if r is not None] + list(self.waiting)
            self.waiting.clear()
        for slot in range(self.rows):
            self._release(slot)
        for request in pending:
            if not request.cancelled:
                request.on_event("error", reason)
