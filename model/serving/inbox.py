"""What the serving engine's thread shares with every other thread: the waiting queue, the
engine's status (draining, stopping, failed) and its counters, all under one lock.

The engine thread owns everything else (model/serving/engine.py, its threading contract).
Other threads reach the engine only through here (`submit`, `drain`, `stop`, `stats`) and
through a request's `cancelled` event. A request whose client went away holds no place in the
queue: it is dropped whenever the queue is counted or taken from.

    >>> inbox = Inbox(queue_size=1)
    >>> inbox.submit(Request([1, 2], max_tokens=4, on_event=print))
    >>> inbox.submit(Request([3], max_tokens=4, on_event=print))
    Traceback (most recent call last):
    ...
    model.serving.requests.QueueFull: the queue is full (1 requests waiting)
"""

from __future__ import annotations

import collections
import threading

from model.serving.requests import EngineStopping, QueueFull, Request

COUNTERS = ("busy_rows", "tokens_served", "prefix_hits", "reused_tokens")


class Inbox:
    """The bounded queue of waiting requests, the engine's status and its counters."""

    def __init__(self, queue_size: int) -> None:
        self.queue_size = queue_size
        self.lock = threading.Condition()
        self._waiting: collections.deque[Request] = collections.deque()
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._stopping: str | None = None
        self._draining: str | None = None
        self._failure: BaseException | None = None

    # -- any thread ---------------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        """Queue a request: QueueFull when `queue_size` wait already, EngineStopping once
        draining or stopped."""
        with self.lock:
            if self._stopping is not None or self._draining is not None:
                raise EngineStopping(self._stopping or self._draining)
            if self._live_waiting() >= self.queue_size:
                raise QueueFull(f"the queue is full ({self.queue_size} requests waiting)")
            self._waiting.append(request)
            self.lock.notify()

    def drain(self, reason: str) -> None:
        """Refuse new requests from now on (EngineStopping with `reason`)."""
        with self.lock:
            self._draining = reason

    def stop(self, reason: str) -> None:
        """Tell the engine thread to stop (the first reason given stays)."""
        with self.lock:
            self._stopping = self._stopping or reason
            self.lock.notify()

    def fail(self, err: BaseException) -> None:
        """The engine thread failed with `err`: stop, saying so."""
        with self.lock:
            self._failure = err
            self._stopping = f"the server failed ({type(err).__name__}): see its log"

    def stats(self, batch_rows: int) -> dict[str, object]:
        with self.lock:
            status = "ok"
            if self._failure is not None:
                status = "failed"
            elif self._stopping is not None or self._draining is not None:
                status = "shutting down"
            return {
                "status": status,
                "queue_length": self._live_waiting(),
                "active": self._counts["busy_rows"],
                "batch_rows": batch_rows,
                **{k: v for k, v in self._counts.items() if k != "busy_rows"},
            }

    def count(self, **added: int) -> None:
        """Add to the counters (COUNTERS)."""
        with self.lock:
            for name, value in added.items():
                self._counts[name] += value

    # -- the engine thread --------------------------------------------------------------------

    def wait_for_work(self, idle: bool) -> bool:
        """While `idle` (no row busy, no chunk in flight), wait for a request or a stop. False
        once stopping."""
        with self.lock:
            while self._stopping is None and not self._waiting and idle:
                self.lock.wait()
            return self._stopping is None

    def take(self, most: int) -> list[Request]:
        """Up to `most` waiting requests, oldest first, skipping those cancelled."""
        taken = []
        with self.lock:
            while len(taken) < most and self._waiting:
                request = self._waiting.popleft()
                if not request.cancelled.is_set():
                    taken.append(request)
        return taken

    def close(self) -> tuple[str, list[Request]]:
        """Why the engine stops, and every request still waiting (taken out of the queue)."""
        with self.lock:
            pending = list(self._waiting)
            self._waiting.clear()
            return self._stopping or "the server stopped", pending

    def _live_waiting(self) -> int:
        """How many wait, once the requests whose clients went away are dropped (under the
        lock)."""
        if any(request.cancelled.is_set() for request in self._waiting):
            live = [request for request in self._waiting if not request.cancelled.is_set()]
            self._waiting.clear()
            self._waiting.extend(live)
        return len(self._waiting)
