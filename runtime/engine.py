"""The migration engine: per-direction queues served urgent-first by worker threads.

The main thread submits jobs; a job only moves bytes between a storage that
the main thread keeps alive and unchanged (NOTE [ Freeing in place ] in
``runtime.storage``) and a backend. Finished jobs land on ``completed``, which
the main thread drains before each op: every state change of a tensor happens
on the main thread.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Job", "MigrationEngine"]


def _done() -> None:
    """The ``work`` of a job that has run."""


@dataclass(eq=False)
class Job:
    """One transfer. ``work`` runs on a worker; ``error`` is set if it raised."""

    tensor_id: int
    direction: str  # "write" | "read"
    nbytes: int
    work: Callable[[], None]
    urgent: bool = False
    target: str = ""
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    queued_s: float = field(default_factory=time.perf_counter)
    busy_s: float = 0.0
    taken: bool = False
    cancelled: bool = False  # dropped before a worker took it: it moved nothing

    # NOTE [ Releasing jobs ]: ``work`` holds a view of the storage the job moves, and a
    # failed job's traceback the frames that hold it: either keeps the storage alive
    # after the script drops the tensor (a stale queue entry of a promoted job, or a
    # worker's local, can outlive the job by a long time). The main thread releases a
    # job once it has taken its result. Not a worker: the storage may then die on the
    # worker's thread, and its on-free hook runs there (and waits for this very job).
    def release(self) -> None:
        """Drop the job's hold on the storage it moved; main thread, once done."""
        self.work = _done
        if self.error is not None:
            self.error = self.error.with_traceback(None)


class MigrationEngine:
    """``num_workers`` threads per direction; urgent jobs jump each queue."""

    def __init__(self, num_workers: int = 2) -> None:
        self.completed: deque[Job] = deque()
        self._seq = itertools.count()
        self._queues: dict[str, queue.PriorityQueue[tuple[int, int, Job | None]]] = {
            "write": queue.PriorityQueue(), "read": queue.PriorityQueue()}
        self._threads = [
            threading.Thread(target=self._serve, args=(q,), daemon=True, name=f"teraio-{d}-{i}")
            for d, q in self._queues.items() for i in range(num_workers)
        ]
        self._take = threading.Lock()
        self.bytes_moved = {"write": 0, "read": 0}
        self.busy_s = {"write": 0.0, "read": 0.0}
        for t in self._threads:
            t.start()

    def submit(self, job: Job) -> Job:
        self._queues[job.direction].put((0 if job.urgent else 1, next(self._seq), job))
        return job

    def promote(self, job: Job) -> None:
        """Serve an already queued job before everything that is not urgent."""
        if not job.urgent and not job.done.is_set():
            job.urgent = True
            self._queues[job.direction].put((0, next(self._seq), job))

    def cancel(self, job: Job) -> bool:
        """Drop ``job`` if no worker has taken it: it is then done, ``cancelled``, and moved
        nothing. False if a worker has it (it runs to its end) or it is done."""
        with self._take:
            if job.taken:
                return False
            job.cancelled = True  # first: a Ctrl-C between the two still leaves it known as cancelled
            job.taken = True
        self.completed.append(job)
        job.done.set()
        return True

    def _serve(self, q: queue.PriorityQueue[tuple[int, int, Job | None]]) -> None:
        while True:
            _, _, job = q.get()
            if job is None:
                return
            with self._take:
                taken, job.taken = job.taken, True
            if not taken:  # else the other queue entry of a promoted job
                self._run(job)

    def _run(self, job: Job) -> None:
        t0 = time.perf_counter()
        try:
            job.work()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            job.error = exc
        job.busy_s = time.perf_counter() - t0
        if job.error is None:
            self.bytes_moved[job.direction] += job.nbytes
            self.busy_s[job.direction] += job.busy_s
        self.completed.append(job)
        job.done.set()

    def close(self) -> None:
        for q in self._queues.values():
            for _ in range(len(self._threads)):
                q.put((2, next(self._seq), None))
        for t in self._threads:
            t.join(timeout=30)

    def stats(self) -> dict[str, Any]:
        return {"bytes": dict(self.bytes_moved), "busy_s": dict(self.busy_s)}
