"""The migration engine: urgent jobs first, and no hold on a moved storage once done."""

from __future__ import annotations

import threading
import weakref

import torch

from runtime.engine import Job, MigrationEngine


def test_a_finished_job_does_not_keep_its_storage_alive() -> None:
    """NOTE [ Releasing jobs ]: a worker waiting for its next job still has the last one;
    once released, that job must not hold the storage the script has dropped."""
    engine = MigrationEngine(num_workers=1)
    try:
        t = torch.ones(1 << 16)
        storage = weakref.ref(t.untyped_storage())  # PyTorch keeps it while the storage lives
        job = engine.submit(Job(0, "write", t.nbytes, lambda view=t[:16]: view.sum().item()))
        assert job.done.wait(30) and job.error is None
        engine.completed.popleft().release()
        del job, t
        assert storage() is None
    finally:
        engine.close()


def test_urgent_jobs_go_first() -> None:
    engine = MigrationEngine(num_workers=1)
    try:
        gate, order = threading.Event(), []
        engine.submit(Job(0, "read", 0, lambda: gate.wait(30)))  # holds the only read worker
        jobs = [engine.submit(Job(i, "read", 0, lambda i=i: order.append(i), urgent=i == 3))
                for i in (1, 2, 3)]
        engine.promote(jobs[1])
        gate.set()
        assert all(j.done.wait(30) for j in jobs)
        assert order == [3, 2, 1]
    finally:
        engine.close()


def test_a_job_no_worker_took_is_cancelled_and_a_running_one_is_not() -> None:
    """NOTE [ Writes of a tensor needed again ] in runtime.executor: a write whose tensor is
    needed again before a worker takes it is dropped, done at once, having moved nothing."""
    engine = MigrationEngine(num_workers=1)
    try:
        gate, started, ran = threading.Event(), threading.Event(), []
        running = engine.submit(Job(0, "write", 8, lambda: (started.set(), gate.wait(30))))
        queued = engine.submit(Job(1, "write", 8, lambda: ran.append(1)))
        assert started.wait(30)
        assert not engine.cancel(running)  # a worker has it: it runs to its end
        assert engine.cancel(queued) and queued.done.is_set() and queued.cancelled
        assert not engine.cancel(queued)  # once
        gate.set()
        assert running.done.wait(30) and not running.cancelled
        later = engine.submit(Job(2, "write", 8, lambda: ran.append(2)))
        assert later.done.wait(30)
        assert ran == [2]  # the cancelled job's work never ran; its queue entry was skipped
        assert engine.bytes_moved["write"] == 16 and list(engine.completed) == [queued, running, later]
    finally:
        engine.close()
