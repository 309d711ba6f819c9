"""The plan executor: a dispatch mode that carries out a plan while the script trains.

Before op k of an iteration that follows its plan it (1) finishes what the
engine completed (freeing storages whose bytes are safely written), (2) starts
the transfers the plan triggers at k, (3) makes every input of op k resident,
faulting in on demand whatever is not, plan or no plan, and (4) waits for
offloads in flight until the bytes op k allocates fit the budget (NOTE [
Room ]). A prefetch likewise makes room before it allocates. Waits are stalls,
counted and timed. Which plan an iteration follows, and what moves at a
boundary, is decided by ``runtime.boundary`` (NOTE [ Boundaries ]); this class
applies it. With ``hold_on_demand``, before an op of an iteration that left its
plan, it sends the least recently used storages out until what the op brings
back fits the budget (NOTE [ On demand within the budget ]).
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import pickle
import signal
import sys
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, cast

import torch
from torch.utils._python_dispatch import _disable_current_modes

from planner.plan import Migration, Plan
from profiles.ids import CARRIED_FLAG, INPUT_BASE, LONG_BASE, PRODUCED_BASE, produced_op
from profiles.ops import UNTOUCHED_MIN_BYTES, leaves_in_flight
from runtime.backends import Backend, BackendFull, HostBackend
from runtime.boundary import Ending, Schedule, at_boundary
from runtime.engine import Job, MigrationEngine
from runtime.errors import PlanMismatchError, StorageIOError
from runtime.memory import peak_rss_since_reset, reset_peak_rss, trim
from runtime.saves import streamed_save
from runtime.storage import byte_view, free_storage, realloc_storage
from torch_patch.identity import STOP_SIGNALS
from torch_patch.opstream import (
    OpInfo,
    OpStream,
    holders,
    tensor_args,
    used_storages,
    written_storages,
)

__all__ = ["PlanExecutor", "Residency", "RunStats", "signals_held"]

# Steady iterations that may leave the plan before one follows it to its end, before the
# plan is refused as made for another profile (NOTE [ Boundaries ] in runtime.boundary).
# Iterations before the first one the profile kept (past `teraio profile --warmup`, and past those
# it set aside) do not count: a script whose first steps differ (a layer unfrozen at step 3) is
# profiled past them.
_REFUSE_AFTER = 2
# A transfer that takes longer than this (plus 1 s per 10 MB) ends the run with an error:
# no wait can last for ever.
_TRANSFER_TIMEOUT_S = 600.0
_WORKS_KEPT = 256  # NOTE [ Collectives a script waits for ]: a work that never completes is let go
_COLLECTIVE_WAIT_S = 0.5  # an iteration's waits, in all: NOTE [ Buffers of collectives in flight ]
_COLLECTIVE_POLL_S = 0.005  # how often such a wait drains the writes done (NOTE [ Releasing jobs ] in runtime.engine)
# Ops that alias their input's storage and read none of its bytes (NOTE [ Streamed saves ])
_ONLY_ALIAS = frozenset({"aten.detach.default", "aten.alias.default"})


class Residency(Enum):
    DEVICE = "device"
    OFFLOADING = "offloading"
    SSD = "ssd"
    HOST = "host"
    FETCHING = "fetching"


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
    keep_copy: bool = False  # a read that leaves the backend's copy (``resident_for``)
    keep_for_reuse: bool = False  # a planned read whose copy waits for the next offload (NOTE [ Copies kept ])


@dataclass
class RunStats:
    stalls: int = 0
    stall_s: float = 0.0
    # from iteration 1 on, what each wait was for: [waits, seconds] by cause (see ``_wait``)
    steady_stalls: dict[str, list[float]] = field(default_factory=dict)
    on_demand_fetches: int = 0
    cancelled_offloads: int = 0
    failed_writes: int = 0
    bytes_written: dict[str, int] = field(default_factory=lambda: {"ssd": 0, "host": 0})
    bytes_read: dict[str, int] = field(default_factory=lambda: {"ssd": 0, "host": 0})
    tracked_bytes: int = 0
    peak_tracked_bytes: int = 0  # since the last iteration boundary
    iteration_s: list[float] = field(default_factory=list)
    iteration_peak_bytes: list[int] = field(default_factory=list)
    iteration_stall_s: list[float] = field(default_factory=list)  # stall time of each iteration
    iteration_on_demand_fetches: list[int] = field(default_factory=list)
    iteration_peak_rss_bytes: list[int] = field(default_factory=list)
    iteration_peak_cuda_bytes: list[int] = field(default_factory=list)  # allocated, CUDA only
    iteration_followed: list[bool] = field(default_factory=list)  # followed its plan to the end
    not_resizable: list[str] = field(default_factory=list)  # planned tensors kept: not freeable
    save_fetches: int = 0  # copies read for a torch.save (NOTE [ Streamed saves ]), or tensors brought back for a
    # legacy one (then freed again) or a read on another thread
    thread_fetches: int = 0  # tensors brought back for a read on another thread (NOTE [ Reads on other threads ])
    held_by_collectives: int = 0  # offloads held back while a collective used the tensor (``_read_elsewhere``)
    other_sizes: int = 0  # planned offloads left out: their storage had another size or name
    iteration_larger_sizes: list[int] = field(default_factory=list)  # per iteration, those of larger storages
    reused_offloads: int = 0  # offloads that wrote nothing: the kept copy was still good
    dropped_copies: int = 0  # kept copies an op wrote over before their offload came
    evictions: int = 0  # tensors sent out in iterations run on demand, to stay within the budget
    # per direction ("write", "read"), per iteration: the bytes the engine moved, and the time it
    # was moving any (NOTE [ Copy streams ]: a CUDA job's wait for the compute left out)
    iteration_moved_bytes: dict[str, list[int]] = field(default_factory=lambda: {"write": [], "read": []})
    iteration_busy_s: dict[str, list[float]] = field(default_factory=lambda: {"write": [], "read": []})


# NOTE [ Copy streams ]: a worker's device copies run on a CUDA stream of its own
# thread, not on the default stream the training computes on: there they would
# queue behind every kernel launched so far and hold back every kernel launched
# after them, and no transfer would overlap compute. Ordering with the compute
# stream is kept by hand: the job starts only once an event recorded when it was
# submitted has passed, so every kernel that wrote the source, or used the
# freshly reallocated destination's memory before, is done (the job's ``after``,
# NOTE [ Jobs that wait for the compute ] in runtime.engine); the job ends with its
# stream synchronized, so the main thread's wait for the job covers the copy.
_worker = threading.local()


def _off_stream(work: Callable[[], None], tensor: torch.Tensor) -> tuple[Any, Callable[[], None]]:
    """``work`` as a job for a worker thread: (the event it waits for, the transfer); see NOTE
    [ Copy streams ]."""
    if not tensor.is_cuda:
        return None, work
    event = torch.cuda.Event()
    event.record()
    device = tensor.device

    def run() -> None:
        event.synchronize()  # at once where the engine saw it happen; raises a CUDA error it hit
        streams = _worker.__dict__.setdefault("streams", {})
        stream = streams.get(device)
        if stream is None:
            stream = streams[device] = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            work()
        stream.synchronize()

    return event, run


def _on_stream(backend: Backend, tensor: torch.Tensor, stream_copies: bool) -> Any:
    """The device of a job that moves ``tensor`` to or from ``backend`` as a copy launched on a
    stream (NOTE [ Copies ordered on streams ] in runtime.engine), or None."""
    if (not stream_copies or not isinstance(backend, HostBackend) or not backend.on_stream(tensor)
            or not _on_default_stream(tensor.device)):
        return None
    return tensor.device


def _on_default_stream(device: torch.device) -> bool:
    return bool(torch.cuda.current_stream(device) == torch.cuda.default_stream(device))


def _copy_job(backend: Backend, direction: str, key: int, tensor: torch.Tensor, stream_copies: bool
              ) -> tuple[Any, Callable[[], None], Any]:
    """The ``Job`` of a copy of ``tensor`` to (``direction`` "write") or from ``backend``'s ``key``:
    (the event it waits for, its work, its device where it is launched on a stream: NOTE [ Copies
    ordered on streams ] in runtime.engine)."""
    device = _on_stream(backend, tensor, stream_copies)
    if device is None:
        op = backend.write if direction == "write" else backend.read
        return (*_off_stream(lambda: op(key, tensor), tensor), None)
    host = cast(HostBackend, backend)
    launch_op = host.write if direction == "write" else host.read

    def launch() -> None:  # by the thread that submits it: the backend's ops are not the script's
        with _disable_current_modes():
            launch_op(key, tensor, non_blocking=True)

    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event, launch, device


_EXECUTORS: weakref.WeakSet[PlanExecutor] = weakref.WeakSet()


def _unlock_in_child() -> None:
    """A forked child (a DataLoader worker) gets each executor's lock as its parent's thread held
    it, for a thread it does not have: a new one instead."""
    for executor in _EXECUTORS:
        executor._lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_unlock_in_child)


def _locked(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` with the executor's records locked (NOTE [ Reads on other threads ])."""

    @functools.wraps(method)
    def locked(self: PlanExecutor, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


def _check_saved_size(nbytes: int, pickled: int) -> None:
    """NOTE [ Streamed saves ] in runtime.saves: a record of another size than its pickled one."""
    if nbytes != pickled:
        raise RuntimeError(f"teraio: torch.save read {nbytes} bytes of a storage it had pickled at {pickled} "
                           "bytes; its file would not load: please report this")


def _storage_of(t: torch.Tensor) -> torch.UntypedStorage | None:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # storage-less tensors (mkldnn)
        return None


def _done(work: Any) -> bool:
    """Whether c10d ``work`` no longer uses its tensors (NOTE [ Collectives a script waits for ]):
    done, or failed (its error is the script's, at its wait)."""
    try:
        return bool(work.is_completed())
    except RuntimeError:
        return True


def _replaceable(tid: int) -> bool:
    """Whether the plan's ``tid`` may name a storage the script made anew (NOTE [ Made anew ]):
    a long-lived id, or a carried one."""
    bare = tid & ~CARRIED_FLAG
    return LONG_BASE <= bare or bool(tid & CARRIED_FLAG) and PRODUCED_BASE <= bare < INPUT_BASE


_aten = torch.ops.aten
_FACTORIES = frozenset({_aten.empty.memory_format, _aten.empty_strided.default, _aten.zeros.default,
                        _aten.ones.default, _aten.full.default})
_NEW_FACTORIES = frozenset({_aten.new_empty.default, _aten.new_empty_strided.default, _aten.new_zeros.default,
                            _aten.new_ones.default, _aten.new_full.default})
_STRIDES_AT = {_aten.empty_strided.default: 1, _aten.new_empty_strided.default: 2}  # the strides' argument


def _factory_bytes(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> int:
    """The bytes factory op ``func`` (``empty``, ``zeros``, ``new_empty``...) allocates on
    ``device``, known from its arguments before it runs; 0 for any other op (NOTE [ On demand
    within the budget ])."""
    if func in _NEW_FACTORIES:
        size, dtype, where = args[1], args[0].dtype, args[0].device
    elif func in _FACTORIES:
        size, dtype, where = args[0], torch.get_default_dtype(), torch.get_default_device()
        if func is _aten.full.default and isinstance(args[1], (bool, int, complex)):  # its fill's type
            dtype = (torch.bool if isinstance(args[1], bool) else torch.int64 if isinstance(args[1], int)
                     else dtype.to_complex())
    else:
        return 0
    dtype, where = kwargs.get("dtype") or dtype, kwargs.get("device") or where
    size = [int(d) for d in size]
    if torch.device(where).type != device or 0 in size:
        return 0
    if func in _STRIDES_AT:  # up to its last element
        return (1 + sum((d - 1) * int(s) for d, s in zip(size, args[_STRIDES_AT[func]], strict=True))) * dtype.itemsize
    return math.prod(size) * dtype.itemsize


def _functional_in_flight(name: str) -> bool:
    """Whether op ``name`` leaves its tensors in flight until a ``wait_tensor`` (a functional
    collective; c10d's ops give a ``Work``, which ``_offload`` checks instead)."""
    return leaves_in_flight(name) and not name.startswith("c10d.")


def _memory_of(storage: torch.UntypedStorage) -> int:
    """The bytes ``storage`` holds: none on the meta device (as the tracer counts it)."""
    return 0 if storage.device.type == "meta" else storage.nbytes()


class PlanExecutor(OpStream):
    """Carries out ``plan``'s migrations of ``rank``; see the module docstring."""

    guards_threads = True  # NOTE [ Ops on other threads ] in torch_patch.opstream

    def __init__(self, plan: Plan, backends: dict[str, Backend], engine: MigrationEngine,
                 rank: int = 0, reuse_copies: bool = True, hold_on_demand: bool = False,
                 stream_copies: bool = False) -> None:
        super().__init__()
        self.plan = plan
        self.rank = rank
        self.reuse_copies = reuse_copies  # False: every offload writes (NOTE [ Copies kept ])
        self.hold_on_demand = hold_on_demand  # NOTE [ On demand within the budget ]
        self.stream_copies = stream_copies  # NOTE [ Copies ordered on streams ] in runtime.engine
        self.steady = Schedule.of(plan, rank)
        first = plan.first
        self.first = Schedule.of(first, rank) if first is not None and rank in first.op_names else None
        self.schedule: Schedule | None = self.first  # what this iteration follows; None: on demand
        self.plan_ids: dict[int, int] = {}  # plan id -> id now (NOTE [ Boundaries ])
        self.backends = backends
        self.engine = engine
        self._writes: deque[_Entry] = deque()  # offloads in flight, oldest first
        # tid -> (target, urgent, priority): out again at the first op that does not use it, and
        # those sent out so in this iteration (NOTE [ Ops on a tensor going out ])
        self._again: dict[int, tuple[str, bool, int]] = {}
        self._sent_again: set[int] = set()
        self.moved: dict[int, _Entry] = {}
        # NOTE [ Copies kept ] in planner.clean: copies of resident storages, still good
        self.copies: dict[int, _Entry] = {}
        self.sizes: dict[int, int] = {}
        self.stats = RunStats()
        self.first_left_at: str | None = None  # where iteration 0 left its plan
        self.left_at: str | None = None  # where this iteration left its plan
        self.unfollowed: list[dict[str, Any]] = []  # steady iterations run on demand, and where
        self.matched_iterations = 0
        self._renamed: dict[int, int] = {}  # the renaming at the last boundary
        self._offloads_started = 0  # in this iteration, NOTE [ Other sizes ]
        self._other_sizes = 0
        self._larger = 0  # of them, storages larger than the plan's
        self._first_other_size: str | None = None
        self._ending = Ending.ON_DEMAND  # how the iteration before went
        self._warned: set[str] = set()
        self._keys = itertools.count()
        self._iter_t0 = time.perf_counter()
        self._iter_stall_s0 = 0.0  # stats.stall_s when this iteration began
        self._iter_fetches0 = 0  # stats.on_demand_fetches then
        self._iter_moved0 = {"write": (0, 0.0), "read": (0, 0.0)}  # the engine's (bytes, busy) then
        # NOTE [ Reads on other threads ]
        self._lock = threading.RLock()  # held while the records change
        _EXECUTORS.add(self)
        self._held: dict[int, int] = {}  # id(storage) -> reads on other threads keeping it in memory
        self._held_back: dict[int, str] = {}  # tid -> where the plan has it: brought back for such a read
        self._saving = 0  # torch.saves running on this thread
        # NOTE [ Streamed saves ]: a parameter pickled by such a save (its ``detach`` only aliases
        # the storage), and the save writing its records (its ops copy nothing of an out storage)
        self._aliasing = 0
        self._writing = False
        self._streams = threading.local()  # NOTE [ Streamed saves ]: per thread, the saves running
        # NOTE [ On demand within the budget ]: the lasting storages the plan moves, when each
        # storage was last used on demand, where they go
        moves = plan.migrations.get(rank, [])
        self._evictable = {m.tensor_id for m in moves
                           if m.tensor_id < PRODUCED_BASE or LONG_BASE <= m.tensor_id < CARRIED_FLAG}
        self._evict_transient = any(m.name is not None for m in moves)  # no writes teraio cannot see
        self._used_at: dict[int, int] = {}
        self._left_over: dict[int, int] = {}  # NOTE [ Left over ]: made on demand
        self._until_waited: dict[int, list[tuple[int, int]]] = {}  # a collective's result -> its left over
        self._let_go: set[int] = set()  # named at the boundary before, no longer (NOTE [ Left over ])
        # NOTE [ Made anew ]: plan id -> id now of its successor; the ops whose accesses find one
        self._made_anew: dict[int, int] = {}
        self._followed_to = 0  # the ops of the steady plan the iteration ran before it left it
        self._left_out: set[int] = set()  # NOTE [ Gradients left out ]: out, the plan has them in
        self._watched = {m.period_start_op % max(1, self.steady.num_ops) for m in moves
                         if m.action == "offload" and _replaceable(m.tensor_id)}
        self._accessed: dict[int, tuple[int, ...]] = {}  # watched op -> the ids it last read or made
        self._plan_tids = frozenset(m.tensor_id for m in moves)
        self._known_now: set[int] | None = None  # the ids the plan's are now (once asked)
        self._out_for_good: set[int] = set()  # sent out as left over or let go, and out since (the same)
        self._clock = 0
        self._busy: set[int] = set()  # used by a collective in this iteration
        self._busy_before: set[int] = set()  # and in the one before (renamed at the boundary)
        self._in_collective: set[int] = set()  # made in an iteration, used by a collective since
        self._held_on: set[int] = set()  # of those, ids waited for in vain (NOTE [ Buffers of collectives in flight ])
        self._freed_elsewhere: set[int] = set()  # and which of all were freed on other threads since the boundary
        self.ids.freed_elsewhere = self._freed_elsewhere
        # NOTE [ Collectives a script waits for ]: c10d's works not known done, and their storages
        # (work, [(a storage it holds, its id then)])
        self._works: list[tuple[Any, list[tuple[weakref.ref[torch.UntypedStorage], int]]]] = []
        self._named: dict[str, int] = {}  # persistent name -> its id in this iteration (NOTE [ Named by position ])
        self._collective_wait_left = _COLLECTIVE_WAIT_S  # in this iteration
        self._spill = "ssd" if "ssd" in backends else "host"
        # the device whose memory the budget holds: a CUDA run's CPU tensors (a pinned batch an
        # asynchronous copy may still read) are not sent out on demand
        self._device = "cuda" if plan.device_type != "cpu" and torch.cuda.is_available() else "cpu"
        self._largest_made = max(self.steady.made_bytes, default=0)  # what an op may allocate

    # ---- per op ----------------------------------------------------------------
    # NOTE [ Forked children ]: a process forked from the training process (a multiprocessing
    # producer that runs the model on batches made before it) inherits the executor as it was: its
    # records, the jobs done and not yet drained, the parent's swap directory, and none of its I/O
    # threads. Following the plan there waited for ever on a job no thread would finish, or,
    # draining the parent's finished writes, deleted swap files the parent then could not read
    # back. So in a forked child the executor does nothing: ops run as they are, frees and
    # boundaries change no record, and an op on a tensor teraio had out of memory at the fork
    # stops the child with an error saying so (its bytes are in files only the parent reads).
    # DataLoader workers never get here: their ops are not counted.
    def run_op(self, index: int, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
               inputs: list[tuple[int, torch.Tensor, bool]]) -> Any:
        if self.forked():
            self._out_in_child([self.ids.storage(tid) for tid, _, _ in inputs], str(func))
            return func(*args, **kwargs)
        if self._held_back and self._works:  # NOTE [ Out before the prefetches ]
            self._await_held_back(index, inputs, moves=True)
        with self._lock:
            self._before_op(index, func, args, kwargs, inputs)
            short = self._short_of_room(index)
        if short:  # without the lock, which the thread that frees may need
            self._await_collectives(short)
        elif self._held_back and self._works:
            self._await_held_back(index, inputs, moves=False)
            if self._again:
                with self._lock:  # what the works held goes out, and the op waits for its room
                    self._send_again(func, inputs)
                    if (schedule := self.schedule) is not None and index < len(schedule.made_bytes):
                        self._make_room(schedule.made_bytes[index])
        out = func(*args, **kwargs)
        work = out[-1] if isinstance(out, tuple) and out else out  # c10d's (..., Work), or a Work (send)
        if isinstance(work, torch.ScriptObject):
            self._track_work(work, inputs)
        return out

    def _before_op(self, index: int, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                   inputs: list[tuple[int, torch.Tensor, bool]]) -> None:
        name = str(func)
        schedule = self.schedule
        if schedule is not None and (index >= schedule.num_ops or schedule.op_names[index] != name):
            expected = schedule.op_names[index] if index < schedule.num_ops else "the end of the iteration"
            self._leave(f"op {index}: ran {name}, the plan expects {expected}", index)
            schedule = None
        if self._writing and schedule is None:  # NOTE [ Streamed saves ]: its copies' ops, on demand:
            return  # nothing freed under them (a write finished), nor brought back
        if self.stream_copies:
            self.engine.poll()
        if self._works:
            self._forget_works(_done)
        if self.engine.completed:
            self._drain()
        if schedule is not None:
            triggers = schedule.triggers.get(index, ())
            if self._again and triggers:  # NOTE [ Out before the prefetches ]
                self._send_again(func, inputs, self._fetched_by(triggers))
            for m in triggers:
                self._start(m)
                if self.schedule is None:  # a size differs: it left the plan
                    break
        if self._again:
            self._send_again(func, inputs)
        if leaves_in_flight(name):
            self._in_collective.update(tid for tid, _, _ in inputs if PRODUCED_BASE <= tid < LONG_BASE)
            if self.hold_on_demand and _functional_in_flight(name):  # NOTE [ On demand within the budget ]
                self._busy.update(tid for tid, _, _ in inputs)
        if (self.hold_on_demand and self.schedule is None and self.iteration > 0
                and self.steady.budget_bytes is not None):
            self._evict_for(inputs, max(self._largest_made, _factory_bytes(func, args, kwargs, self._device)))
        if self.moved and not (self._aliasing and name in _ONLY_ALIAS):  # NOTE [ Streamed saves ]
            for tid, _, _ in inputs:
                entry = self.moved.get(tid)
                if entry is None:
                    continue
                # NOTE [ Ops on a tensor going out ]: not where the iteration left its plan at this op
                if (self.schedule is not None and tid not in self._sent_again and tid not in self._again
                        and tid not in self._left_out and not leaves_in_flight(name)):
                    if entry.state is Residency.OFFLOADING and not entry.touched and entry.job is not None:
                        self._again[tid] = (entry.target, entry.job.urgent, entry.job.priority)
                    elif entry.state in (Residency.SSD, Residency.HOST):
                        entry.keep_for_reuse = self.reuse_copies and not any(w for t, _, w in inputs if t == tid)
                        self._again[tid] = (entry.target, False, 0)
                self._make_resident(tid, entry)
                self._left_out.discard(tid)  # back: the plan's again from here
        if self.copies:
            for tid, _, written in inputs:
                if written and tid in self.copies:
                    self._drop_copy(tid, written_over=True)
        # after the inputs: a fetch on demand made room for itself alone (NOTE [ Room ])
        schedule = self.schedule
        if schedule is not None and index < len(schedule.made_bytes) and schedule.made_bytes[index]:
            self._make_room(schedule.made_bytes[index])

    def run_uncounted(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """An uncounted op (data loading) still never touches a freed storage, nor leaves a kept
        copy of a storage it may write (its schema is not looked at: any it touches)."""
        if self.forked():
            self._out_in_child([_storage_of(t) for t in _tensors(args, kwargs)], str(func))
        elif self.moved or self.copies:
            with self._lock:
                self._before_uncounted(args, kwargs)
        return func(*args, **kwargs)

    def _before_uncounted(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        for tensor in _tensors(args, kwargs):
            storage = _storage_of(tensor)
            if storage is None:
                continue
            tid = self.ids.get(storage)
            entry = self.moved.get(tid) if tid is not None else None
            if tid is not None and entry is not None:
                self._make_resident(tid, entry)
            if tid is not None and tid in self.copies:
                self._drop_copy(tid, written_over=True)

    def _out_in_child(self, storages: list[torch.UntypedStorage | None], what: str) -> None:
        """In a forked child: raise if any of ``storages`` was out of memory at the fork
        (NOTE [ Forked children ])."""
        out = [self._describe(tid) for s in storages if s is not None and (tid := self.ids.get(s)) is not None
               and (e := self.moved.get(tid)) is not None and e.state is not Residency.OFFLOADING]
        if out:
            raise RuntimeError(
                f"teraio: {what} in a process forked from the training process (pid {self._pid}) "
                f"reads {', '.join(out[:3])}, which teraio had moved out of memory when it forked; "
                "only the training process can bring it back: start that process with the 'spawn' "
                "method, or before training begins (NOTE [ Forked children ] in runtime/executor.py)")

    @_locked
    def bring_back(self, storage: torch.UntypedStorage) -> None:
        if self.forked():
            self._out_in_child([storage], "a read outside any op")
            return
        tid = self.ids.get(storage)
        entry = self.moved.get(tid) if tid is not None else None
        if tid is not None and entry is not None:
            self._make_resident(tid, entry)

    @_locked
    def after_op(self, index: int, info: OpInfo, inputs: list[tuple[int, torch.Tensor, bool]],
                 outputs: list[tuple[int, torch.Tensor, bool]]) -> None:
        if self.forked():
            return
        stats = self.stats
        sizes = self.sizes
        if index in self._watched and self.schedule is self.steady:  # NOTE [ Made anew ]
            self._accessed[index] = tuple(t for t, _, _ in inputs) + tuple(t for t, _, _ in outputs)
        if self.hold_on_demand and _functional_in_flight(info.name):
            self._busy.update(tid for tid, _, _ in outputs)  # a functional collective's result: written till waited
        for tid, t, new in outputs:
            if new:
                n = _memory_of(t.untyped_storage())
                sizes[tid] = n
                stats.tracked_bytes += n
                if self.hold_on_demand:  # NOTE [ On demand within the budget ]: just made, not idle
                    self._used_at[tid] = self._clock
                if self.schedule is not self.steady and n >= UNTOUCHED_MIN_BYTES:  # NOTE [ Left over ]
                    self._left_over[tid] = n
        for tid, t, _ in inputs:
            if tid not in sizes and (s := self.input_storage(tid, t)) is not None:  # made outside any op
                n = _memory_of(s)
                sizes[tid] = n
                stats.tracked_bytes += n
                if self.schedule is not self.steady and n >= UNTOUCHED_MIN_BYTES:  # (a deep copy's): NOTE [ Left over ]
                    self._left_over[tid] = n
        if self._left_over or self._until_waited:
            self._left_over_in_flight(info.name, inputs, outputs)
        if stats.tracked_bytes > stats.peak_tracked_bytes:
            stats.peak_tracked_bytes = stats.tracked_bytes

    def _left_over_in_flight(self, name: str, inputs: list[tuple[int, torch.Tensor, bool]],
                             outputs: list[tuple[int, torch.Tensor, bool]]) -> None:
        """A functional collective's input or result, read or written until its ``wait_tensor``,
        is not left over until then (NOTE [ Left over ]; c10d's ops give a ``Work``, whose tensors
        ``_offload`` holds while it runs)."""
        if _functional_in_flight(name):
            held = [(tid, self._left_over.pop(tid)) for tid, _, _ in inputs + outputs if tid in self._left_over]
            for tid, _, _ in outputs if held else ():
                self._until_waited[tid] = held
        elif ".wait_tensor." in name:
            for tid, _, _ in inputs:
                self._left_over.update(self._until_waited.pop(tid, ()))

    @_locked
    def on_free(self, tensor_id: int) -> None:
        if self.forked():
            return
        if tensor_id in self.copies:
            self._drop_copy(tensor_id)
        self._again.pop(tensor_id, None)
        self._held_back.pop(tensor_id, None)
        self._out_for_good.discard(tensor_id)
        self._used_at.pop(tensor_id, None)
        self._left_over.pop(tensor_id, None)
        entry = self.moved.pop(tensor_id, None)
        n = self.sizes.pop(tensor_id, 0)
        if entry is not None and entry.state in (Residency.SSD, Residency.HOST):
            n = 0  # its bytes were not counted while offloaded
        self.stats.tracked_bytes -= n
        if entry is not None:
            if entry.job is not None:
                self._await(entry.job)
                self._count(entry.job)  # done, but the drain will no longer find it
            entry.backend.delete(entry.key)

    # ---- following the plan --------------------------------------------------------
    # NOTE [ Other sizes ]: a planned offload whose storage has another size than the plan's, or
    # another name (a parameter or optimizer state named otherwise in the run than in the profile:
    # a script profiled with other arguments, which ran 1.85x over its budget as followed), is of
    # another tensor: a schedule that orders some ops differently from step to step
    # (PyTorch's ZB-V accumulates weight gradients in a set's order) gives an op's output
    # another role. That move is left out and the iteration goes on following the plan. An
    # iteration where more planned offloads find another size than the plan's size counts
    # as one that left the plan: a plan made for a model of another size is refused so.
    # NOTE [ Named by position ]: a persistent storage's id is its position among the names at a
    # boundary (parameters, their gradients, optimizer states: torch_patch.identity), so where the
    # set of names differs from the profile's, the ids after it shift. A script that freezes a
    # block at step 3, profiled past it (--warmup 4), still had the block's gradients at the next
    # two boundaries: the plan's ids then named other tensors, its moves of the later Adam states
    # were left out, and those iterations followed the plan at 1.25x its budget. So a planned move
    # of a named storage finds it by its name (``_named``, at each boundary), at the boundary too.
    def _leave(self, where: str, ops_followed: int) -> None:
        """Run the rest of this iteration on demand (NOTE [ Boundaries ] in runtime.boundary), its
        first ``ops_followed`` ops having followed the plan."""
        self._followed_to = ops_followed if self.schedule is self.steady else 0
        self.schedule = None
        self._drop_copies()  # kept copies hold host memory no plan now counts
        for entry in self.moved.values():  # nor do those of reads in flight
            entry.keep_for_reuse = False
        if self.iteration == 0:
            self.first_left_at = f"iteration 0, {where}"
            hint = (" (its plan starts at the script's first op, as `teraio profile` and "
                    "`teraio run` see it; entered later, it cannot be followed)"
                    if self.op_index <= 1 else "")
            self._warn_once("first", f"iteration 0 left its plan at {where}{hint}; it goes on "
                            "on demand, and may need more memory than the plan's budget")
            return
        self.left_at = f"iteration {self.iteration}, {where}"

    def _start(self, m: Migration) -> None:
        tid = m.tensor_id
        if m.name is not None and tid < PRODUCED_BASE:  # NOTE [ Named by position ]
            tid = self._named.get(m.name, tid)
        if m.action == "offload":
            storage = self.ids.storage(tid)
            if storage is None and tid in self.plan_ids:
                tid = self.plan_ids[tid]
                storage = self.ids.storage(tid)
            if storage is None and (successor := self._successor(m)) is not None:
                tid, storage = successor
            self._settle_kept(tid)
            if storage is None or tid in self.moved:
                return
            name = self.persistent.get(tid, (m.name, ""))[0] if m.name is not None else None
            if storage.nbytes() != m.size_bytes or name != m.name:
                # Another storage than the plan's (NOTE [ Other sizes ]): left alone.
                self._other_sizes += 1
                self._larger += storage.nbytes() > m.size_bytes
                if self._first_other_size is None:
                    self._first_other_size = f"op {m.trigger_op}: tensor {tid} " + (
                        f"is {name}, the plan's {m.name}" if name != m.name else
                        f"has {storage.nbytes()} bytes, the plan expects {m.size_bytes}")
                return
            self._offloads_started += 1
            if not (m.reuse_copy and self.reuse_copies and self._reuse_copy(tid, storage, m.place)):
                self._offload(tid, storage, m.place, m.urgent, m.name, m.priority)
            return
        if tid not in self.moved and tid in self.plan_ids:
            tid = self.plan_ids[tid]
        self._again.pop(tid, None)  # the plan has it in from here (NOTE [ Ops on a tensor going out ])
        self._held_back.pop(tid, None)
        entry = self.moved.get(tid)
        if entry is None:
            return
        if entry.state is Residency.OFFLOADING:
            self._needed_again(entry)
        elif entry.state in (Residency.SSD, Residency.HOST):
            entry.keep_for_reuse = m.keep_copy and self.reuse_copies
            self._fetch(tid, entry, m.urgent, priority=m.priority)

    # NOTE [ Made anew ]: a script may replace a storage that lives across steps by a new one of
    # its size, and keep using the new one as it did the old: a pipeline stage makes its buffers
    # anew for ``schedule.eval()``. The plan's id for it then names nothing (a long-lived id
    # dead, or a carried one after an iteration run on demand, whose ids mean nothing to the
    # plan), its moves found nothing, and the new storage, unknown to the plan, stayed in memory
    # (both stages of a pipeline 1.03-1.09x over the budget in every iteration after an
    # evaluation, after NOTE [ Left over ] had sent it out at the boundary and its next use
    # brought it back). So where an offload of such an id finds no storage, the storage its
    # period's first op (the last to use it) read or made in the plan's place takes its part: one
    # of its size, not the plan's, with no name, that lived across a boundary (a carried or
    # long-lived id), on the budget's device. It keeps a long-lived one's part from then on,
    # renamed with the rest at each boundary, until it dies; a carried one's, this iteration.
    def _successor(self, m: Migration) -> tuple[int, torch.UntypedStorage] | None:
        """The id and storage that take the part of ``m``'s, which names nothing (NOTE [ Made anew ])."""
        if self.schedule is not self.steady or not _replaceable(m.tensor_id):
            return None
        if self._known_now is None:
            self._known_now = set(self.plan_ids.values()) | self._plan_tids | set(self._made_anew.values())
        for tid in self._accessed.get(m.period_start_op % self.steady.num_ops, ()):
            storage = self.ids.storage(tid)
            if (tid < LONG_BASE or tid in self._known_now or tid in self.moved  # (carried ids are above too)
                    or storage is None or storage.nbytes() != m.size_bytes or storage.device.type != self._device
                    or not self.movable(storage)):
                continue
            self._made_anew[m.tensor_id] = self.plan_ids[m.tensor_id] = tid
            self._known_now.add(tid)
            return tid, storage
        return None

    # ---- transfers ---------------------------------------------------------------
    def _describe(self, tid: int, name: str | None = None) -> str:
        """``tensor ID`` with its name, or for an unnamed one its size and where it was made (the
        id alone told a user nothing: a sweep's warning named "tensor 141837019840512")."""
        name = name or self.persistent.get(tid, (None, ""))[0]
        if name:
            return f"tensor {tid} ({name})"
        size = self.sizes.get(tid)
        what = [f"{size:,} bytes"] if size is not None else []
        bare = tid & ~CARRIED_FLAG
        if PRODUCED_BASE <= bare < INPUT_BASE:
            op, names = produced_op(tid), self.steady.op_names
            # a carried one's op is the iteration before's: named from the plan's where that one ran
            # them (iteration 0's include the set-up: a sweep's data set was said made by .item())
            before = self.stats.iteration_followed
            named = op < len(names) and (not tid & CARRIED_FLAG or (self.iteration >= 2 and before[-1:] == [True]))
            what.append(f"made by op {op}" + (f", {names[op]}" if named else "")
                        + (" of an iteration before" if tid & CARRIED_FLAG else ""))
        elif LONG_BASE <= bare < CARRIED_FLAG:
            what.append("alive a whole iteration, no name holds it")
        return f"tensor {tid}" + (f" ({'; '.join(what)})" if what else "")

    def movable(self, storage: torch.UntypedStorage) -> bool:
        """Also: it holds memory of the CPU or of a CUDA device. A meta storage (a module skeleton
        ``torch.func.functional_call`` runs with) has a size and no memory, and moving one crashed
        the process. (The tracer's own check leaves it movable: a fake profile's storages are meta.)"""
        return storage.device.type in ("cpu", "cuda") and super().movable(storage)

    def _why_fixed(self, storage: torch.UntypedStorage) -> str:
        """Why ``movable(storage)`` is false, in words."""
        if storage.device.type not in ("cpu", "cuda"):
            return f"it is on the {storage.device.type} device, which teraio does not move"
        if (why := self.foreign.get(storage)) is not None:
            return why
        if storage.device.type == "cpu" and storage.is_shared():
            return "it is in shared memory, which other processes read and write"
        return ("its memory belongs to numpy, DLPack or a file mapped by torch.load(mmap=True) or "
                "safetensors")

    def _offload(self, tid: int, storage: torch.UntypedStorage, target: str, urgent: bool,
                 name: str | None = None, priority: int = 0) -> None:
        if self._read_elsewhere(tid, storage):
            if self.schedule is not None:  # out once the read is done (NOTE [ Reads on other threads ])
                self._held_back.setdefault(tid, target)
            return
        if not self.movable(storage):
            what = self._describe(tid, name)
            self.stats.not_resizable.append(what)
            self._warn_once("fixed", f"{what} cannot be freed in place ({self._why_fixed(storage)}), so it stays "
                            "in memory; so does every such tensor")
            return
        if tid in self.copies:
            self._drop_copy(tid)
        backend = self.backends[target]
        key = next(self._keys)
        after, run, device = _copy_job(backend, "write", key, byte_view(storage), self.stream_copies)
        job = self.engine.submit(Job(tid, "write", storage.nbytes(), run, urgent, target, priority, after=after,
                                     device=device))
        entry = _Entry(Residency.OFFLOADING, storage.nbytes(), backend, target, weakref.ref(storage),
                       key, job)
        self.moved[tid] = entry
        writes = self._writes
        while writes and writes[0].state is not Residency.OFFLOADING:
            writes.popleft()  # done: keeps the queue as short as what is in flight
        writes.append(entry)

    # NOTE [ Interrupts ]: a Ctrl-C (KeyboardInterrupt) can land between any two steps of
    # the main thread's bookkeeping. The steps are ordered so that ``restore_all`` can
    # always tell what a storage holds from its entry and its size: a storage is freed
    # only after its bytes are written, its entry says SSD or HOST only once it is freed
    # (until then a freed storage with no job is still "out"), and it is reallocated
    # before its read is submitted (an SSD or HOST entry with no job is read again).
    def _fetch(self, tid: int, entry: _Entry, urgent: bool, keep_copy: bool = False, priority: int = 0,
               for_op: bool = True) -> None:
        """Read ``entry`` back; ``for_op`` false where no op is about to run (an exit, a save):
        no wait for frees that wait for the GIL (NOTE [ Room ])."""
        storage = entry.storage()
        if storage is None:
            return
        if self.schedule is not None:
            self._make_room(entry.nbytes, for_op)
        realloc_storage(storage, entry.nbytes)
        self.stats.tracked_bytes += entry.nbytes
        self.stats.peak_tracked_bytes = max(self.stats.peak_tracked_bytes, self.stats.tracked_bytes)
        after, run, device = _copy_job(entry.backend, "read", entry.key, byte_view(storage), self.stream_copies)
        entry.keep_copy = keep_copy
        entry.job = self.engine.submit(Job(tid, "read", entry.nbytes, run, urgent, entry.target, priority,
                                           after=after, device=device))
        entry.state = Residency.FETCHING

    # NOTE [ Copies kept ] in planner.clean: a planned prefetch may leave its copy in the backend
    # (``keep_copy``); the copy stays good until an op writes the storage (an argument its
    # schema marks as written, or any argument of an uncounted op), the storage dies, it goes
    # out again or the iteration leaves its plan. The storage's next planned offload with
    # ``reuse_copy`` then frees it without writing; without a good copy it writes as any other.
    # A write this dispatch mode does not see (an op on a thread started before teraio, an
    # extension's kernel called directly, a CUDA graph replayed) would be lost: ``reuse_copies``
    # false (`teraio run --no-reuse-copies`) writes every offload.
    def _reuse_copy(self, tid: int, storage: torch.UntypedStorage, target: str) -> bool:
        """Free ``storage`` against its kept copy on ``target``, writing nothing; False (the copy,
        if any, dropped) where there is none that still holds its bytes there."""
        entry = self.copies.pop(tid, None)
        if entry is None:
            return False
        if (entry.target != target or entry.nbytes != storage.nbytes() or entry.storage() is not storage
                or not self.movable(storage) or id(storage) in self._held
                or self._in_work(storage)):  # then ``_offload`` says why
            entry.backend.delete(entry.key)
            return False
        # NOTE [ Interrupts ]: in ``moved`` before the storage is freed (a freed storage with no
        # job is read back at exit), out only once it is.
        entry.touched = entry.keep_copy = False
        entry.state = Residency.DEVICE
        self.moved[tid] = entry
        try:
            free_storage(storage)
        except RuntimeError:  # it became unresizable: write it as any other (which says so)
            del self.moved[tid]
            entry.backend.delete(entry.key)
            return False
        self.stats.tracked_bytes -= entry.nbytes
        self.stats.reused_offloads += 1
        entry.state = Residency.HOST if target == "host" else Residency.SSD
        return True

    def _drop_copy(self, tid: int, written_over: bool = False) -> None:
        entry = self.copies.pop(tid)
        entry.backend.delete(entry.key)
        self.stats.dropped_copies += written_over

    def _drop_copies(self) -> None:
        for tid in list(self.copies):
            self._drop_copy(tid)

    def _await(self, job: Job) -> None:
        """Wait for ``job`` to finish; a transfer that never does ends the run with an error."""
        if job.done.is_set():
            return
        timeout = _TRANSFER_TIMEOUT_S + job.nbytes / 10e6
        if not self.engine.wait(job, timeout):
            raise StorageIOError(job.tensor_id, job.target or "the backend",
                                 f"the {job.direction} did not finish in {timeout:.0f} s")

    def _wait(self, entry: _Entry, cause: str) -> None:
        """Wait for ``entry``'s transfer, a stall counted under ``cause``: ``room`` (an op or a
        prefetch waits for a write to free its bytes), ``late read`` (a read started before, by
        the plan or on demand, is not done when an op uses it), ``fault`` (a read on demand
        started then), ``offload`` (a new offload waits for the last transfer of its tensor),
        ``boundary``, ``save`` (a torch.save on the training thread), ``pointer check``; and
        ``collective`` (NOTE [ Buffers of collectives in flight ])."""
        job = entry.job
        if job is None:
            return
        if not job.done.is_set():
            t0 = time.perf_counter()
            # NOTE [ Copies ordered on streams ] in runtime.engine: the blocks of the storages it
            # frees go back to their stream's pool, which is the stream that waits only where the
            # storage was made on the stream current here (the default one, for a script with no
            # streams of its own)
            if not (job.device is not None and _on_default_stream(job.device) and self.engine.order(job)):
                self.engine.promote(job)
                self._await(job)
            self._stalled(cause, time.perf_counter() - t0)
        self._drain()

    def _stalled(self, cause: str, waited: float) -> None:
        self.stats.stalls += 1
        self.stats.stall_s += waited
        if self.iteration > 0:
            counts = self.stats.steady_stalls.setdefault(cause, [0, 0.0])
            counts[0] += 1
            counts[1] += waited

    # NOTE [ Room ]: a tensor's memory is free only once its offload is done, and the
    # runtime's transfers may be slower than the plan's, so, as in the simulator, memory
    # that would go over the budget waits for offloads in flight: a prefetch before it
    # allocates, an op before it runs, for the bytes the plan says it allocates
    # (``made_bytes``, from the profile). That is the only wait for a write: an op does not
    # wait at an offload's deadline, where the plan counts its bytes free, unless it needs
    # the room (NOTE [ Deadlines where memory is needed ] in planner.greedy). Every followed
    # iteration, iteration 0's own plan included, is held to its budget this way.
    #
    # NOTE [ Frees that wait for the GIL ]: a library's thread that drops the last reference to
    # a tensor (gloo's worker, once a collective is done with its buffer) frees the storage
    # only once it holds the GIL: PyTorch keeps the storage's Python object alive with it. The
    # training thread holds the GIL from op to op, so such a free, memory included, can wait
    # many ops: FSDP2's reduce-scatter input (199,936 bytes of a 2,298,132-byte budget) was
    # freed at the op after it in the profile and 27 ops later under CPU load: beside two busy
    # loops, tests/distributed/test_jobs.py's FSDP2 job had a rank 5-8.7% over its budget in 8 of
    # 16 runs, and in none of 16 with this wait. So where memory is still over the budget before
    # an op once no write is left to wait for, the training thread lets the GIL go
    # (``time.sleep(0)``) and applies the frees that came, as long as some do (only the thread
    # that runs the ops applies them: NOTE [ Frees on other threads ]). An exit or a save, which
    # runs no op, does not wait so.
    def _make_room(self, nbytes: int, for_op: bool = True, budget: int | None = None) -> None:
        """Wait for offloads in flight, oldest first, until ``nbytes`` more fit the budget (this
        iteration's plan's, or ``budget``) or none is left, then, before an op (``for_op``), for
        frees waiting for the GIL (NOTE [ Room ])."""
        if budget is None and self.schedule is not None:
            budget = self.schedule.budget_bytes
        writes = self._writes
        if budget is None:
            return
        while writes and self.stats.tracked_bytes + nbytes > budget:
            entry = writes.popleft()
            if entry.state is Residency.OFFLOADING and not entry.touched:  # a touched one frees nothing
                self._wait(entry, "room")
        before = self.stats.tracked_bytes + 1
        while for_op and before > self.stats.tracked_bytes and self.stats.tracked_bytes + nbytes > budget:
            before = self.stats.tracked_bytes
            time.sleep(0)  # NOTE [ Frees that wait for the GIL ]
            if not self.ids.drain_here():  # a checkpoint writer's thread: its frees are not its to apply
                break

    # NOTE [ Buffers of collectives in flight ]: a collective's buffer is freed once the
    # collective is done, on gloo's worker thread where it holds the last reference, and that
    # waits for the other ranks to reach the collective: a rank ahead of the others holds it
    # longer than its profile did, however long it lets the GIL go. FSDP2's reduce-scatter input
    # (199,936 bytes) was still alive at the next one's allocation: tests/distributed/
    # test_jobs.py's FSDP2 job went 5.5% over its 2,298,128-byte budget once in CI, and 3% over
    # in 1 of about 25 runs here beside part of the test suite; DDP's fp16-compressed buckets
    # took a rank to 1.085x so. So where memory is still over the budget before an op of a
    # followed iteration, and storages made in it or before that a collective used are alive with
    # at least the bytes it is over in memory, the op waits for frees from other threads, as the
    # other ranks catch up, until it fits, those storages are too few, or no free comes in what
    # is left of ``_COLLECTIVE_WAIT_S``: beside the same load the FSDP2 job waited so
    # in 7 of 37 runs (0.1-6 ms each) and went over in none (nor in 25 beside the whole suite);
    # the DDP job with the hook waited 1-18 times a run (0.06-0.27 s in all) and went over in
    # none of 15, but beside the whole suite 8 of 24 ranks' runs still did, by 0.2-5.1% (not
    # found why; the hook's callback makes copies on gloo's thread too). It waits without the
    # executor's lock, which a thread of the script's own that reads the buffer before it drops
    # it needs. At most ``_COLLECTIVE_WAIT_S`` in an iteration: a buffer the script keeps (a
    # batch broadcast to every rank, a metric) is alive for a reason of its own, and then the
    # iteration goes over its budget, as before, having waited that long. A write done holds its
    # storage until the training thread drains it (NOTE [ Releasing jobs ] in runtime.engine), so
    # the wait drains them every ``_COLLECTIVE_POLL_S``: FSDP2's all-gather output, its write thrown
    # away as its copy-out needed it again (NOTE [ Writes of a tensor needed again ]) and dropped by
    # FSDP2 since, was waited for the whole 0.5 s, and the iteration went 1.2-1.28x over, in every
    # followed iteration of an FSDP2 job at its smallest budget (found by a sweep of users' habits).
    # A buffer waited for in vain until the wait's time ran out is one the script holds, and the
    # buffers its op makes in the iterations after (the same id) are not waited for again, until
    # one of them is freed on another thread (a rank behind once more than the wait's time): a
    # pipeline stage keeps its send buffers for its backward pass, and its last stage, 3 KiB
    # over the budget after an evaluation, waited 0.5 s in every iteration after.
    # teraio's own record of the c10d works not done (NOTE [ Collectives a script waits for ])
    # holds each work, and the work its tensors: a work done meanwhile is forgotten in the wait
    # too, else the wait held what it waited for. The fp16 hook's compressed buckets, made by the
    # backward pass's ops and done once the other rank caught up, stayed alive so the whole
    # 0.5 s, in every iteration of some runs beside two busy loops, and then went over.
    # A buffer alive at a boundary with no work of its collective in flight is one the script
    # keeps, and leaves the set: DDP's gradient bucket, carried from iteration 0 until DDP
    # rebuilds its buckets in iteration 1, cost every run of accelerate's loop 0.5 s there.
    def _short_of_room(self, index: int) -> int:
        """The bytes op ``index`` allocates where they do not fit and a collective's buffer may
        still be freed (NOTE [ Buffers of collectives in flight ]); else 0."""
        schedule = self.schedule
        if (not self._in_collective or self._collective_wait_left <= 0 or schedule is None
                or schedule.budget_bytes is None or index >= len(schedule.made_bytes)):
            return 0
        made = schedule.made_bytes[index]
        return made if made and self.stats.tracked_bytes + made > schedule.budget_bytes else 0

    def _await_collectives(self, nbytes: int) -> None:
        schedule = self.schedule
        assert schedule is not None and schedule.budget_bytes is not None
        t0 = time.perf_counter()
        deadline, waited = t0 + self._collective_wait_left, False
        while True:
            with self._lock:  # a write done holds its storage until drained
                if self.stream_copies:  # its writes are done once polled
                    self.engine.poll()
                if self._works:  # and our record of a work done, its tensors
                    self._forget_works(_done)
                self._drain()
            if not self.ids.drain_here() or (over := self.stats.tracked_bytes + nbytes - schedule.budget_bytes) <= 0:
                break
            self._in_collective = {t for t in self._in_collective if self._bytes_in_memory(t)}
            self._unhold()
            awaited = [t for t in self._in_collective if t & ~CARRIED_FLAG not in self._held_on]
            if sum(self.sizes.get(t, 0) for t in awaited) < over:  # their frees would not do
                break
            waited = True
            left = deadline - time.perf_counter()
            if left <= 0:  # none came: the script holds them, here and in the iterations after
                self._held_on.update(t & ~CARRIED_FLAG for t in awaited)
                break
            self.ids.await_free(min(left, _COLLECTIVE_POLL_S))  # then drain the writes done meanwhile
        if waited:
            spent = time.perf_counter() - t0
            self._collective_wait_left -= spent
            with self._lock:
                self._stalled("collective", spent)

    def _unhold(self) -> None:
        """Ids waited for in vain whose buffer was since freed on another thread are waited for again."""
        if self._freed_elsewhere:
            self._held_on -= {t & ~CARRIED_FLAG for t in self._freed_elsewhere}
            self._freed_elsewhere.clear()

    def _bytes_in_memory(self, tid: int) -> bool:
        """Whether ``tid`` is alive with its bytes in memory."""
        entry = self.moved.get(tid)
        return self.ids.storage(tid) is not None and (entry is None or entry.state is Residency.OFFLOADING)

    # NOTE [ On demand within the budget ]: an iteration that leaves its plan (an evaluation
    # between steps, a checkpoint, a step whose ops differ) runs on demand: what an op uses comes
    # back, and nothing goes out again, so such an iteration may reach the plain run's peak: an
    # evaluation after step 4 of tests/compat/scripts/eval_and_checkpoint.py took iteration 5 to
    # 2.0x its budget, which on a GPU sized to the budget is an out-of-memory error. With
    # ``hold_on_demand`` (`teraio run --hold-on-demand`), before each op of such an iteration
    # (from iteration 1 on, where ids are the plan's) while what is resident, what the op brings
    # back and the most any op of the plan allocates (``made_bytes``; a factory op's own size
    # where that is more, as it is known before it runs: DDP's bucket made anew in its second
    # step) exceed the budget, resident storages go out, least recently used first, and the op
    # waits for their writes. Those that
    # may: what the plan moves under lasting ids (parameters, optimizer state, storages kept for
    # good), and, where the plan moves named ones (so its profile saw no write teraio cannot
    # see), storages made in or handed to this iteration (activations, gradients, batches), at
    # the size they were made at. Never one the op uses, one carried from the iteration before,
    # one a functional collective used or made in this iteration or the one before (it may still
    # be moving: NOTE [ Busy in a collective ] in planner.problem; its result, called through
    # ``torch.ops._c10d_functional``, went out before its wait), one a c10d op's ``Work`` still
    # holds (``_offload`` leaves it: NOTE [ Collectives a script waits for ]; held for two
    # iterations as a functional one's, DDP's bucket, in a collective every step, never went
    # out, and the steps a barrier every other step sends on demand ran at 1.41x the smallest
    # budget), another device's (a
    # CUDA run's pinned batch an asynchronous copy may read), one another thread reads through
    # torch.save, tolist or a deep copy, and nothing while
    # a torch.save on this thread runs (its pickling runs ``detach`` ops, and may make tensors
    # the save then writes: sent out, a checkpoint held empty records), nor one smaller than a
    # thousandth of the budget (at most 1 MiB; never under 8 KiB, which keeps a random state in:
    # NOTE [ Random states ] in profiles.views): too few bytes to matter, and small ones are what
    # C++ code fills and reads through pointers between ops (DDP's Reducer its bucket indices,
    # when ``static_graph`` or a rebuild syncs them: sent out, a rank failed with "received
    # invalid bucket_size"). Every such offload writes (no copy is kept or reused: a write on
    # another thread after an evaluation was lost so). Opt-in, because a storage may then go out
    # where no plan has it out, and whatever reads it without an op teraio sees finds it freed:
    # ops on a thread started before teraio (NOTE [ Ops on other threads ] in torch_patch.opstream;
    # a crash, or a write lost), a pointer read teraio does not know (C++ code's, of a larger
    # storage). What cannot go out (what is carried, what the plan keeps in, another device's)
    # may still take such an iteration over the budget, and so may an op that allocates more
    # than any op of the plan, other than the factories ``_factory_bytes`` knows (``empty``,
    # ``zeros``, ``ones``, ``full``, ``new_*``; not ``*_like`` nor random ones).
    def _evict_for(self, inputs: list[tuple[int, torch.Tensor, bool]], made: int) -> None:
        """Before an op run on demand: out with the least recently used storages until what the
        op brings back, and the ``made`` bytes it may allocate, fit the budget (NOTE [ On demand
        within the budget ])."""
        self._clock += 1
        used = {tid for tid, _, _ in inputs}
        for tid in used:
            self._used_at[tid] = self._clock
        budget = self.steady.budget_bytes
        assert budget is not None
        need = sum(e.nbytes for tid in used if (e := self.moved.get(tid)) is not None
                   and e.state in (Residency.SSD, Residency.HOST))
        excess = self.stats.tracked_bytes + need + made - budget
        if excess <= 0 or self._saving:
            return
        sizes, used_at, evictable, transient = self.sizes, self._used_at, self._evictable, self._evict_transient
        busy = self._busy | self._busy_before
        least = max(min(budget >> 10, 1 << 20), 8 << 10)  # none under 8 KiB: NOTE [ Random states ]
        idle = [tid for tid in sizes if sizes[tid] >= least and tid not in used and tid not in busy
                and tid not in self.moved and (tid in evictable or transient and PRODUCED_BASE <= tid < LONG_BASE)]
        for tid in sorted(idle, key=lambda t: (used_at.get(t, 0), -sizes[t])):
            storage = self.ids.storage(tid)
            if (storage is None or not storage.nbytes() or storage.nbytes() != sizes[tid]
                    or storage.device.type != self._device or not self.movable(storage)):
                continue
            self._offload(tid, storage, self._spill, urgent=True)  # a kept copy dropped: it writes
            if tid not in self.moved:  # another thread reads it
                continue
            self.stats.evictions += 1
            excess -= sizes[tid]
            if excess <= 0:
                break
        self._make_room(need + made, budget=budget)

    # NOTE [ Writes of a tensor needed again ]: a tensor whose write is still in flight when it
    # is needed again (its prefetch is due, an op uses it, a boundary has it in) stays where it
    # is: its entry is marked touched, and its write, once done, is thrown away. A write no
    # worker has begun is dropped at once, as the simulator drops the rest of a write its
    # prefetch overtakes: on a disk slower than the plan's, writing bytes nobody will read only
    # delays the writes the budget waits on. The entry lives until its write is done, and a new
    # offload of the same tensor (its next inactive period) waits for that: skipping it, as we
    # once did, left its bytes in memory for the whole period, over the budget (the example at
    # its smallest budget on a 0.2 GB/s disk: 37.0 MiB against 33.4); so does the boundary, which
    # counts such a tensor as in. Where a worker has begun the write, the runtime differs from the
    # simulator, which drops the rest of it: the write goes on using the disk, and that wait for it
    # is a stall no plan predicts.
    def _needed_again(self, entry: _Entry) -> None:
        """The tensor of an offloading ``entry`` stays resident (NOTE [ Writes of a tensor needed
        again ])."""
        entry.touched = True
        if entry.job is not None:
            self.engine.cancel(entry.job)

    # NOTE [ Ops on a tensor going out ]: a plan starts an offload after the tensor's last use in
    # the profile and prefetches it before its next, so an op that uses it while it is going out
    # or out is one the profile did not have there: a schedule that orders some ops differently
    # from step to step (PyTorch's ZB-V accumulates weight gradients in a set's order, which
    # changes from run to run) swaps two tensors of one size between ops. The plan still counts
    # the tensor out. So, while an iteration follows its plan, such a tensor is used where it is
    # and goes out again to the same place before the first op after that does not use it (views
    # of it, ``t()`` before a matmul, hand it on), or at the iteration's end: a write in flight is
    # thrown away (NOTE [ Writes of a tensor needed again ]: the op may change the bytes, and a
    # write done during the op would free what it uses) and the tensor written again; one already
    # out is fetched on demand, its copy kept unless the op writes it, and freed against that copy
    # (NOTE [ Copies kept ]). Kept in instead, it stayed in memory until the plan's next prefetch of it: the
    # pp-zbv job (tests/distributed/test_jobs.py) had a rank 1.04-1.10x over its budget in 3 of 9
    # runs beside two others, a 64 KiB gradient its schedule accumulated into one op later.
    # Once an iteration for each tensor, so that a script that keeps using one the plan has out
    # does not move it to and fro; never after a collective, which returns before its transfer is
    # done (NOTE [ Busy in a collective ] in planner.problem): a write begun then would hold the
    # bytes from before it. A prefetch of it the plan starts meanwhile keeps it in.
    # NOTE [ Out before the prefetches ]: a tensor the plan sent out while a collective still
    # used it (a DDP bucket whose all-reduce is not done, NOTE [ Collectives a script waits for ])
    # goes out once the work is done, before the next op. The plan counts its bytes free from its
    # offload on, so the prefetches of an op, which make room by waiting for the writes in flight
    # (NOTE [ Room ]), must find its write among them. DDP with static_graph=True (its buckets'
    # all-reduces done later than in the profile) had followed iterations at 1.12x their budget
    # in 5 of 5 runs beside two busy loops (a sweep's): the prefetches ran before such a tensor
    # went out, or before its work was done. So such tensors go out before an op's planned moves
    # as well as after them (but for those the op brings back), and before an op whose
    # prefetches and allocation do not fit without them, the training thread waits for their
    # works as for buffers of collectives (NOTE [ Buffers of collectives in flight ]: without the
    # executor's lock, as a hook's callback on gloo's thread runs ops; within what is left of
    # ``_COLLECTIVE_WAIT_S`` in the iteration). With both, 0 of 5 runs went over.
    def _await_held_back(self, index: int, inputs: list[tuple[int, torch.Tensor, bool]], moves: bool) -> None:
        """Wait while op ``index`` (of ``inputs``; with its planned moves, or after them) is short
        of room that tensors collectives hold could make."""
        t0 = time.perf_counter()
        waited = False
        while True:
            with self._lock:
                if self._works:
                    self._forget_works(_done)  # a done one's tensors go out before the op
                short = self._short_behind_works(index, inputs, moves)
            left = self._collective_wait_left - (time.perf_counter() - t0)
            if not short or left <= 0:
                break
            waited = True
            time.sleep(min(left, _COLLECTIVE_POLL_S))
        if waited:
            spent = time.perf_counter() - t0
            with self._lock:
                self._collective_wait_left -= spent
                self._stalled("collective", spent)

    def _short_behind_works(self, index: int, inputs: list[tuple[int, torch.Tensor, bool]], moves: bool) -> bool:
        """Whether what op ``index`` allocates, with the reads of its planned prefetches where
        ``moves``, does not fit in the budget, even once the writes in flight are done, and
        tensors the plan has out that collectives hold would make room for it once out: not those
        the op uses or its prefetches bring back, which stay in, nor the buffers an iteration's
        ops made for a collective (NOTE [ Buffers of collectives in flight ] waits for those)."""
        schedule = self.schedule
        if schedule is None or schedule.budget_bytes is None or not self._held_back:
            return False
        need = schedule.made_bytes[index] if index < len(schedule.made_bytes) else 0
        staying = {tid for tid, _, _ in inputs}
        if moves:
            fetched = self._fetched_by(schedule.triggers.get(index, ()))
            staying |= fetched
            need += sum(e.nbytes for t in fetched
                        if (e := self.moved.get(t)) is not None and e.state in (Residency.SSD, Residency.HOST))
        if not need:
            return False
        freeing = sum(e.nbytes for e in self._writes if e.state is Residency.OFFLOADING and not e.touched)
        over = self.stats.tracked_bytes - freeing + need - schedule.budget_bytes
        if over <= 0:
            return False
        held = 0
        for tid in list(self._held_back):
            storage = self.ids.storage(tid)
            if (storage is not None and tid not in self.moved and tid not in staying
                    and tid not in self._in_collective and self._in_work(storage)):
                held += storage.nbytes()
            del storage
        return held >= over

    def _fetched_by(self, moves: tuple[Migration, ...]) -> set[int]:
        """The ids the prefetches among ``moves`` may bring back (as ``_start`` finds them)."""
        ids: set[int] = set()
        for m in moves:
            if m.action != "offload":
                ids.update((m.tensor_id, self.plan_ids.get(m.tensor_id, m.tensor_id),
                            self._named.get(m.name, m.tensor_id) if m.name is not None else m.tensor_id))
        return ids

    def _send_again(self, func: Any, inputs: list[tuple[int, torch.Tensor, bool]],
                    fetched: set[int] | frozenset[int] = frozenset()) -> None:
        """Before op ``func``: the tensors an earlier op used where the plan has them out go out
        again, unless this op uses them too (NOTE [ Ops on a tensor going out ]) or its planned
        moves bring them back (``fetched``, NOTE [ Out before the prefetches ])."""
        used = {tid for tid, _, _ in inputs}
        collective = leaves_in_flight(str(func))
        for tid in list(self._again):
            if tid in fetched:
                continue
            if tid in used:
                if collective:  # busy until a wait no dispatch mode sees
                    del self._again[tid]
                continue
            target, urgent, priority = self._again.pop(tid)
            storage = self.ids.storage(tid)
            if storage is None or self.schedule is None:
                continue
            self._settle_kept(tid)
            if tid in self.moved:
                continue
            self._sent_again.add(tid)
            if not (self.reuse_copies and self._reuse_copy(tid, storage, target)):
                self._offload(tid, storage, target, urgent, priority=priority)

    # NOTE [ Reads before an offload ]: a tensor can still be on its way back when the plan sends
    # it out again. A step a loss scaler skips ends its iteration where the optimizer's step
    # would have begun, with the moments the plan prefetched for that step still being read; the
    # boundary then has them out. Counted as out, they were left in memory for the whole next
    # iteration as their reads finished (an fp16 script, 1.08x its budget under load). So a new
    # offload first waits for such a read, and the boundary counts a tensor being read as in.
    def _settle_kept(self, tid: int) -> None:
        """Before a new offload of ``tid``: wait for a thrown-away write of it still in flight
        (NOTE [ Writes of a tensor needed again ]) or a read (NOTE [ Reads before an offload ]),
        so that its entry is gone."""
        entry = self.moved.get(tid)
        if entry is not None and (entry.state is Residency.FETCHING
                                  or entry.state is Residency.OFFLOADING and entry.touched):
            self._wait(entry, "offload")

    def _make_resident(self, tid: int, entry: _Entry) -> None:
        if entry.state is Residency.OFFLOADING:
            self._needed_again(entry)
            return
        cause = "late read"
        if entry.state in (Residency.SSD, Residency.HOST):
            self.stats.on_demand_fetches += 1
            self._fetch(tid, entry, urgent=True)
            cause = "fault"
        self._wait(entry, cause)

    def _drain(self, errors: list[StorageIOError] | None = None) -> None:
        """Apply the state changes of every finished job (main thread only); a failed read
        raises, or with ``errors`` is added to it and its entry kept."""
        completed = self.engine.completed
        while completed:
            self._complete(completed.popleft(), errors)

    def _complete(self, job: Job, errors: list[StorageIOError] | None = None) -> None:
        """Apply a finished job's result, once (a job may be seen again in ``completed``)."""
        job.release()  # NOTE [ Releasing jobs ] in runtime.engine
        entry = self.moved.get(job.tensor_id)
        if entry is None or entry.job is not job:
            return
        entry.job = None
        if job.direction == "write":
            self._finish_write(job, entry)
        else:
            self._finish_read(job, entry, errors)

    def _count(self, job: Job) -> None:
        """The bytes of a job that moved them."""
        if job.error is not None or job.cancelled:
            return
        moved = self.stats.bytes_written if job.direction == "write" else self.stats.bytes_read
        moved[job.target] += job.nbytes

    def _finish_write(self, job: Job, entry: _Entry) -> None:
        tid = job.tensor_id
        storage = entry.storage()
        if job.error is not None:
            self.stats.failed_writes += 1
            self._warn_once(f"write-{job.target}",
                            f"could not write {self._describe(tid)} to {job.target} ({job.error}); "
                            "keeping such tensors in memory")
            entry.backend.delete(entry.key)
            del self.moved[tid]
            if (isinstance(job.error, BackendFull) and job.target != "host"
                    and "host" in self.backends and storage is not None and not entry.touched):
                self._offload(tid, storage, "host", urgent=False, priority=job.priority)
            return
        self._count(job)
        if entry.touched or storage is None or job.cancelled:
            self.stats.cancelled_offloads += entry.touched or job.cancelled
            entry.backend.delete(entry.key)
            del self.moved[tid]
            return
        try:
            free_storage(storage)
        except RuntimeError as exc:  # it became unresizable while its bytes were written
            self._keep_resident(tid, entry, exc)
            return
        self.stats.tracked_bytes -= entry.nbytes
        entry.state = Residency.HOST if job.target == "host" else Residency.SSD

    def _keep_resident(self, tid: int, entry: _Entry, exc: BaseException) -> None:
        what = self._describe(tid)
        self.stats.not_resizable.append(what)
        self._warn_once("fixed", f"{what} could not be freed in place ({exc}), so it stays in memory; "
                        "so does every such tensor")
        entry.backend.delete(entry.key)
        del self.moved[tid]

    def _finish_read(self, job: Job, entry: _Entry, errors: list[StorageIOError] | None) -> None:
        tid = job.tensor_id
        if job.error is not None:
            error = StorageIOError(tid, entry.backend.where(entry.key), str(job.error))
            # its bytes are still only in the backend: an exit's restore_all reads it again or
            # keeps its file, never takes the reallocated storage's partial bytes for it
            entry.state = Residency.SSD if entry.target == "ssd" else Residency.HOST
            if errors is None:
                raise error
            errors.append(error)
            return
        self._count(job)
        if entry.keep_for_reuse and not entry.keep_copy:
            entry.keep_for_reuse = False
            entry.state = Residency.DEVICE
            self.copies[tid] = entry  # NOTE [ Copies kept ]: until an op writes it or it goes out
        elif not entry.keep_copy:
            entry.backend.delete(entry.key)
        del self.moved[tid]

    # ---- exits and saves -----------------------------------------------------------
    def restore_all(self, errors: list[StorageIOError] | None = None) -> None:
        """Bring every offloaded tensor back and wait for all transfers. A tensor that cannot
        be read back raises, or with ``errors`` is added to it and left in ``moved`` (its
        bytes in the backend). Every step makes progress: no loop here can spin."""
        for tid in list(self.moved):
            entry = self.moved.get(tid)
            if entry is None:
                continue
            if entry.job is not None:  # its transfer ends it: resident, or a read error kept
                if entry.state is Residency.OFFLOADING:
                    self._needed_again(entry)
                self._await(entry.job)
                self._complete(entry.job, errors)
                continue
            storage = entry.storage()
            if storage is None:  # died on another thread, its free still queued there: apply it
                self.on_free(tid)  # (or a finished run names it "not restored" and keeps its file)
                continue
            # NOTE [ Interrupts ]: with no job in flight, a freed storage or an SSD/HOST entry
            # holds its bytes in the backend; anything else is resident already.
            if storage.nbytes() == 0 or entry.state in (Residency.SSD, Residency.HOST):
                try:
                    self._fetch(tid, entry, urgent=True, for_op=False)
                except (RuntimeError, MemoryError) as exc:  # no memory to bring it back into
                    if errors is None:
                        raise
                    errors.append(StorageIOError(tid, entry.backend.where(entry.key), f"cannot reallocate "
                                                 f"it: {exc}"))
                    continue
                if entry.job is not None:
                    self._await(entry.job)
                    self._complete(entry.job, errors)
            else:
                entry.backend.delete(entry.key)
                del self.moved[tid]
        self._drain(errors)
        self._drop_copies()  # every storage is resident: its copy is not needed

    def _storages_in(self, obj: Any) -> list[torch.UntypedStorage | None]:
        """Every storage of a tensor reachable from ``obj`` as pickle would walk it."""
        found: list[torch.UntypedStorage | None] = []

        class Walk(pickle.Pickler):
            def persistent_id(self, x: Any) -> Any:
                if isinstance(x, torch.Tensor):
                    found.extend(t.untyped_storage() for t in _tensors((x,), {}))
                    return len(found)
                if isinstance(x, torch.UntypedStorage):
                    found.append(x)
                    return len(found)
                if isinstance(x, torch.TypedStorage):  # the legacy ``t.storage()``
                    found.append(x._untyped_storage)
                    return len(found)
                return None

        Walk(_Sink(), protocol=2).dump(obj)
        return found

    @contextmanager
    def resident_for(self, obj: Any) -> Iterator[None]:
        """The offloaded storages of ``obj``'s tensors back for the body (a ``torch.save``,
        which reads storages outside any op); then, on the training thread, freed again, their
        copies kept; on another, kept in for the body (NOTE [ Reads on other threads ])."""
        try:
            with _disable_current_modes():  # the walk's own ops (a sparse tensor's parts) are not the script's
                storages = self._storages_in(obj)
        except Exception:  # noqa: BLE001 - an object pickle cannot walk: bring everything back
            storages = [e.storage() for e in list(self.moved.values())]
        if os.getpid() != self._pid:  # a forked child (a DataLoader worker): no I/O threads here
            out = [self._describe(t) for s in storages if s is not None and (t := self.ids.get(s)) in self.moved]
            if out:
                raise RuntimeError(f"teraio: torch.save in a forked process of {', '.join(out[:3])}, which "
                                   "teraio has moved out of memory: save it in the training process")
            yield
            return
        if threading.get_ident() != self._thread:
            with self.kept_in(storages):
                yield
            return
        refree: list[tuple[int, _Entry]] = []
        with self._lock:
            for storage in storages:
                if storage is None:
                    continue
                tid = self.ids.get(storage)
                entry = self.moved.get(tid) if tid is not None else None
                if entry is None or tid is None:
                    continue
                self._wait(entry, "save")  # an offload in flight finishes first (then it is out)
                entry = self.moved.get(tid)
                if entry is not None and entry.state in (Residency.SSD, Residency.HOST):
                    self._fetch(tid, entry, urgent=True, keep_copy=True, for_op=False)
                    self._wait(entry, "save")
                    self.stats.save_fetches += 1
                    refree.append((tid, entry))
            self._saving += 1  # NOTE [ On demand within the budget ]
        try:
            yield
        finally:
            with self._lock:
                self._saving -= 1
                for tid, entry in refree:
                    storage = entry.storage()
                    if storage is not None and tid not in self.moved and id(storage) in self._held:
                        entry.backend.delete(entry.key)  # it stays in for the other thread's read
                        continue
                    if storage is None or tid in self.moved:
                        continue
                    # NOTE [ Interrupts ]: in ``moved`` before the storage is freed, out once it is
                    entry.state = Residency.DEVICE
                    self.moved[tid] = entry
                    free_storage(storage)
                    self.stats.tracked_bytes -= entry.nbytes
                    entry.state = Residency.HOST if entry.target == "host" else Residency.SSD
                    entry.keep_copy = False

    # ---- NOTE [ Streamed saves ] in runtime.saves ----------------------------------
    @contextmanager
    def streaming(self) -> Iterator[None]:
        """A torch.save that writes out storages from their copies. On a thread other than the
        training thread, a device's storage it pickles is held in memory until it ends (NOTE [
        Streamed saves ] in runtime.saves)."""
        streams = self._streams
        streams.depth = getattr(streams, "depth", 0) + 1
        if streams.depth == 1:
            streams.held = []
        training = threading.get_ident() == self._thread
        with self._lock:
            writing = self._writing
            self._saving += training  # NOTE [ On demand within the budget ]
        try:
            yield
        finally:
            streams.depth -= 1
            with self._lock:
                self._saving -= training
                if training:
                    self._writing = writing
                if not streams.depth:
                    self._release(streams.held)
                    streams.held = []

    def writing_records(self) -> None:
        """The save has pickled and now writes each storage's bytes. On the training thread, its
        copies of a device's storages to host memory (``storage.cpu()``) bring nothing back, an
        out storage's copies nothing, and its record is written from its copy."""
        if threading.get_ident() == self._thread:
            self._writing = True

    def saving_streamed(self) -> bool:
        return getattr(self._streams, "depth", 0) > 0

    @contextmanager
    def only_aliased(self) -> Iterator[None]:
        here = threading.get_ident() == self._thread  # another thread's ops are not seen
        self._aliasing += here
        try:
            yield
        finally:
            self._aliasing -= here

    @_locked
    def pickled_bytes(self, storage: torch.UntypedStorage) -> int:
        """The size ``storage`` is saved at: its recorded size if it is out (freed in place). On
        another thread, a device's storage is brought back and held from now to the save's end
        (torch copies it to host memory unlocked, before its record is written)."""
        tid = self.ids.get(storage)
        if tid is not None and storage.device.type != "cpu" and threading.get_ident() != self._thread:
            self._streams.held.append(storage)  # released at the save's end, whatever _hold raises
            self._hold(tid, storage, bring_back=True)
        entry = self.moved.get(tid) if tid is not None else None
        if entry is not None and entry.state in (Residency.SSD, Residency.HOST):
            return entry.nbytes
        return storage.nbytes()

    def saved_bytes(self, storage: torch.UntypedStorage, pickled: int, data: Any, nbytes: int) -> tuple[Any, int]:
        """What torch.save is to write for ``storage``, given what it read (``data``, ``nbytes``):
        an out storage's copy, read into host memory; one whose read was in flight (on another
        thread, any transfer: the training thread would free it under the write), once done. On
        another thread, a CPU storage in memory is copied, and held there for the copy alone: held
        for its record's write, which takes long beside a busy training, a 4 MiB Adam moment kept
        an iteration run on demand at 1.34x its budget (NOTE [ Streamed saves ] in runtime.saves)."""
        if threading.get_ident() == self._thread:
            with self._lock:
                return self._saved_bytes(self.ids.get(storage), storage, pickled, data, nbytes)
        held: list[torch.UntypedStorage] = []  # alive until released: their ids are theirs
        try:
            with self._lock:
                tid = self.ids.get(storage)
                if tid is not None:
                    held.append(storage)  # released below, whatever _hold raises
                    self._hold(tid, storage, bring_back=False)
                data, nbytes = self._saved_bytes(tid, storage, pickled, data, nbytes)
            _check_saved_size(nbytes, pickled)
            if held and data is storage:  # in memory: its bytes as they are now
                with _disable_current_modes():  # the copy's ops are not the script's
                    copy = torch.empty(nbytes, dtype=torch.uint8, device="cpu")
                    copy.copy_(byte_view(storage))
                return copy.untyped_storage(), nbytes
            return data, nbytes
        finally:
            if held:
                with self._lock:
                    self._release(held)

    def _saved_bytes(self, tid: int | None, storage: torch.UntypedStorage, pickled: int, data: Any, nbytes: int
                     ) -> tuple[Any, int]:
        entry = self.moved.get(tid) if tid is not None else None
        training = threading.get_ident() == self._thread
        if tid is None or (entry is None and training):
            _check_saved_size(nbytes, pickled)
            return data, nbytes
        # on another thread with no entry: held, maybe brought back since torch read its size
        waited = entry is None or entry.job is not None and (entry.state is Residency.FETCHING or not training)
        if entry is not None and entry.job is not None and waited:
            if training:
                self._wait(entry, "save")
            else:
                self._finished(entry.job)
            entry = self.moved.get(tid)
        if entry is not None and entry.state in (Residency.SSD, Residency.HOST):
            try:
                with _disable_current_modes():  # the backend's own ops are not the script's
                    copy = torch.empty(entry.nbytes, dtype=torch.uint8, device="cpu")  # not the script's default
                    entry.backend.read(entry.key, copy)
            except OSError as exc:
                raise StorageIOError(tid, entry.backend.where(entry.key), str(exc)) from exc
            self.stats.bytes_read[entry.target] += entry.nbytes
            self.stats.save_fetches += 1
            return copy.untyped_storage(), entry.nbytes
        if waited:  # in memory, held there (another thread) or by this one: its bytes as they are now
            with _disable_current_modes():
                return (storage if storage.device.type == "cpu" else storage.cpu()), storage.nbytes()
        return data, nbytes  # its write in flight, on this thread: whole until it is done

    # NOTE [ Reads on other threads ]: a script's own thread may read tensors teraio moves: a
    # checkpoint written by ``torch.save`` on a background thread while training goes on (async
    # checkpointing by hand), a ``tolist()``, a deep copy or a DLPack export there. The records of
    # what is out (``moved``, the engine's jobs, the tracked bytes) are the training thread's, and
    # such a read once changed them beside it: a background save of the model's and optimizer's
    # state while the next step ran gave other losses and other final weights than the plain run
    # (2 of 3 runs at the smallest budget), with no error. So the records change under one lock,
    # which the training thread takes around its bookkeeping of each op (not around the op
    # itself), its frees and its boundaries. A read on another thread takes it to bring back
    # what it reads (waiting for a write in flight first; a torch.save there writes what is out
    # of the CPU's memory from its copies instead: NOTE [ Streamed saves ] in runtime.saves),
    # and marks those storages held: while a read holds one, the plan's offloads of it wait (it
    # stays in memory, which may take an iteration over its budget: said once), and go before the
    # training thread's next op once the read is done. What it
    # brought back where a followed plan has it out goes out again before the training thread's
    # next op that does not use it, as after an op of its own (NOTE [ Ops on a tensor going out
    # ]), freed against the copy its read kept: left in until the plan's next offload, a copy no
    # op uses, which the plan sends out once an iteration, stayed in (1.41x the budget with a
    # logger thread reading it every 50 ms).
    # Its waits for its own tensors' transfers count as no stall of the training; a read that must
    # first wait for the training's writes to make room waits as the training would (a stall, and
    # the jobs done meanwhile applied there). The lock is the training process's: a forked child
    # (a DataLoader worker) gets a new one, not one its parent's thread held. A thread that reads a
    # tensor with no patched call (a raw pointer, ``__cuda_array_interface__``) is not seen. On a
    # GPU, a read in a backward hook runs on autograd's device thread and takes this path too.
    @contextmanager
    def kept_in(self, storages: list[torch.UntypedStorage | None]) -> Iterator[None]:
        held: list[torch.UntypedStorage] = []  # alive until released: their ids are theirs
        try:
            with self._lock:
                for storage in storages:
                    tid = self.ids.get(storage) if storage is not None else None
                    if storage is None or tid is None:
                        continue
                    held.append(storage)  # released below, whatever _hold raises
                    self._hold(tid, storage, bring_back=True)
            yield
        finally:
            with self._lock:
                self._release(held)

    def run_elsewhere(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], info: OpInfo) -> Any:
        """NOTE [ Ops on other threads ] in torch_patch.opstream: what the op uses held in memory
        while it runs, and a kept copy of what it writes dropped (stale once written)."""
        ours = [s for s in used_storages(args, kwargs) if self.ids.get(s) is not None]
        if not ours:  # a batch, or what the thread made: nothing to hold, no lock taken
            return func(*args, **kwargs)
        with self.kept_in(list(ours)):
            written = [(s, tid) for s in written_storages(info, args, kwargs) if (tid := self.ids.get(s)) is not None]
            if written:
                with self._lock:
                    for _, tid in written:
                        if tid in self.copies:
                            self._drop_copy(tid, written_over=True)
                        if (entry := self.moved.get(tid)) is not None:
                            entry.keep_for_reuse = False
            return func(*args, **kwargs)

    @contextmanager
    def visited(self, storages: Sequence[torch.UntypedStorage]) -> Iterator[None]:
        """NOTE [ Pointer checks ] in torch_patch.opstream: on the training thread, following a
        plan, what is out comes back for the body alone and goes out again after it."""
        if self.schedule is None or threading.get_ident() != self._thread or self.forked():
            with self._in_memory(storages):
                yield
            return
        out: list[tuple[int, torch.UntypedStorage, str]] = []
        with self._lock:
            for storage in storages:
                tid = self.ids.get(storage)
                entry = self.moved.get(tid) if tid is not None else None
                if tid is None or entry is None:
                    continue
                if entry.state is Residency.OFFLOADING and not entry.touched:
                    self._wait(entry, "pointer check")  # out once written: back for the check, and out again
                    entry = self.moved.get(tid)
                    if entry is None:
                        continue
                if entry.state in (Residency.SSD, Residency.HOST):
                    entry.keep_for_reuse = self.reuse_copies
                    out.append((tid, storage, entry.target))
                self._make_resident(tid, entry)
        try:
            yield
        finally:
            with self._lock:
                for tid, storage, target in out:
                    if self.schedule is not None and tid not in self.moved and self.ids.get(storage) == tid:
                        if not (self.reuse_copies and self._reuse_copy(tid, storage, target)):
                            self._offload(tid, storage, target, urgent=False)

    def _hold(self, tid: int, storage: torch.UntypedStorage, bring_back: bool) -> None:
        """``storage`` held by a read on another thread (until ``_release``), its transfer in
        flight done; if ``bring_back``, in memory."""
        self._held[id(storage)] = self._held.get(id(storage), 0) + 1
        entry = self.moved.get(tid)
        while entry is not None and entry.job is not None:  # a transfer in flight (and
            job = entry.job  # a host write after a full disk's failed one)
            self._finished(job)
            entry = self.moved.get(tid)
            if entry is not None and entry.job is job:  # not applied: never wait for ever
                break
        if bring_back and entry is not None and entry.state in (Residency.SSD, Residency.HOST):
            if self.schedule is not None:  # out again once read (NOTE [ Reads on other threads ])
                self._held_back[tid] = entry.target
                entry.keep_for_reuse = self.reuse_copies and entry.target != "host"
            self._fetch(tid, entry, urgent=True, for_op=False)
            if entry.job is not None:
                self._finished(entry.job)
            self.stats.save_fetches += 1
            self.stats.thread_fetches += threading.get_ident() != self._thread

    def _release(self, held: list[torch.UntypedStorage]) -> None:
        for storage in held:
            n = self._held.pop(id(storage)) - 1
            if n > 0:
                self._held[id(storage)] = n
            elif not self._in_work(storage):
                self._out_after_hold(storage)

    def _finished(self, job: Job) -> None:
        """Wait for ``job`` (served before every job that is not urgent) and apply its result, on a
        thread other than the training thread."""
        if not job.done.is_set():
            self.engine.promote(job)
            self._await(job)
        self._complete(job)

    def _read_elsewhere(self, tid: int, storage: torch.UntypedStorage) -> bool:
        """Whether a read on another thread (NOTE [ Reads on other threads ]) or a collective still in
        flight (NOTE [ Collectives a script waits for ]) holds ``storage`` in memory."""
        if id(storage) in self._held:
            self._warn_once("held", f"{self._describe(tid)} is read on another thread (a torch.save there?) "
                            "when the plan moves it out, so it stays in memory until the read is done; this "
                            "iteration may go over its budget")
            return True
        if self._in_work(storage):
            self.stats.held_by_collectives += 1
            self._warn_once("work", f"{self._describe(tid)} is still used by a collective (one called with "
                            "async_op=True, by the script or a library such as DDP, not waited for yet) when "
                            "the plan moves it out, so it stays in memory until the collective is done; this "
                            "iteration may go over its budget")
            return True
        return False

    # NOTE [ Collectives a script waits for ]: a c10d op (``dist.broadcast(x, 0, async_op=True)``)
    # returns a ``Work`` while the backend still reads and writes its tensors, until the script's
    # ``work.wait()``, which no dispatch mode sees. The planner keeps a tensor in from such an op
    # to the next op on it (NOTE [ Busy in a collective ] in planner.problem), but a script may
    # read the tensor before it waits (the source rank of a broadcast computes on what it sends,
    # as it would on a functional collective's input), and that read starts a period the plan may
    # send the tensor out in: in a 2-rank gloo job at the smallest budget whose rank 1 joined the
    # broadcast 0.3 s late, rank 0 had freed the tensor by then, and rank 1 received other bytes
    # and trained to other losses (4 runs of 4). So every c10d op's work not yet done holds the
    # storages of its tensors in memory, as a read on another thread does: an offload of one
    # waits, and goes before the next op that does not use it once the work is done. Done is:
    # the script waited for it (``Work.wait``, patched in torch_patch.opstream), or it says it is
    # completed (polled before each op while any is pending: DDP's reducer waits in C++, where no
    # patch reaches; on a GPU, the collective's kernel done on its stream). gloo's reduce-scatter
    # (FSDP2's) never says it is completed, even waited for: it copies its result out in the wait.
    # A work nobody waits for that never completes (the fake process group's sends) would hold its
    # storages for ever: at a boundary only the last ``_WORKS_KEPT`` pending works are kept.
    def _track_work(self, obj: torch.ScriptObject, inputs: list[tuple[int, torch.Tensor, bool]]) -> None:
        """Hold the storages of ``inputs`` while ``obj``, an op's c10d ``Work``, is not done."""
        try:
            work = torch._C._distributed_c10d.Work.unbox(obj)
        except (AttributeError, RuntimeError):  # another kind of object, or no torch.distributed
            return
        if not _done(work):
            with self._lock:
                self._works.append((work, [(weakref.ref(t.untyped_storage()), tid) for tid, t, _ in inputs]))

    def _in_work(self, storage: torch.UntypedStorage) -> bool:
        return any(r() is storage for work, refs in self._works for r, _ in refs if not _done(work))

    @_locked
    def waited(self, work: Any) -> None:
        if not self.forked():
            self._forget_works(lambda w: w is work)

    def _forget_works(self, done: Callable[[Any], bool]) -> None:
        """Forget the works ``done``; what the plan sent out while one held it goes out before the
        next op that does not use it (NOTE [ Collectives a script waits for ]). A buffer a work
        held last is freed with it: the script did not hold it, and the buffers its op makes are
        waited for again (NOTE [ Buffers of collectives in flight ])."""
        ended = [done(work) for work, _ in self._works]  # each asked once: one done between two asks would be lost
        if not any(ended):
            return
        refs = [pair for (_, pairs), end in zip(self._works, ended, strict=True) if end for pair in pairs]
        self._works = [w for w, end in zip(self._works, ended, strict=True) if not end]  # the works go
        for ref, tid in refs:
            storage = ref()
            if storage is None:
                self._held_on.discard(tid & ~CARRIED_FLAG)
            elif id(storage) not in self._held and not self._in_work(storage):
                self._out_after_hold(storage)
            del storage

    def _out_after_hold(self, storage: torch.UntypedStorage) -> None:
        """``storage``, no longer held, goes out where the plan sent it meanwhile: before the next
        op that does not use it."""
        tid = self.ids.get(storage)
        target = self._held_back.pop(tid, None) if tid is not None else None
        if tid is not None and target is not None and self.schedule is not None and tid not in self.moved:
            self._again[tid] = (target, False, 0)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"teraio: {message}", RuntimeWarning, stacklevel=3)

    # ---- iterations ----------------------------------------------------------------
    @_locked
    def _boundary(self) -> None:  # end_iteration, renaming, begin_iteration: seen whole elsewhere
        super()._boundary()

    def renamed(self, new_ids: dict[int, int]) -> None:
        # Persistent storages get their names at a boundary and carried ones a flag
        # (profiles.ids): what is keyed by tensor id follows its storage.
        self._renamed = new_ids
        self._busy_before = {new_ids.get(t, t) for t in self._busy_before}
        self.sizes = {new_ids.get(t, t): n for t, n in self.sizes.items()}
        self.moved = {new_ids.get(t, t): e for t, e in self.moved.items()}
        self.copies = {new_ids.get(t, t): e for t, e in self.copies.items()}
        self._left_over = {new_ids.get(t, t): n for t, n in self._left_over.items()}
        self._made_anew = {p: new_ids.get(t, t) for p, t in self._made_anew.items()}
        self._accessed = {i: tuple(new_ids.get(t, t) for t in ids) for i, ids in self._accessed.items()}
        self._out_for_good = {new_ids.get(t, t) for t in self._out_for_good}
        self._let_go = {new for old, new in new_ids.items()  # a name let go (NOTE [ Left over ])
                        if old < PRODUCED_BASE and LONG_BASE <= new < CARRIED_FLAG}
        self._in_collective = {new_ids.get(t, t) for t in self._in_collective}
        for entry in self.moved.values():
            if entry.job is not None:
                entry.job.tensor_id = new_ids.get(entry.job.tensor_id, entry.job.tensor_id)

    def end_iteration(self) -> None:
        schedule = self.schedule
        if schedule is not None and self.op_index != schedule.num_ops:
            self._leave(f"{self.op_index} ops, the plan expects {schedule.num_ops}", self.op_index)
            schedule = None
        elif schedule is not None and self._other_sizes > self._offloads_started:
            self._leave(f"{self._first_other_size} (and {self._other_sizes - 1} more tensors not the "
                        "plan's: other sizes or names)", self.op_index)
            schedule = None
        if self._again:  # the last op used them: no later op sends them (NOTE [ Ops on a tensor going out ])
            self._send_again("the boundary", [])
        self.stats.other_sizes += self._other_sizes
        self.stats.iteration_larger_sizes.append(self._larger)
        self._offloads_started = self._other_sizes = self._larger = 0
        self._first_other_size = None
        self._busy_before, self._busy = self._busy, set()
        self._unhold()  # NOTE [ Buffers of collectives in flight ]
        self._in_collective = {t for t in self._in_collective  # NOTE [ Buffers of collectives in flight ]
                               if (st := self.ids.storage(t)) is not None and self._in_work(st)}
        self._collective_wait_left = _COLLECTIVE_WAIT_S
        self._works = [(w, refs) for w, refs in self._works if not _done(w)][-_WORKS_KEPT:]
        self._used_at.clear()
        if schedule is None:
            self._ending = Ending.ON_DEMAND
        elif schedule is self.steady:
            self._ending = Ending.STEADY
            self.matched_iterations += 1
        else:
            self._ending = Ending.FIRST
        if self.iteration > 0 and self._ending is Ending.ON_DEMAND:
            self._unfollowed(self.left_at or f"iteration {self.iteration}")
        self._renamed = {}
        self.left_at = None
        s = self.stats
        now = time.perf_counter()
        s.iteration_s.append(now - self._iter_t0)
        s.iteration_peak_bytes.append(s.peak_tracked_bytes)
        s.iteration_stall_s.append(s.stall_s - self._iter_stall_s0)
        s.iteration_on_demand_fetches.append(s.on_demand_fetches - self._iter_fetches0)
        self._iter_fetches0 = s.on_demand_fetches
        s.iteration_followed.append(self._ending is not Ending.ON_DEMAND)
        self._iter_stall_s0 = s.stall_s
        self._iter_t0 = now
        for d, (moved0, busy0) in self._iter_moved0.items():
            moved, busy = self.engine.bytes_moved[d], self.engine.busy_now(d)
            s.iteration_moved_bytes[d].append(moved - moved0)
            s.iteration_busy_s[d].append(busy - busy0)
            self._iter_moved0[d] = (moved, busy)
        rss = peak_rss_since_reset()
        if rss is not None:
            s.iteration_peak_rss_bytes.append(rss)
        if torch.cuda.is_initialized():
            s.iteration_peak_cuda_bytes.append(torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
        trim()  # see NOTE [ malloc on CPU ]: without it the heap only grows
        reset_peak_rss()

    def _unfollowed(self, where: str) -> None:
        self.unfollowed.append({"iteration": self.iteration, "left_at": where})
        counted = sum(u["iteration"] >= self.plan.profiled_from for u in self.unfollowed)
        if self.matched_iterations == 0 and counted >= _REFUSE_AFTER:
            raise PlanMismatchError(
                f"the plan was made for another profile: no iteration follows it ({where}). Profile "
                "this script with these arguments (`teraio profile`) and plan again")
        self._warn_once("left", f"{where}: the ops left the plan, so this iteration ran on demand "
                        "(an evaluation, a log line or a checkpoint between steps does this, and so does a "
                        "step a loss scaler skipped); the plan is followed again from the next iteration "
                        "whose ops are its own")

    def begin_iteration(self) -> None:
        self._named = {name: tid for tid, (name, _) in self.persistent.items()}
        # Where names were let go here (a model trained after another took them: NOTE [ Late roots ]
        # in torch_patch.opstream) the named storages are not those the plan's moves sent out in the
        # iteration that ended: they are put where the plan has them. Without it, the second model's
        # weights stayed in, 1.155x over in the iteration after the switch, with some of the
        # machine's measured copy costs.
        self._made_anew = {p: t for p, t in self._made_anew.items()  # a carried part lasts one iteration
                           if not p & CARRIED_FLAG and self.ids.storage(t) is not None}
        boundary = at_boundary(
            self.plan, self.rank, self._ending, renamed=self._renamed, names=self._named,
            live_bytes=self._live_bytes,
            out={t for t, e in self.moved.items() if not e.touched and e.state is not Residency.FETCHING},
            after_first=self.iteration == 1, iteration=self.iteration, names_moved=bool(self._let_go),
            made_anew=self._made_anew, followed_to=self._followed_to)
        self._followed_to = 0
        self.plan_ids = boundary.plan_ids
        self._known_now = None
        self.schedule = self.steady
        self._sent_again.clear()  # ``_again`` was emptied as the iteration ended
        self._held_back.clear()  # what the plan has out differs from here
        for tid, m in boundary.send_out:
            self._settle_kept(tid)
            storage = self.ids.storage(tid)
            if storage is not None and tid not in self.moved:
                self._offload(tid, storage, m.place, urgent=True, name=m.name)
        let_go, self._let_go = self._let_go, set()
        known = (boundary.plan_ids.values() if self._ending is not Ending.FIRST  # NOTE [ Left over ]
                 else [now for plan, now in boundary.plan_ids.items() if plan in self._plan_tids])
        left_over = self._send_left_over(known, let_go)
        self._until_waited.clear()
        self._out_for_good = {t for t in self._out_for_good | let_go | set(left_over) if t in self.moved}
        for tid in [t for t, _ in boundary.send_out] + left_over:
            entry = self.moved.get(tid)
            if entry is not None and entry.state is Residency.OFFLOADING:
                self._wait(entry, "boundary")
        self._left_out.clear()
        for tid in boundary.bring_back:
            entry = self.moved.get(tid)
            if entry is None or tid in self._out_for_good:  # not the plan's: it stays out
                continue
            if self.persistent.get(tid, ("", ""))[1] == "grad":  # NOTE [ Gradients left out ]
                self._left_out.add(tid)
                continue
            if entry.state is Residency.OFFLOADING:
                self._needed_again(entry)
            elif entry.state in (Residency.SSD, Residency.HOST):
                self._fetch(tid, entry, urgent=False)
        self.stats.peak_tracked_bytes = self.stats.tracked_bytes  # the new iteration's peak

    # NOTE [ Gradients left out ]: a boundary comes as the optimizer's step ends, and most scripts
    # drop the gradients (``zero_grad()``, set_to_none) before the next backward pass uses them. A
    # gradient out at the boundary after an iteration run on demand (sent out to keep it within
    # the budget) or after iteration 0 (its plan sent it out), that the steady plan has in because
    # the profile's lived until op 0, was read back for nothing, and its read held its bytes after
    # the script dropped it (the job reads into the storage): a DDP job with a layer some steps
    # skip went 1.13x over its budget at an op that allocated while the read was still queued. So
    # gradients stay out there (only there: after a followed iteration nothing is out that the
    # plan has in). One a script keeps (accumulation, ``zero_grad(set_to_none=False)``, DDP's
    # gradients as bucket views) comes back when an op first needs it, a wait each, and stays: the
    # plan has it in, so it is not sent out again after that op.
    # NOTE [ Left over ]: an iteration run on demand (an evaluation) may make a storage that lives
    # on unused, unknown to the plan: the best weights so far, copied when the validation loss
    # improves. A plan has such copies out (NOTE [ Untouched storages ] in profiles.views), and
    # counts no room for them; a new one was left in memory, 1.62x over the budget in every
    # iteration after. So at the boundary after such an iteration, a storage it made that is still
    # alive (64 KiB or more, of the budget's device, not named nor the plan's) goes out with the
    # plan's, whether ops read it since or not: a pipeline stage keeps the activations of
    # ``schedule.eval()``'s forward passes, which the passes read and no backward frees, until its
    # next step; the last stage's iterations after an evaluation went 2.81x over the budget. One
    # an op reads later comes back for it (a fault). A functional collective's input or result is
    # not (a backend may write or read it until it is waited for). A deep copy's storages, made outside
    # any op, count as made. So does what iteration 0 made under its own plan that the steady plan
    # does not move (DDP's first bucket, made anew in its second step: carried into that step, it
    # was brought back at the boundary and took it to 1.65x the smallest budget); where
    # iteration 0's plan sent such a storage out (for good: NOTE [ The first iteration's plan ] in
    # planner.plan), it stays out. Which of them the steady plan knows is told by its moves, not
    # by the profile's pairs of what iteration 0 carries with what steady iterations do (the
    # bucket was paired with a smaller storage). The cost: a storage made before the loop that
    # the steady plan keeps in and reads (a table held by a plain attribute) goes out once, and
    # iteration 1 reads it back on demand. So does a storage whose
    # name was let go at the boundary (NOTE [ Names let go ] in torch_patch.opstream), whatever
    # the iteration before did: a first model's weights kept as a state dict while a second model
    # trains went on in memory beside the second's, whose iterations followed the plan at 1.36x its
    # budget; one already out stays out (it was brought back as a storage the plan has in). Either
    # stays out at every boundary after, until an op reads it: the boundary after an evaluation run
    # on demand brought back all the plan has in, such copies too, which then stayed in (a deep
    # copy of the model's and the optimizer's state, kept: every iteration after at 2.06x).
    def _send_left_over(self, known: Iterable[int], let_go: Collection[int]) -> list[int]:
        """Send out what the iteration before left over, and the storages ``let_go`` (NOTE [ Left
        over ]); their ids, and after iteration 0 those of the left over already out (they stay out)."""
        left = (self._left_over if self._ending is not Ending.STEADY else {}).keys() | set(let_go)
        self._left_over = {}
        if not left:
            return []
        known = set(known)
        sent = []
        for tid in left:
            storage = self.ids.storage(tid)
            if storage is None or tid in known or tid in self.persistent or storage.device.type != self._device:
                continue
            if (entry := self.moved.get(tid)) is not None:  # iteration 0's plan sent it out for good
                if self._ending is Ending.FIRST and not entry.touched and entry.state is not Residency.FETCHING:
                    sent.append(tid)
            elif storage.nbytes() >= UNTOUCHED_MIN_BYTES and not self.movable(storage):
                # One that cannot move stays, said as this rule's: the warning of a planned move
                # read as the plan failing on a DataLoader worker's batch (in shared memory). Not
                # said after iteration 0: what it made that cannot move (a data set the workers
                # read, made before the loop) the profile saw stay in memory, and the plan counts
                # it there; a sweep's every run warned of its data set so, with nothing to do.
                if self.iteration == 1:  # the boundary after iteration 0, on its plan or on demand
                    continue
                what = self._describe(tid)
                self.stats.not_resizable.append(what)
                self._warn_once("left over", f"{what} cannot be freed in place ({self._why_fixed(storage)}), so "
                                "it stays in memory: an iteration run on demand or iteration 0 left it alive, and "
                                "the plan does not move it; so does every such tensor")
            elif storage.nbytes() >= UNTOUCHED_MIN_BYTES:
                self._offload(tid, storage, self._spill, urgent=True)
                if tid in self.moved:
                    sent.append(tid)
        return sent

    def _live_bytes(self, tid: int) -> int | None:
        """The bytes of the live storage ``tid``, in memory or out (freed in place, its size is 0)."""
        storage = self.ids.storage(tid)
        entry = self.moved.get(tid)
        return None if storage is None else entry.nbytes if entry is not None else storage.nbytes()

    def __enter__(self):  # type: ignore[no-untyped-def]
        out = super().__enter__()
        try:
            # Every torch.save writes through one of torch.serialization's two writers, whatever
            # name the script holds it by (torch.serialization.save, or `from torch import save`
            # run before teraio started): wrap those where this torch has them.
            writers = [name for name in ("_save", "_legacy_save") if hasattr(torch.serialization, name)]
            for name in writers:
                self._patch(torch.serialization, name, self._save)
            if not writers:
                self._patch(torch, "save", self._save)
        except BaseException:  # a Ctrl-C here: leave torch as it was (nothing is out yet)
            self.__exit__(*sys.exc_info())
            raise
        return out

    def _save(self, save: Any) -> Any:
        executor = self
        streamed = streamed_save(self, save)  # NOTE [ Streamed saves ] in runtime.saves

        def save_resident(obj: Any, *args: Any, **kwargs: Any) -> Any:
            if streamed is not None and not executor.forked():
                return streamed(obj, *args, **kwargs)
            with executor.resident_for(obj):
                return save(obj, *args, **kwargs)

        return save_resident

    def __exit__(self, *exc: Any) -> None:
        """Bring every tensor back; those that cannot be stay in ``moved``, their errors in
        ``restore_errors`` (``runtime.api.offload`` keeps their bytes and names them)."""
        self.restore_errors: list[StorageIOError] = []
        if self.forked():  # the parent's records and files are not a forked child's to touch
            super().__exit__(*exc)
            return
        try:
            with signals_held(), self._lock:
                self._drain(self.restore_errors)
                self.restore_all(self.restore_errors)
        finally:
            super().__exit__(*exc)


@contextmanager
def signals_held() -> Iterator[None]:
    """``STOP_SIGNALS`` wait for the body (bringing every tensor back at exit)
    to end, then act as they would have: a second Ctrl-C, or a launcher stopping a job's other
    ranks, must not leave bytes only in swap files. Main thread only; elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[tuple[int, Any]] = []
    before = {sig: h for sig in STOP_SIGNALS if (h := signal.getsignal(sig)) is not None}
    for sig in before:
        signal.signal(sig, lambda signum, frame: held.append((signum, frame)))
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        for signum, frame in held[:1]:
            handler = before[signal.Signals(signum)]
            if callable(handler):
                handler(signum, frame)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(signum)


class _Sink:
    def write(self, data: bytes) -> int:
        return len(data)


def _tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[torch.Tensor]:
    """The tensors among an op's arguments, each as those that hold its bytes (``holders``: a
    sparse one's parts, NOTE [ Sparse tensors ]; a wrapper subclass's tensors)."""
    for t in tensor_args(args, kwargs):
        yield from holders(t)
