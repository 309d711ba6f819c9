"""The plan executor: a dispatch mode that carries out a plan while the script trains.

Before op k of a followed iteration it (1) finishes what the engine completed
(freeing storages whose bytes are safely written), (2) starts the transfers
the plan triggers at k, (3) waits for offloads whose memory must be free by k,
and (4) makes every input of op k resident, faulting in on demand whatever
is not, plan or no plan. A prefetch or an op that would take the tracked
bytes over the plan's budget first waits for offloads in flight to make room,
as the planner's simulator does (NOTE [ Room ]). Waits are stalls, counted and
timed. Iteration 0 has a plan of its own (it runs the script's set-up ops, and
the optimizer makes its state in it): NOTE [ Following the first iteration ].
"""

from __future__ import annotations

import itertools
import threading
import time
import warnings
import weakref
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

import torch

from runtime.backends import Backend, BackendFull
from runtime.engine import Job, MigrationEngine
from runtime.errors import PlanMismatchError, StorageIOError
from runtime.memory import peak_rss_since_reset, reset_peak_rss, trim
from runtime.storage import byte_view, free_storage, realloc_storage
from torch_patch.identity import PRODUCED_BASE
from torch_patch.opstream import OpInfo, OpStream

__all__ = ["FirstPlan", "Move", "PlanExecutor", "Residency"]


class Residency(Enum):
    DEVICE = "device"
    OFFLOADING = "offloading"
    SSD = "ssd"
    HOST = "host"
    FETCHING = "fetching"


@dataclass(frozen=True)
class Move:
    """One planned transfer, as the executor needs it."""

    tensor_id: int
    action: str  # "offload" | "prefetch"
    target: str  # "ssd" | "host": where the bytes go to or come from
    trigger_op: int
    deadline_op: int
    size_bytes: int
    urgent: bool = False
    out_at_boundary: bool = False  # an offload whose period spans the iteration boundary
    name: str | None = None  # a named tensor's name (parameter, gradient, optimizer state)


@dataclass(frozen=True)
class FirstPlan:
    """Iteration 0's plan (NOTE [ The first iteration's plan ] in ``planner.plan``)."""

    moves: list[Move]
    op_names: list[str]
    budget_bytes: int | None
    carried: dict[int, int]  # steady plan id -> id in iteration 1 of a storage made in iteration 0


@dataclass(frozen=True)
class _Schedule:
    """One iteration's plan, looked up op by op."""

    triggers: dict[int, list[Move]]  # trigger op -> moves; offloads first (NOTE [ Room ])
    deadlines: dict[int, list[int]]  # op -> tensor ids whose offloads must be done before it
    op_names: list[str] | None
    budget_bytes: int | None

    @classmethod
    def of(cls, moves: list[Move], op_names: list[str] | None, budget_bytes: int | None) -> _Schedule:
        triggers: dict[int, list[Move]] = defaultdict(list)
        deadlines: dict[int, list[int]] = defaultdict(list)
        # At one op, offloads start before prefetches: a prefetch waits for room only on
        # offloads in flight (NOTE [ Room ]), as the simulator's op does.
        for m in sorted(moves, key=lambda m: m.action != "offload"):
            triggers[m.trigger_op].append(m)
            if m.action == "offload":
                deadlines[m.deadline_op].append(m.tensor_id)
        return cls(dict(triggers), dict(deadlines), op_names, budget_bytes)


@dataclass(eq=False)
class _Entry:
    state: Residency
    nbytes: int
    backend: Backend
    target: str  # "ssd" | "host"
    storage: weakref.ref[torch.UntypedStorage]
    key: int  # the backend's key: fixed, while tensor ids change at boundaries
    job: Job | None = None
    touched: bool = False  # accessed while its offload was in flight: keep it


@dataclass
class RunStats:
    stalls: int = 0
    stall_s: float = 0.0
    on_demand_fetches: int = 0
    cancelled_offloads: int = 0
    failed_writes: int = 0
    bytes_written: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes_read: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    write_busy_s: float = 0.0
    read_busy_s: float = 0.0
    tracked_bytes: int = 0
    peak_tracked_bytes: int = 0  # since the last iteration boundary
    iteration_s: list[float] = field(default_factory=list)
    iteration_peak_bytes: list[int] = field(default_factory=list)
    iteration_stall_s: list[float] = field(default_factory=list)  # stall time of each iteration
    iteration_peak_rss_bytes: list[int] = field(default_factory=list)
    iteration_peak_cuda_bytes: list[int] = field(default_factory=list)  # allocated, CUDA only


# NOTE [ Copy streams ]: a worker's device copies run on a CUDA stream of its own
# thread, not on the default stream the training computes on: there they would
# queue behind every kernel launched so far and hold back every kernel launched
# after them, and no transfer would overlap compute. Ordering with the compute
# stream is kept by hand: the job first waits (on the host) for an event recorded
# when it was submitted, so every kernel that wrote the source, or used the
# freshly reallocated destination's memory before, is done; the job ends with its
# stream synchronized, so the main thread's wait for the job covers the copy.
_worker = threading.local()


def _off_stream(work: Callable[[], None], tensor: torch.Tensor) -> Callable[[], None]:
    """``work`` as a job for a worker thread; see NOTE [ Copy streams ]."""
    if not tensor.is_cuda:
        return work
    event = torch.cuda.Event()
    event.record()
    device = tensor.device

    def run() -> None:
        event.synchronize()
        streams = _worker.__dict__.setdefault("streams", {})
        stream = streams.get(device)
        if stream is None:
            stream = streams[device] = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            work()
        stream.synchronize()

    return run


class PlanExecutor(OpStream):
    def __init__(self, moves: list[Move], op_names: list[str] | None,
                 backends: dict[str, Backend], engine: MigrationEngine,
                 follow_from: int = 1, budget_bytes: int | None = None,
                 first: FirstPlan | None = None) -> None:
        super().__init__()
        self.moves = moves
        self.steady = _Schedule.of(moves, op_names, budget_bytes)
        self.first = first if follow_from == 1 else None  # NOTE [ Following the first iteration ]
        self.schedule = self.steady if self.first is None else _Schedule.of(
            self.first.moves, self.first.op_names, self.first.budget_bytes)
        self.first_left_at: str | None = None  # where iteration 0 stopped following its plan
        self.carried_out = [m for m in moves if m.out_at_boundary]
        self.backends = backends
        self.engine = engine
        self.follow_from = follow_from
        self._writes: deque[_Entry] = deque()  # offloads in flight, oldest first
        # bytes each op made, this followed iteration and the one before (NOTE [ Room ])
        self._made: list[int] = []
        self._made_before: list[int] = []
        self.moved: dict[int, _Entry] = {}
        self.sizes: dict[int, int] = {}
        self.stats = RunStats()
        self.diverged: str | None = None
        self.divergence_reported = False
        self.matched_iterations = 0
        self._warned: set[str] = set()
        self._keys = itertools.count()
        self._iter_t0 = time.perf_counter()
        self._iter_stall_s0 = 0.0  # stats.stall_s when this iteration began
        # transient id -> the id its storage got at the last boundary (NOTE [ Plan ids ])
        self._renamed_at_boundary: dict[int, int] = {}

    @property
    def following(self) -> bool:
        """Whether this iteration follows a plan: the steady one, or iteration 0's."""
        if self.diverged is not None:
            return False
        if self.iteration == 0:
            return self.first is not None and self.first_left_at is None
        return self.iteration >= self.follow_from

    @property
    def steady_following(self) -> bool:
        return self.following and self.iteration >= self.follow_from

    # ---- per op ----------------------------------------------------------------
    def run_op(self, index: int, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
               inputs: list[tuple[int, torch.Tensor, bool]]) -> Any:
        if self.engine.completed:
            self._drain()
        if self.following:
            self._check_op(index, str(func))
        if self.following:
            schedule = self.schedule
            for m in schedule.triggers.get(index, ()):
                self._start(m)
            for tid in schedule.deadlines.get(index, ()):
                _, entry = self._moved_entry(tid)
                if entry is not None and entry.state is Residency.OFFLOADING:
                    self._wait(entry)
            if index < len(self._made_before) and self._made_before[index] > 0:
                self._make_room(self._made_before[index])
        if self.moved:
            for tid, _, _ in inputs:
                entry = self.moved.get(tid)
                if entry is not None:
                    self._make_resident(tid, entry)
        return func(*args, **kwargs)

    def after_op(self, index: int, info: OpInfo, inputs: list[tuple[int, torch.Tensor, bool]],
                 outputs: list[tuple[int, torch.Tensor, bool]]) -> None:
        stats = self.stats
        sizes = self.sizes
        before = stats.tracked_bytes
        for tid, t, new in outputs:
            if new:
                n = t.untyped_storage().nbytes()
                sizes[tid] = n
                stats.tracked_bytes += n
        for tid, t, _ in inputs:
            if tid not in sizes:  # made outside any op, or before teraio started
                n = t.untyped_storage().nbytes()
                sizes[tid] = n
                stats.tracked_bytes += n
        if self.steady_following:
            self._made.append(stats.tracked_bytes - before)
        if stats.tracked_bytes > stats.peak_tracked_bytes:
            stats.peak_tracked_bytes = stats.tracked_bytes

    def on_free(self, tensor_id: int) -> None:
        entry = self.moved.pop(tensor_id, None)
        n = self.sizes.pop(tensor_id, 0)
        if entry is not None and entry.state in (Residency.SSD, Residency.HOST):
            n = 0  # its bytes were not counted while offloaded
        self.stats.tracked_bytes -= n
        if entry is not None:
            if entry.job is not None:
                entry.job.done.wait()
                self._count(entry.job)  # done, but the drain will no longer find it
            entry.backend.delete(entry.key)

    # NOTE [ Following the first iteration ]: iteration 0 runs the script's set-up ops,
    # and the optimizer makes its state in it: it is no steady iteration, and the plan
    # has a plan of its own for it (NOTE [ The first iteration's plan ] in planner.plan),
    # whose ids are iteration 0's. The executor follows it as it follows the steady plan,
    # op by op, with its own budget, from the first op it sees (``teraio run`` starts
    # with the script; under ``offload()`` entered later the ops differ at once). Where
    # an op, a count of ops or a size differs, it stops following it, warns once and
    # finishes iteration 0 on demand: that is no divergence of the steady plan. At the
    # boundary the steady plan takes over (``begin_iteration``): what it has out across
    # the boundary goes out, what iteration 0 left out that it has in comes back.

    # ---- plan checks -------------------------------------------------------------
    def _check_op(self, index: int, name: str) -> None:
        names = self.schedule.op_names
        if names is None:
            return
        if index >= len(names) or names[index] != name:
            expected = names[index] if index < len(names) else "the end of the iteration"
            self._diverge(f"iteration {self.iteration}, op {index}: ran {name}, "
                          f"the plan expects {expected}")

    def _diverge(self, where: str) -> None:
        """Stop following the plan. The first followed iteration must match: a plan made
        for another profile is refused. Later, the warning waits for the next iteration
        boundary, so that code after the training loop is not reported as a divergence.
        In iteration 0, stop following its plan only (NOTE [ Following the first iteration ])."""
        if self.iteration == 0:
            self.first_left_at = where
            hint = (" (its plan starts at the script's first op, as `teraio profile` and "
                    "`teraio run` see it; entered later, it cannot be followed)"
                    if self.op_index <= 1 else "")
            self._warn_once("first", f"iteration 0 left its plan at {where}{hint}; it goes on "
                            "on demand, and may need more memory than the plan's budget")
            return
        self.restore_all()
        self.diverged = where
        if self.matched_iterations == 0:
            raise PlanMismatchError(
                f"the plan was made for another profile: {where}. Profile this script with "
                f"these arguments (`teraio profile`) and plan again")

    # ---- transfers ---------------------------------------------------------------
    # NOTE [ Plan ids ]: a plan names a transient storage by the id the iteration that
    # made it gave it. A period that spans the boundary has events after it (a prefetch,
    # an offload's deadline, an offload triggered at op 0), when the storage has been
    # renamed (a carried flag, or a gradient's persistent number): those look up the
    # plan id first, then the id it was renamed to at the last boundary.
    def _moved_entry(self, tid: int) -> tuple[int, _Entry | None]:
        """The runtime id and moved entry of plan id ``tid``."""
        entry = self.moved.get(tid)
        if entry is None and tid in self._renamed_at_boundary:
            tid = self._renamed_at_boundary[tid]
            entry = self.moved.get(tid)
        return tid, entry

    def _start(self, m: Move) -> None:
        tid = m.tensor_id
        if m.action == "offload":
            storage = self.ids.storage(tid)
            if storage is None and tid in self._renamed_at_boundary:
                tid = self._renamed_at_boundary[tid]
                storage = self.ids.storage(tid)
            if storage is None or tid in self.moved:
                return
            n = storage.nbytes()
            if n != m.size_bytes:
                self._diverge(f"iteration {self.iteration}, op {m.trigger_op}: tensor "
                              f"{tid} has {n} bytes, the plan expects {m.size_bytes}")
                return
            self._offload(tid, storage, "host" if m.target == "host" else "ssd", m.urgent)
            return
        tid, entry = self._moved_entry(tid)
        if entry is None:
            return
        if entry.state is Residency.OFFLOADING:
            entry.touched = True
        elif entry.state in (Residency.SSD, Residency.HOST):
            self._fetch(tid, entry, m.urgent)

    def _offload(self, tid: int, storage: torch.UntypedStorage, target: str,
                 urgent: bool) -> None:
        backend = self.backends[target]
        key = next(self._keys)
        src = byte_view(storage)

        def work() -> None:
            backend.write(key, src)

        job = self.engine.submit(Job(tid, "write", storage.nbytes(), _off_stream(work, src), urgent,
                                     target))
        entry = _Entry(Residency.OFFLOADING, storage.nbytes(), backend, target, weakref.ref(storage),
                       key, job)
        self.moved[tid] = entry
        writes = self._writes
        while writes and writes[0].state is not Residency.OFFLOADING:
            writes.popleft()  # done: keeps the queue as short as what is in flight
        writes.append(entry)

    def _fetch(self, tid: int, entry: _Entry, urgent: bool) -> None:
        storage = entry.storage()
        if storage is None:
            return
        if self.following:
            self._make_room(entry.nbytes)
        realloc_storage(storage, entry.nbytes)
        self.stats.tracked_bytes += entry.nbytes
        self.stats.peak_tracked_bytes = max(self.stats.peak_tracked_bytes, self.stats.tracked_bytes)
        dst = byte_view(storage)
        backend, key = entry.backend, entry.key

        def work() -> None:
            backend.read(key, dst)

        entry.job = self.engine.submit(Job(tid, "read", entry.nbytes, _off_stream(work, dst), urgent,
                                           entry.target))
        entry.state = Residency.FETCHING

    def _wait(self, entry: _Entry) -> None:
        job = entry.job
        if job is None:
            return
        if not job.done.is_set():
            self.engine.promote(job)
            t0 = time.perf_counter()
            job.done.wait()
            self.stats.stalls += 1
            self.stats.stall_s += time.perf_counter() - t0
        self._drain()

    # NOTE [ Room ]: the plan counts a tensor's memory free only once its offload is done,
    # and the runtime's transfers may be slower than the plan's, so, as in the simulator,
    # memory that would go over the budget waits for offloads in flight: a prefetch before
    # it allocates, an op before it runs (for the bytes the same op made an iteration ago).
    def _make_room(self, nbytes: int) -> None:
        """Wait for offloads in flight, oldest first, until ``nbytes`` more fit the budget
        or none is left (NOTE [ Room ])."""
        budget, writes = self.schedule.budget_bytes, self._writes
        if budget is None:
            return
        while writes and self.stats.tracked_bytes + nbytes > budget:
            entry = writes.popleft()
            if entry.state is Residency.OFFLOADING:
                self._wait(entry)

    def _make_resident(self, tid: int, entry: _Entry) -> None:
        if entry.state is Residency.OFFLOADING:
            entry.touched = True  # still resident; keep it when the write finishes
            return
        if entry.state in (Residency.SSD, Residency.HOST):
            self.stats.on_demand_fetches += 1
            self._fetch(tid, entry, urgent=True)
        self._wait(entry)

    def _drain(self) -> None:
        """Apply the state changes of every finished job (main thread only)."""
        completed = self.engine.completed
        while completed:
            job = completed.popleft()
            job.release()  # NOTE [ Releasing jobs ] in runtime.engine
            entry = self.moved.get(job.tensor_id)
            if entry is None or entry.job is not job:
                continue
            entry.job = None
            if job.direction == "write":
                self._finish_write(job, entry)
            else:
                self._finish_read(job, entry)

    def _count(self, job: Job) -> None:
        """Bytes and busy time of a job that moved its bytes."""
        if job.error is not None:
            return
        if job.direction == "write":
            self.stats.bytes_written[job.target] += job.nbytes
            self.stats.write_busy_s += job.busy_s
        else:
            self.stats.bytes_read[job.target] += job.nbytes
            self.stats.read_busy_s += job.busy_s

    def _finish_write(self, job: Job, entry: _Entry) -> None:
        tid = job.tensor_id
        storage = entry.storage()
        if job.error is not None:
            self.stats.failed_writes += 1
            self._warn_once(f"write-{job.target}",
                            f"could not write tensor {tid} to {job.target} ({job.error}); "
                            "keeping such tensors in memory")
            entry.backend.delete(entry.key)
            del self.moved[tid]
            if (isinstance(job.error, BackendFull) and job.target != "host"
                    and "host" in self.backends and storage is not None and not entry.touched):
                self._offload(tid, storage, "host", urgent=False)
            return
        self._count(job)
        if entry.touched or storage is None:
            self.stats.cancelled_offloads += entry.touched
            entry.backend.delete(entry.key)
            del self.moved[tid]
            return
        free_storage(storage)
        self.stats.tracked_bytes -= entry.nbytes
        entry.state = Residency.HOST if job.target == "host" else Residency.SSD

    def _finish_read(self, job: Job, entry: _Entry) -> None:
        tid = job.tensor_id
        if job.error is not None:
            where = entry.backend.where(entry.key)
            raise StorageIOError(tid, where, str(job.error))
        self._count(job)
        entry.backend.delete(entry.key)
        del self.moved[tid]

    def restore_all(self) -> None:
        """Bring every offloaded tensor back and wait for all transfers."""
        for tid, entry in list(self.moved.items()):
            if tid not in self.moved:
                continue
            if entry.state is Residency.OFFLOADING:
                entry.touched = True
            self._make_resident(tid, entry)
        while self.moved:
            entry = next(iter(self.moved.values()))
            if entry.job is not None:
                entry.job.done.wait()
            self._drain()

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"teraio: {message}", RuntimeWarning, stacklevel=3)

    # ---- iterations ----------------------------------------------------------------
    def renamed(self, new_ids: dict[int, int]) -> None:
        # Persistent storages get their names at a boundary and carried ones a flag
        # (torch_patch.identity): what is keyed by tensor id follows its storage.
        self._renamed_at_boundary = {old: new for old, new in new_ids.items() if old >= PRODUCED_BASE}
        self.sizes = {new_ids.get(t, t): n for t, n in self.sizes.items()}
        self.moved = {new_ids.get(t, t): e for t, e in self.moved.items()}
        for entry in self.moved.values():
            if entry.job is not None:
                entry.job.tensor_id = new_ids.get(entry.job.tensor_id, entry.job.tensor_id)

    def begin_iteration(self) -> None:
        if self.iteration == 1:
            self.schedule = self.steady
            self._renamed_at_boundary = self._ids_after_first()
        # The iteration before the first followed one (iteration 0 under its own plan, or
        # one not followed) may have kept resident what the steady plan has out across the
        # boundary: send it out now and wait (one stall), so that the first followed
        # iteration starts with the memory the plan expects; and what it left out that the
        # plan has in comes back (it is needed soon, and the plan counts it resident).
        if self.iteration == self.follow_from and self.diverged is None:
            out = self._carried_out_now()
            for m in out:
                self._start(m)
            for m in out:
                entry = self.moved.get(m.tensor_id)
                if entry is not None and entry.state is Residency.OFFLOADING:
                    self._wait(entry)
            kept_out = {m.tensor_id for m in out}
            for tid, entry in list(self.moved.items()):
                if tid in kept_out:
                    continue
                if entry.state is Residency.OFFLOADING:
                    entry.touched = True  # kept resident when its write is done
                elif entry.state in (Residency.SSD, Residency.HOST):
                    self._fetch(tid, entry, urgent=False)
        self.stats.peak_tracked_bytes = self.stats.tracked_bytes  # the new iteration's peak

    def _ids_after_first(self) -> dict[int, int]:
        """At the boundary after iteration 0: steady plan id -> id now of the plan's transient
        storages that iteration 0 made and left alive (NOTE [ Plan ids ]). Iteration 0's own
        ids mean nothing to the steady plan: a gradient is found by its name, another
        storage by the map iteration 0's plan carries (``FirstPlan.carried``), whose ids
        are those of the profiled iteration 0, so only if this one followed it to the end."""
        by_name = {name: tid for tid, (name, _) in self.persistent.items()}
        followed = self.first is not None and self.first_left_at is None
        ids = dict(self.first.carried) if followed and self.first is not None else {}
        for m in self.moves:
            if m.tensor_id >= PRODUCED_BASE and m.name in by_name:
                ids[m.tensor_id] = by_name[m.name]
        return ids

    def _carried_out_now(self) -> list[Move]:
        """The plan's offloads out across the boundary, with the ids their storages have
        now (persistent ids are stable; transient ones as NOTE [ Plan ids ] says). One whose
        storage is not found, or not of the planned size, is left where it is (it is out
        once it dies)."""
        out = []
        for m in self.carried_out:
            tid = m.tensor_id if m.tensor_id < PRODUCED_BASE else self._renamed_at_boundary.get(m.tensor_id, -1)
            storage = self.ids.storage(tid) if tid >= 0 else None
            if storage is None or (tid not in self.moved and storage.nbytes() != m.size_bytes):
                self._renamed_at_boundary.pop(m.tensor_id, None)
                continue
            out.append(replace(m, tensor_id=tid, urgent=True))
        return out

    def end_iteration(self) -> None:
        if self.steady_following:
            self._made_before, self._made = self._made, []
        if self.diverged is not None and not self.divergence_reported:
            self.divergence_reported = True
            warnings.warn(f"teraio: the op stream left the plan at {self.diverged}; restored "
                          "every offloaded tensor, continuing on demand", RuntimeWarning,
                          stacklevel=2)
        now = time.perf_counter()
        self.stats.iteration_s.append(now - self._iter_t0)
        self.stats.iteration_peak_bytes.append(self.stats.peak_tracked_bytes)
        self.stats.iteration_stall_s.append(self.stats.stall_s - self._iter_stall_s0)
        self._iter_stall_s0 = self.stats.stall_s
        self._iter_t0 = now
        rss = peak_rss_since_reset()
        if rss is not None:
            self.stats.iteration_peak_rss_bytes.append(rss)
        if torch.cuda.is_initialized():
            self.stats.iteration_peak_cuda_bytes.append(torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
        names = self.schedule.op_names
        if self.following and names is not None:
            if self.op_index != len(names):
                self._diverge(f"iteration {self.iteration}: {self.op_index} ops, the plan "
                              f"expects {len(names)}")
            elif self.iteration > 0:
                self.matched_iterations += 1
        trim()  # see NOTE [ malloc on CPU ]: without it the heap only grows
        reset_peak_rss()

    def __exit__(self, *exc: Any) -> None:
        try:
            self._drain()
            self.restore_all()
        finally:
            super().__exit__(*exc)
