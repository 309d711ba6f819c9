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
