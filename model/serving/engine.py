"""The serving engine: one thread that decodes every request in one batch (continuous batching).

Requests wait in a bounded queue (`submit` refuses at once when it is full). Between decode
chunks the engine thread admits waiting requests into free rows of the batch (each prompt is
prefilled into its row on its own), slides rows whose context is full, runs one compiled chunk
of decode steps for all rows together, and hands each request its new text. A request leaves
its row when it ends (its stop token, a stop string, max_tokens) or is cancelled (the client
went away), and the next waiting request takes the row at the next chunk boundary.

A chunk right after an admission is one step long, so a new request's first token comes after
one step, not a whole chunk; otherwise chunks are `chunk_size` steps (fewer when a row's
context fills up first, or when no row needs that many for its max_tokens). A row whose
request has had every token its max_tokens allows launched sits out of the next chunk (its
last tokens are in the chunk in flight), so a batch whose requests end by length runs no
chunk past them.

Prefix reuse (as llama.cpp's `cache_prompt`): a row keeps its prompt's K/V, also after the
request leaves. A new request takes the lowest free row (few busy rows, few rows computed),
starts from a copy of the cache row whose kept prompt shares the longest start with its own
(its own row's, or any other's; model/serving/prefix.py chooses), and prefills only from there
(one token before it, whose logits it needs). Log-probabilities of the reused prompt tokens
are kept with the row when they were computed.

Threading contract: the engine thread alone owns the batch, the rows (`slots`, `pos`,
`launched`, `texts`, `outboxes`, the kept prefixes) and every compiled call; before `start`
returns, the thread that calls it stands in for the engine thread. Other threads touch only
the `Inbox` (model/serving/inbox.py: the waiting queue, the status and the counters, under its
lock) and a request's `cancelled` event. `submit` raises QueueFull when the queue is full and
EngineStopping once the engine drains or stops.

    >>> engine = Engine(model, tokenizer, rows=16, queue_size=64)     # doctest: +SKIP
    >>> engine.start()  # doctest: +SKIP
    >>> engine.submit(Request(prompt_ids=[1, 2], max_tokens=8, on_event=print))  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np
from flax import nnx

from model.decoding.budget import check_memory
from model.decoding.generate import prefill_pieces
from model.decoding.prompts import stop_token_of
from model.decoding.steps import PAD_ID, chunk_outputs, start_carry, window_size
from model.network.gpt import GPT
from model.serving.batch_state import BatchState
from model.serving.inbox import Inbox
from model.serving.outbox import Outbox
from model.serving.prefix import KeptPrefix, reuse_source
from model.serving.programs import EnginePrograms
from model.serving.requests import Request
from model.serving.text import StopText, read_tokens
from plumbing.errors import UsageError
from tokenizer import Tokenizer

DEFAULT_CHUNK_STEPS = 8
DEFAULT_STREAM_INTERVAL_S = 0.02  # a row's output is sent at most this often
log = logging.getLogger("tinyllm")


@dataclass
class Launched:
    """A chunk in flight: its outputs (device arrays), its steps, and the request each busy
    row held when it was launched."""

    out: dict
    steps: int
    requests: dict[int, Request]


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
        stream_interval_s: float = DEFAULT_STREAM_INTERVAL_S,
    ) -> None:
        check_memory(model.cfg, rows + 1, use_cache=True)
        if chunk_steps > model.cfg.block_size:  # a chunk's tokens must fit in a row's cache
            raise UsageError(
                f"serve.chunk_steps must be at most the model's context, {model.cfg.block_size} "
                f"tokens, got {chunk_steps}"
            )
        self.model, self.tokenizer = model, tokenizer
        self.rows, self.chunk_steps = rows, chunk_steps
        self.stream_interval_s = stream_interval_s
        self.size = model.cfg.block_size
        self.window = window_size(self.size)
        self.stop_token = stop_token_of(tokenizer)
        self.graphdef, self.state = nnx.split(model)
        self.head_DxV = model.decoding_head()  # the tied output layer, laid out for a CPU
        # The shapes of chunk and prefill it runs, compiled in `start`.
        self.programs = EnginePrograms(
            size=self.size, window=self.window, rows=rows, chunk_steps=chunk_steps
        )
        # -- the engine thread's own (see the threading contract) --
        self.batch = BatchState(model, rows)  # the rows on the device, and their settings
        self.pos = np.zeros(rows, np.int32)  # host copy of each row's position
        self.launched = np.zeros(rows, np.int64)  # steps run for each row's request so far
        self.slots: list[Request | None] = [None] * rows
        self.texts: list[StopText | None] = [None] * rows
        self.outboxes: list[Outbox | None] = [None] * rows
        self.kept: list[KeptPrefix | None] = [None] * rows
        self._in_flight: Launched | None = None  # the chunk launched last, not yet delivered
        self.inbox = Inbox(queue_size)  # -- shared with other threads, under its lock --
        self._thread = threading.Thread(target=self._run, name="tinyllm-engine", daemon=True)

    # -- the public side (any thread) ---------------------------------------------------------

    def start(self) -> None:
        """Compile the programs (side by side), run a request through every one (a program's
        first run pays one-time set-up costs), then serve."""
        settings, active = self.batch.device_inputs(np.zeros(self.rows, bool))
        carry = self.batch.carry
        self.programs.compile(
            self.model, self.graphdef, self.state, carry, settings, active, self.head_DxV
        )
        for scored in (False, True):
            for width in self.programs.prefill_widths:
                self._admit(0, Request([0] * (width + 1), 2, _ignore, logprobs=0, echo=scored))
                self._release(0, forget=True)  # so the next width runs cold
        self._admit(0, Request([0] * min(self.window + 2, self.size), 2, _ignore))
        # A chunk of one step, and with fixed step counts also the whole chunk's program.
        counts = [1, self.chunk_steps] if self.programs.fixed_counts else [1]
        for rows, length in self.programs.shapes():
            for steps in counts:
                if self.pos[0] + steps > self.size:
                    self._slide(0, force=True)
                if self.pos[0] + steps > self.size:  # a chunk longer than the context allows
                    continue
                jax.block_until_ready(self._chunk(steps, rows, length))
        self._slide(0, force=True)
        self._release(0, forget=True)
        self._thread.start()

    def submit(self, request: Request) -> None:
        """Queue a request: QueueFull when `queue_size` wait already, EngineStopping once
        draining or stopped."""
        self.inbox.submit(request)

    def drain(self, reason: str = "the server is shutting down") -> None:
        """Refuse new requests (EngineStopping with `reason`); the ones taken go on."""
        self.inbox.drain(reason)

    def stop(self, reason: str = "the server is shutting down", timeout_s: float = 5.0) -> None:
        """Stop decoding; every request not yet done gets ("error", reason)."""
        self.inbox.stop(reason)
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def stats(self) -> dict[str, object]:
        return self.inbox.stats(self.rows)

    # -- the engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._step():
                pass
        except BaseException as err:  # a bug or a device failure: tell every client, keep it
            self.inbox.fail(err)
            raise
        finally:
            self._fail_all()

    def _step(self) -> bool:
        """Admit, slide, launch one chunk, then deliver the chunk before it while this one
        computes (the host's work overlaps the device's). False once stopping."""
        admitted = self._take_waiting()
        if admitted is None:
            return False
        for slot, request in admitted:
            self._guarded(slot, self._admit, slot, request)
        # A row whose chunks so far already make every token its request may take (its
        # max_tokens) sits out: its last tokens are in the chunk in flight.
        owed = {
            s: r.max_tokens - int(self.launched[s])
            for s, r in enumerate(self.slots)
            if r is not None
        }
        running = [s for s, n in owed.items() if n > 0]
        launched = None
        if running:
            for slot in running:
                self._slide(slot)
            steps = 1 if admitted else self.chunk_steps
            if not self.programs.fixed_counts:  # a chunk costs its steps: none past the need
                steps = min(steps, max(owed[s] for s in running))
            steps = min(steps, *(self.size - int(self.pos[s]) for s in running))
            active = np.zeros(self.rows, bool)
            active[running] = True
            out = self._chunk(steps, active=active)
            launched = Launched(out, steps, {s: self.slots[s] for s in running})
        previous, self._in_flight = self._in_flight, launched
        if previous is not None:
            self._deliver_chunk(previous)
        return True

    def _deliver_chunk(self, chunk: Launched) -> None:
        """Hand each request of a finished chunk its tokens. A request that ended in the chunk
        before (at a stop token or string, which only its tokens tell) has been released
        since (its row ran one chunk more, for nothing): skipped."""
        out = {k: v[:, : chunk.steps] for k, v in chunk_outputs(chunk.out).items()}
        for slot, request in chunk.requests.items():
            if self.slots[slot] is request:
                self._guarded(slot, self._deliver, slot, out)

    def _take_waiting(self) -> list[tuple[int, Request]] | None:
        """Wait for work; free the rows of cancelled requests; pair waiting requests with free
        rows, lowest first. None once stopping."""
        idle = self._in_flight is None and not any(self.slots)
        if not self.inbox.wait_for_work(idle):
            return None
        for slot, request in enumerate(self.slots):
            if request is not None and request.cancelled.is_set():
                self._release(slot)
        free = [s for s in range(self.rows) if self.slots[s] is None]
        return list(zip(free, self.inbox.take(len(free)), strict=False))

    def _guarded(self, slot: int, work: Callable, *args) -> None:
        """Run one request's part; if it fails, that request gets an error and the engine goes
        on (the batch itself is only replaced by calls that completed)."""
        request = self.slots[slot] or args[-1]
        try:
            work(*args)
        except Exception as err:
            log.exception("serve: a request failed")
            self._release(slot, forget=True)
            if not request.cancelled.is_set():
                # its own callback may be what failed: then there is nothing more to tell
                with contextlib.suppress(Exception):
                    request.on_event("error", f"the request failed ({type(err).__name__})")

    def _admit(self, slot: int, request: Request) -> None:
        prompt = np.asarray(request.prompt_ids, np.int32)
        keep = len(prompt) - 1
        # A cold start takes this row's cache too: slots past pos are masked, whatever they hold.
        scored = request.scores_prompt
        source, shared = reuse_source(self.kept, request.prompt_ids, scored, slot)
        kept = self.kept[source]
        start = max(shared - 1, 0)  # run the last shared token again: its logits are needed
        row = start_carry(self.model, prompt, 1, use_cache=False)
        row["cache"] = self.batch.take_row(source if start else slot)["cache"]

        def run(carry, shift, at, keep, width):
            out = self.programs.refills[width, scored](self.state, carry, shift, at, keep)
            return out if scored else (out, None)

        row, scores = prefill_pieces(
            run, row, shift=0, keep=keep, widths=self.programs.prefill_widths, start=start
        )
        if scored:  # the reused positions' scores come from the kept prefix
            scores = {k: np.concatenate([kept.scores[k][:start], v[0]]) if start else v[0]
                      for k, v in scores.items()}  # fmt: skip
        self.batch.put_row(row, slot)
        self.pos[slot] = keep
        self.kept[slot] = KeptPrefix(prompt[:keep], scores)
        wants_scores = request.logprobs is not None
        self.batch.set_row_settings(slot, request.sampling, self.stop_token, wants_scores)
        self.slots[slot] = request
        self.texts[slot] = StopText(request.stop)
        self.outboxes[slot] = Outbox(self.stream_interval_s)
        self.inbox.count(busy_rows=1, prefix_hits=int(start > 0), reused_tokens=start)
        if scored:
            request.on_event("prompt", scores)
        if request.max_tokens == 0:
            self._finish(slot, "length")

    def _slide(self, slot: int, force: bool = False) -> None:
        """A full context keeps its last window - 1 tokens and the pending one, as
        `--inference` does (model.decoding.generate)."""
        if self.pos[slot] != self.size and not force:
            return
        keep = self.window - 1
        row = self.batch.take_row(slot)
        shift = max(int(self.pos[slot]) - keep, 0)

        def run(carry, shift, at, keep, width):
            return self.programs.refills[width, False](self.state, carry, shift, at, keep), None

        row = prefill_pieces(run, row, shift=shift, keep=keep, widths=(self.window,))[0]
        self.batch.put_row(row, slot)
        self.pos[slot] = keep
        self.kept[slot] = None  # the cache now holds other tokens at those positions

    def _chunk(
        self, steps: int, rows: int | None = None, length: int | None = None,
        active: np.ndarray | None = None,
    ):  # fmt: skip
        """One compiled chunk of the rows `active` (default: every busy slot) over the first
        rows that hold them, attending over the fewest cache slots that hold every such row's
        context to the chunk's end (`EnginePrograms.shape_for`; `rows` and `length` given:
        that shape); its outputs as the device computes them, {name: [rows, chunk_size, ...]}."""
        if active is None:
            active = np.array([r is not None for r in self.slots])
        if rows is None or length is None:
            busy = np.flatnonzero(active)
            rows, length = self.programs.shape_for(
                rows=int(busy.max()) + 1 if busy.size else 1,
                length=int(self.pos[busy].max()) + steps if busy.size else 1,
            )
        out = self.batch.run_chunk(self.programs, self.state, active, steps, (rows, length))
        self.pos[active] += steps
        self.launched[active] += steps
        return out

    def _deliver(self, slot: int, out: dict[str, np.ndarray]) -> None:
        request, text = self.slots[slot], self.texts[slot]
        if request.cancelled.is_set():
            self._release(slot)
            return
        piece, sent, finish = read_tokens(
            out["token"][slot].tolist(), text, self.tokenizer.decode_bytes,
            ends=(PAD_ID, self.stop_token), room=request.max_tokens - request.generated,
        )  # fmt: skip
        request.generated += sent
        self.inbox.count(tokens_served=sent)
        box = self.outboxes[slot]
        scored = request.logprobs is not None and sent > 0
        box.hold(piece, {k: v[slot, :sent] for k, v in out.items()} if scored else None)
        now = time.perf_counter()
        if finish is not None or box.due(now):
            piece, scores = box.take(now)
            if scores is not None:
                request.on_event("tokens", scores)
            if piece:
                request.on_event("text", piece)
        if finish is not None:
            self._finish(slot, finish)

    def _finish(self, slot: int, reason: str) -> None:
        request = self.slots[slot]
        self._release(slot)
        counts = {"prompt_tokens": len(request.prompt_ids), "completion_tokens": request.generated}
        request.on_event("done", {"finish_reason": reason, **counts})

    def _release(self, slot: int, forget: bool = False) -> None:
        """Free row `slot`; with `forget`, also drop the prompt it keeps for reuse."""
        if self.slots[slot] is not None:
            self.inbox.count(busy_rows=-1)
        self.slots[slot] = None
        self.texts[slot] = None
        self.outboxes[slot] = None
        self.pos[slot] = 0
        self.launched[slot] = 0
        if forget:
            self.kept[slot] = None

    def _fail_all(self) -> None:
        """Every request taken or waiting gets ("error", why the engine stopped)."""
        reason, waiting = self.inbox.close()
        pending = [r for r in self.slots if r is not None] + waiting
        for slot in range(self.rows):
            self._release(slot)
        for request in pending:
            if not request.cancelled.is_set():
                request.on_event("error", reason)


def _ignore(kind: str, data: object) -> None:
    """The warm-up requests' events go nowhere."""
