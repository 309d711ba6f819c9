"""The migration engine: per-direction queues, urgent first then by the plan's priority, and their workers.

The main thread submits jobs; a job only moves bytes between a storage that
the main thread keeps alive and unchanged (NOTE [ Freeing in place ] in
``runtime.storage``) and a backend. Finished jobs land on ``completed``, which
the main thread drains before each op: every state change of a tensor happens
on the main thread.

NOTE [ Ctrl-C and the engine ]: a Ctrl-C raises KeyboardInterrupt in the main
thread wherever CPython runs signal handlers: as a Python function starts, at a
loop's jump back and after a call, in the standard library's code too.
``threading.Condition`` (under ``queue.Queue``, ``threading.Event`` and
``Semaphore``) takes and gives back its lock in Python functions, so an
interrupt that lands in one leaves the lock held for good, and the next call on
it blocks forever. That hung `teraio run` at exit after a Ctrl-C (the exit
queues reads to bring every tensor back): once in a full test run, once in 18
tries on a loaded machine. So what the main thread calls here uses only
primitives written in C, each of whose calls happens whole or not at all:
``threading.Lock`` and ``RLock`` in ``with`` blocks, ``queue.SimpleQueue`` and ``heapq`` on
lists. An interrupt between two of our own steps can lose a wake-up, never a
job: ``wait`` wakes a worker again before it waits, and a worker that wakes
takes every job queued.
"""

from __future__ import annotations

import heapq
import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Done", "Job", "MigrationEngine"]


def _may_start(job: Job) -> bool:
    """Whether ``job``'s ``after`` has happened (engine's lock held): asked once more each time a
    worker looks, never again once it has (it is then dropped)."""
    if job.after is not None:
        try:
            if not job.after.query():
                return False
        except BaseException:  # noqa: BLE001, S110 - the job's work meets the error and hands it on
            pass
        job.after = None
    return True


def _synchronize(after: Any) -> None:
    try:
        after.synchronize()
    except BaseException:  # noqa: BLE001, S110 - the job's work meets the error and hands it on
        pass


def _done() -> None:
    """The ``work`` of a job that has run."""


class Done:
    """Whether a job has ended: ``threading.Event``'s ``set``, ``is_set`` and ``wait``, safe
    to interrupt (NOTE [ Ctrl-C and the engine ]). The flag is set before the wake-up is
    sent, so a wait that an interrupt robs of its wake-up still finds the flag. A waiter
    that takes the one wake-up puts it back, so every waiter wakes."""

    __slots__ = ("_set", "_wake")

    def __init__(self) -> None:
        self._set = False
        self._wake: queue.SimpleQueue[None] = queue.SimpleQueue()

    def set(self) -> None:
        self._set = True
        self._wake.put(None)

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        if not self._set:
            try:
                self._wake.get(timeout=timeout)
            except queue.Empty:
                pass
            else:
                self._wake.put(None)  # for the next waiter
        return self._set


@dataclass(eq=False)
class Job:
    """One transfer. ``work`` runs on a worker once ``after`` has happened (NOTE [ Jobs that wait
    for the compute ]); ``error`` is set if it raised."""

    tensor_id: int
    direction: str  # "write" | "read"
    nbytes: int
    work: Callable[[], None]
    urgent: bool = False
    target: str = ""
    priority: int = 0  # the plan's: lower first within urgent and within the rest, then FIFO
    error: BaseException | None = None
    done: Done = field(default_factory=Done)
    queued_s: float = field(default_factory=time.perf_counter)
    busy_s: float = 0.0
    taken: bool = False
    cancelled: bool = False  # dropped before a worker took it: it moved nothing
    # what must have happened before the job starts, with ``query()`` (whether it has, at once) and
    # ``synchronize()`` (wait for it): a CUDA event recorded as the job was submitted; None: nothing
    after: Any = None
    # NOTE [ Copies ordered on streams ]: the CUDA device of a job whose ``work`` only launches
    # its copy on the current stream; None: a job a worker runs to its end
    device: Any = None
    ended: Any = None  # a stream job's CUDA event after its copy, once launched
    started: Any = None
    slot: int = 0

    # NOTE [ Releasing jobs ]: ``work`` holds a view of the storage the job moves, and a
    # failed job's traceback the frames that hold it: either keeps the storage alive
    # after the script drops the tensor (a stale queue entry of a promoted job, or a
    # worker's local, can outlive the job by a long time). The main thread releases a
    # job once it has taken its result. Not a worker: the storage may then die on the
    # worker's thread, and its on-free hook runs there (and waits for this very job).
    def release(self) -> None:
        """Drop the job's hold on the storage it moved; main thread, once done."""
        self.work = _done
        self.after = None
        if self.error is not None:
            self.error = self.error.with_traceback(None)


class MigrationEngine:
    """``num_workers`` threads per direction; urgent jobs jump each queue."""

    def __init__(self, num_workers: int = 2) -> None:
        self.completed: deque[Job] = deque()
        self._seq = itertools.count()
        # the queues, and whether a job is taken; reentrant: a stream job is launched with it held,
        # and a storage that dies meanwhile (a garbage collection) waits for its job (NOTE [ Copies
        # ordered on streams ])
        self._take = threading.RLock()
        # heaps of (0 if urgent else 1, job.priority, order queued, job)
        self._queued: dict[str, list[tuple[int, int, int, Job]]] = {"write": [], "read": []}
        self._wake: dict[str, queue.SimpleQueue[None]] = {d: queue.SimpleQueue() for d in self._queued}
        self._closing = False
        self._threads = [
            threading.Thread(target=self._serve, args=(d,), daemon=True, name=f"teraio-{d}-{i}")
            for d in self._queued for i in range(num_workers)
        ]
        self.bytes_moved = {"write": 0, "read": 0}
        # per direction: the time at least one transfer was moving bytes, and since when
        self.busy_s = {"write": 0.0, "read": 0.0}
        self._moving = {"write": 0, "read": 0}
        self._since = {"write": 0.0, "read": 0.0}
        self._gated = {"write": False, "read": False}  # a worker waits for a job's ``after``
        # NOTE [ Copies ordered on streams ]: jobs not yet launched (heaps as ``_queued``), those
        # launched and not seen to end, the copy streams by (device, direction), and per direction
        # the end (ms after ``_origin``) of the busy time counted so far
        self._held: dict[str, list[tuple[int, int, int, Job]]] = {"write": [], "read": []}
        self._launched: dict[str, list[Job]] = {"write": [], "read": []}
        self._streams: dict[tuple[Any, str], list[Any]] = {}
        self._origin: dict[Any, Any] = {}  # per device: the event the busy times are counted from
        self._busy_until = {"write": 0.0, "read": 0.0}
        self._polled = 0.0
        for t in self._threads:
            t.start()

    def _queue(self, job: Job, urgent: bool) -> None:
        with self._take:
            heapq.heappush(self._queued[job.direction], (0 if urgent else 1, job.priority, next(self._seq), job))
        self._wake[job.direction].put(None)

    def submit(self, job: Job) -> Job:
        if job.device is None:
            self._queue(job, job.urgent)
            return job
        with self._take:
            heapq.heappush(self._held[job.direction], (0 if job.urgent else 1, job.priority, next(self._seq), job))
            self._pump(job.direction)
        return job

    def promote(self, job: Job) -> None:
        """Serve an already queued job before everything that is not urgent."""
        if not job.urgent and not job.done.is_set():
            if job.device is None:
                self._queue(job, True)  # the old entry is skipped once the job is taken
            else:
                with self._take:
                    heapq.heappush(self._held[job.direction], (0, job.priority, next(self._seq), job))
            job.urgent = True

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

    def wait(self, job: Job, timeout: float | None = None) -> bool:
        """Wait for ``job`` to end, for at most ``timeout`` seconds; whether it has. A stream job
        ends once its copy has on the device (``timeout`` not applied)."""
        if job.cancelled:  # it moved nothing; a Ctrl-C in ``cancel`` may have kept it from done
            job.done.set()
        elif job.device is not None:
            with self._take:
                if not job.taken:
                    self._launch(job)
            if job.ended is not None:
                job.ended.synchronize()
            with self._take:
                if job in self._launched[job.direction]:
                    self._launched[job.direction].remove(job)
                    self._account(job)
                    self._pump(job.direction)
            return True
        elif not job.taken:  # a Ctrl-C in ``submit`` may have lost its wake-up
            self._wake[job.direction].put(None)
        return job.done.wait(timeout)

    # NOTE [ Copies ordered on streams ]: by default the host waits for a transfer an op needs:
    # a worker's copy on its stream, then the worker's wait for that stream. The host runs ahead of
    # the GPU, so each such wait lets the GPU run out of the ops queued before it. On the H200
    # (2026-11-27, BENCHMARKS.md) the example at 2k waited 36-103 times an iteration, mostly for
    # reads an op was about to use ("late read", 22-61) and at the smallest budget for writes to
    # make room (50), and ran 6.5-23% slower than its plan predicted, which predicts no stall at
    # 75%. With ``stream_copies`` (`teraio run --stream-copies`), a job that copies between a CUDA
    # tensor and pinned host memory (``device`` set) is launched on a copy stream by the thread that
    # submits it, no worker: its stream first waits for the event recorded at its submission
    # (``after``) on the device, not the host. At most ``STREAM_WINDOW`` are launched per
    # direction, each on a copy stream of its own (from PyTorch's pool, which hands its streams
    # out in turn, so not one no other code uses), the rest held in the queue's order (urgent first,
    # then the plan's priority) and launched as those end; ``poll`` (before each op) sees them
    # end. A thread that needs a job's result for the ops it launches next calls ``order``: the job
    # is launched if it was not, its current stream waits for the copy's end, and the job counts
    # as done, so the host goes on launching ops. The executor takes this path only for jobs
    # submitted, and results awaited, on the default stream, whose memory pool takes a freed
    # block back (``_on_stream`` and ``_wait`` in runtime.executor); a tensor the script made on
    # a stream of its own goes back to that stream's pool, which waited for nothing (said in
    # `teraio run --help`). A wait for a stream job on the host (``wait``) ignores its timeout.
    # The backend's ops run with the dispatch modes off: launched from the training thread, they
    # went through teraio's own mode, which polled this engine under the lock the launch held, and
    # the first GPU run hung (a scratch copy that runs this path on the CPU hung the same way in
    # `tests/cli/test_run_cli.py`, and passes with the modes off). Measured on an H200 beside the
    # host's waits (``bench/fidelity.py --gpu --stream-copies``, 2026-11-27): the host's waits went
    # (at 75%, 6 ms an iteration against 138) but not the time (1.01x at 75%, 0.98x at 50%, 0.84x
    # at the smallest budget), so the waits overlapped GPU work that ran anyway, and this is not
    # the default.
    STREAM_WINDOW = 4

    def _launch(self, job: Job) -> None:
        """Launch stream ``job`` (``_take`` held); one that raises is done with its error."""
        import torch

        if job.taken:  # launched already (a call that came back in under the lock)
            return
        job.taken = True
        d, launched = job.direction, self._launched[job.direction]
        streams = self._streams.setdefault((job.device, d), [])
        used = {j.slot for j in launched}
        job.slot = next(i for i in range(len(streams) + 1) if i not in used)
        try:
            if job.slot == len(streams):
                streams.append(torch.cuda.Stream(job.device))
            stream = streams[job.slot]
            if job.device not in self._origin:
                self._origin[job.device] = origin = torch.cuda.Event(enable_timing=True)
                origin.record(stream)
            if job.after is not None:
                stream.wait_event(job.after)
            job.started, job.ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            job.started.record(stream)
            with torch.cuda.stream(stream):
                job.work()
            job.ended.record(stream)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            # a Ctrl-C, or SIGTERM's SystemExit, is not the job's error: raised, once whatever of
            # the job was launched is done (its blocks may go back)
            interrupted = not isinstance(exc, Exception)
            if interrupted:
                torch.cuda.synchronize(job.device)
            job.error, job.ended = RuntimeError("interrupted") if interrupted else exc, None
            self.completed.append(job)
            job.done.set()
            if interrupted:
                raise
            return
        launched.append(job)

    def _pump(self, direction: str) -> None:
        """Launch held jobs while fewer than the window are in flight (``_take`` held): first, in
        the queue's order, one whose ``after`` has happened, else the one submitted first
        (NOTE [ Jobs that wait for the compute ])."""
        held = self._held[direction]
        while held and len(self._launched[direction]) < self.STREAM_WINDOW:
            entries: list[tuple[int, int, int, Job]] = []
            while held and len(entries) < 8:
                entry = heapq.heappop(held)
                if not entry[3].taken:
                    entries.append(entry)
            if not entries:
                return
            pick = next((e for e in entries if _may_start(e[3])), min(entries, key=lambda e: e[2]))
            for entry in entries:
                if entry is not pick:
                    heapq.heappush(held, entry)
            self._launch(pick[3])

    def order(self, job: Job) -> bool:
        """For a stream job: launch it if it is not, make the current stream wait for its copy,
        and count it done (NOTE [ Copies ordered on streams ]); False for any other job."""
        if job.device is None:
            return False
        import torch

        with self._take:
            if not job.taken:
                self._launch(job)
            if job.ended is not None:
                torch.cuda.current_stream(job.device).wait_event(job.ended)
            if not job.done.is_set():
                self.completed.append(job)
                job.done.set()
        return True

    def poll(self, force: bool = False) -> None:
        """Count the stream jobs whose copies have ended as done, oldest first, and launch held
        ones in their place; at most every 200 us unless ``force`` (an event's query costs about a
        microsecond, and a small model's ops take tens)."""
        if not (self._launched["write"] or self._launched["read"] or self._held["write"] or self._held["read"]):
            return
        now = time.perf_counter()
        if not force and now - self._polled < 200e-6:
            return
        self._polled = now
        with self._take:
            for d, launched in self._launched.items():
                while launched and launched[0].ended.query():
                    self._account(launched.pop(0))
                if self._held[d] and len(launched) >= self.STREAM_WINDOW:  # a later one may have ended
                    for job in [j for j in launched if j.ended.query()]:
                        launched.remove(job)
                        self._account(job)
                self._pump(d)

    def _account(self, job: Job) -> None:
        """A stream job's copy has ended: its bytes and busy time, and done (``_take`` held)."""
        d = job.direction
        origin = self._origin[job.device]
        start, end = origin.elapsed_time(job.started), origin.elapsed_time(job.ended)
        busy = max(0.0, end - max(start, self._busy_until[d]))  # two at once are not twice as busy
        self._busy_until[d] = max(self._busy_until[d], end)
        self.busy_s[d] += busy / 1e3
        job.busy_s = (end - start) / 1e3
        if job.error is None:
            self.bytes_moved[d] += job.nbytes
        if not job.done.is_set():
            self.completed.append(job)
            job.done.set()

    # NOTE [ Jobs that wait for the compute ]: a CUDA job may start only once the GPU has run the
    # kernels launched before it was submitted (NOTE [ Copy streams ] in runtime.executor), and the
    # host runs ahead of the GPU. A worker that took the next job in the queue's order and waited
    # for that would hold up every job behind it whose kernels have run: with prefetches started as
    # early as there is room and served by deadline (NOTE [ Prefetch early, serve by deadline ] in
    # planner.early), the job due first is often submitted last. So a worker takes the first job,
    # in the queue's order, that may start now (as the simulator counts it: a transfer is released
    # at its trigger, and the channel serves those released by priority). Two exceptions:
    # - an urgent job first in the queue is taken as it is, and its worker waits for it: the main
    #   thread waits for it, and a transfer started before it could start would delay it;
    # - where no job may start, one worker of the direction waits for the job submitted first (on
    #   one stream the compute reaches it first; a script that launches on several streams may
    #   make it wait longer than it needs, never start a job early), then wakes the others; the
    #   rest wait for the next job queued, so a job that may start is not held up by the wait.
    def _next(self, direction: str) -> tuple[Job | None, Any]:
        """(the job to run next, taken, or None) and, where none may start and no other worker of
        ``direction`` waits, what to wait for before looking again (else None)."""
        with self._take:
            queued = self._queued[direction]
            waiting: list[tuple[int, int, int, Job]] = []
            found = None
            while queued:
                entry = heapq.heappop(queued)
                job = entry[3]
                if job.taken:
                    continue
                if (entry[0] == 0 and not waiting) or _may_start(job):
                    job.taken = True
                    found = job
                    break
                waiting.append(entry)
            for entry in waiting:
                heapq.heappush(queued, entry)
            if found is not None or not waiting or self._gated[direction]:
                return found, None
            self._gated[direction] = True
            return None, min((e[3] for e in waiting), key=lambda j: j.queued_s).after

    def _serve(self, direction: str) -> None:
        wake = self._wake[direction]
        while True:
            wake.get()
            while True:
                job, after = self._next(direction)
                if job is not None:
                    self._run(job)
                    continue
                if after is None:
                    break
                _synchronize(after)
                with self._take:
                    self._gated[direction] = False
                for _ in self._threads:  # the others look again too
                    wake.put(None)
            if self._closing:
                return

    def _run(self, job: Job) -> None:
        d = job.direction
        if job.after is not None:  # an urgent job taken before it could start
            _synchronize(job.after)
        try:
            t0 = self._moved(d, +1)
            try:
                job.work()
            finally:
                job.busy_s = self._moved(d, -1) - t0
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            job.error = exc
        if job.error is None:
            with self._take:  # two workers of a direction may end at once
                self.bytes_moved[d] += job.nbytes
        self.completed.append(job)
        job.done.set()

    def busy_now(self, direction: str) -> float:
        """``busy_s[direction]``, with the time of the transfers running now counted up to now."""
        with self._take:
            running = time.perf_counter() - self._since[direction] if self._moving[direction] else 0.0
            return self.busy_s[direction] + running

    def _moved(self, direction: str, change: int) -> float:
        """A transfer in ``direction`` starts (+1) or ends (-1): the link's busy time is the time
        any one moves (two at once are not twice as busy). Now, in ``time.perf_counter``."""
        with self._take:
            now = time.perf_counter()
            if self._moving[direction] == 0:
                self._since[direction] = now
            self._moving[direction] += change
            if self._moving[direction] == 0:
                self.busy_s[direction] += now - self._since[direction]
        return now

    def close(self) -> None:
        """Run every queued job, then stop the workers."""
        for d in self._held:
            while self._held[d] or self._launched[d]:
                with self._take:
                    self._pump(d)
                    launched = list(self._launched[d])
                for job in launched:
                    self.wait(job)
        self._closing = True
        for wake in self._wake.values():
            for _ in self._threads:  # one wake-up each is enough, a few more do no harm
                wake.put(None)
        for t in self._threads:
            t.join(timeout=30)
