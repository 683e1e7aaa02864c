"""One thread owns the model: requests queue up and run one at a time.

A model (and its slot pool, table and forward clock) is not safe to run from two threads
at once, so requests queue here; each job hands its text back to the event loop as it
is produced. A job whose client left is cancelled between two tokens: generate ends
normally, so the cache stays consistent and the next job starts clean.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field

from ..runtime.generate import Generation, run_generation
from ..runtime.sampling import Sampling
from .errors import APIError

log = logging.getLogger("expertcache.serve")


@dataclass
class Job:
    ids: list[int]
    max_tokens: int
    sampling: Sampling
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # ("text", str) ... ("done", Generation)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def emit(self, kind: str, value) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is gone (server shutting down): nobody listens
            self.cancelled.set()

    async def result(self) -> Generation:
        """Wait for the end (texts are dropped: the answer holds the whole text)."""
        while True:
            kind, value = await self.events.get()
            if kind == "done":
                return value
            if kind == "error":
                raise value


class Worker:
    def __init__(self, model, tokenizer, on_done, max_queue: int) -> None:
        self.model, self.tokenizer, self.on_done = model, tokenizer, on_done
        self.jobs: queue.Queue = queue.Queue(maxsize=max_queue)
        self.running: Job | None = None
        self.closing = False
        self.thread = threading.Thread(target=self._run, name="expertcache-worker", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        if self.closing:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise APIError(503, f"the server is busy ({self.jobs.maxsize} requests queued); retry later",
                           code="server_busy") from None

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel what is queued or running, then end the thread."""
        self.closing = True
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancelled.set()
                job.emit("error", APIError(503, "the server is shutting down", code="shutting_down"))
        if self.running is not None:
            self.running.cancelled.set()
        self.jobs.put(None)
        self.thread.join(timeout)

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            if job.cancelled.is_set():  # the client left while queued
                continue
            self.running = job
            try:
                gen = run_generation(self.model, self.tokenizer, job.ids, job.max_tokens, job.sampling,
                                     on_text=lambda text, job=job: job.emit("text", text),
                                     cancelled=job.cancelled.is_set)
                self.on_done(gen)
            except Exception as err:  # noqa: BLE001  one bad request must not end the server
                log.exception("generation failed")
                job.emit("error", APIError(500, f"generation failed: {type(err).__name__}: {err}"))
                continue
            finally:
                self.running = None
            job.emit("done", gen)
