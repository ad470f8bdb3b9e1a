"""A worker process's transfer thread: an engine adapter's asynchronous
loads and saves, run one at a time, in order, off the engine's step.

Every job is bounded.  A job still queued at its deadline is not run: it
is reported failed (the adapter tells the engine: a load's blocks are load
errors, a save's blocks are not stored).  A job that runs is bounded by the
pool's own timeouts (a lock is waited for at most the connector's
``timeout``; pins and copies never wait).  A queued job can be cancelled
(the saves of a preempted request, whose blocks the engine is about to
reuse), and a running one waited for.  The thread sleeps on its queue: it
never polls, so it takes no core from the engine while there is nothing to
move.

Import-light (no Numba, no torch), like `tract.integrations.common`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["Job", "TransferThread"]

log = logging.getLogger(__name__)

QUEUED, RUNNING, DONE, FAILED, CANCELLED = "queued", "running", "done", "failed", "cancelled"


@dataclasses.dataclass(eq=False)
class Job:
    """One load or save of one request: ``run()`` does it; ``info`` is the
    adapter's own (for example the engine's block ids)."""

    kind: str
    request_id: str
    run: Callable[[], Any]
    deadline: float
    info: Any = None
    state: str = QUEUED
    result: Any = None
    error: BaseException | None = None
    seconds: float = 0.0  # from submission to the end (queueing included)
    submitted: float = 0.0


class TransferThread:
    """Runs submitted jobs in order on one daemon thread (see the module
    docstring); `finished` hands back each job once it ended, whatever the
    way: done, failed or cancelled."""

    def __init__(self, name: str = "tract-transfers", clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._cond = threading.Condition()
        self._queue: collections.deque[Job] = collections.deque()
        self._ended: list[Job] = []
        self._running: Job | None = None
        self._closing = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, kind: str, request_id: str, run: Callable[[], Any], timeout: float,
               info: Any = None) -> Job:
        """Queue ``run`` for request ``request_id``; it fails unrun when it
        has not started ``timeout`` seconds from now."""
        if not timeout > 0:
            raise ValueError(f"a transfer's timeout must be positive, got {timeout!r}")
        now = self._clock()
        job = Job(kind, request_id, run, now + timeout, info, submitted=now)
        with self._cond:
            if self._closing:
                raise RuntimeError("the transfer thread is closed: no job is taken")
            self._queue.append(job)
            self._cond.notify_all()
        return job

    def finished(self) -> list[Job]:
        """The jobs that ended since the last call, in the order they ended."""
        with self._cond:
            ended, self._ended = self._ended, []
        return ended

    def busy(self) -> bool:
        """Whether a job is queued or running."""
        with self._cond:
            return bool(self._queue) or self._running is not None

    def cancel(self, request_ids: Iterable[str], kinds: Iterable[str] | None = None,
               wait: bool = True) -> int:
        """Cancel the queued jobs of ``request_ids`` (of ``kinds``, or any
        kind); with ``wait``, also wait for such a job that is running to end
        (it is bounded, see the module docstring).  Returns how many were
        cancelled."""
        ids = set(request_ids)
        kinds = None if kinds is None else set(kinds)
        if not ids:
            return 0

        def matches(job: Job) -> bool:
            return job.request_id in ids and (kinds is None or job.kind in kinds)

        with self._cond:
            kept, cancelled = collections.deque(), 0
            for job in self._queue:
                if matches(job):
                    self._end(job, CANCELLED)
                    cancelled += 1
                else:
                    kept.append(job)
            self._queue = kept
            while wait and self._running is not None and matches(self._running):
                self._cond.wait()
        return cancelled

    def close(self, timeout: float) -> bool:
        """Take no more jobs, let the queued ones run for up to ``timeout``
        seconds, cancel what is left, and stop; whether everything ran."""
        deadline = self._clock() + timeout
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            while (self._queue or self._running is not None) and self._clock() < deadline:
                self._cond.wait(max(0.0, deadline - self._clock()))
            clean = not self._queue
            for job in self._queue:
                self._end(job, CANCELLED)
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join(max(0.0, deadline - self._clock()) + 1.0)
        return clean and not self._thread.is_alive()

    # ----------------------------------------------------------- thread

    def _end(self, job: Job, state: str, result: Any = None,
             error: BaseException | None = None) -> None:
        """(Under the condition.)"""
        job.state, job.result, job.error = state, result, error
        job.seconds = self._clock() - job.submitted
        self._ended.append(job)
        self._cond.notify_all()

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                job = self._queue.popleft()
                if self._clock() > job.deadline:
                    self._end(job, FAILED, error=TimeoutError(
                        f"{job.kind} of request {job.request_id} waited past its deadline "
                        f"in the transfer queue"))
                    continue
                job.state, self._running = RUNNING, job
            try:
                result, error, state = job.run(), None, DONE
            except Exception as failure:  # reported to the engine by the adapter
                log.warning("tract: %s of request %s failed: %s", job.kind, job.request_id,
                            failure, exc_info=True)
                result, error, state = None, failure, FAILED
            with self._cond:
                self._running = None
                self._end(job, state, result, error)
