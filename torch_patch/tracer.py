"""The profiling tracer: records ops, their timing and every storage access.

``Tracer`` skips ``warmup`` iterations (iteration 0 creates optimizer state),
records until ``iters`` iterations are alike and then raises
``ProfileComplete`` out of the optimizer step (or ``mark_iteration``) that
ended the last one, which stops the training script. ``Tracer.profile()``
returns the recorded ``Profile``, with iteration 0, from the moment the tracer
is entered, as its ``first`` part (NOTE [ The first iteration ] in
``profiles.model``). Op timing is wall time on CPU and CUDA events on GPU.

NOTE [ Steady iterations ]: a real loop is not all alike: an evaluation, a
log line or a checkpoint save between steps adds ops to the iteration it
falls in, and tensor sizes may change from step to step (dynamic padding).
The tracer groups the recorded iterations by their *shape* (op names, the
storages each op accesses and their sizes) and keeps the first group that
reaches ``iters`` members (the largest of the same ops: NOTE [ The larger
shape ]), with every storage any of them had (``_kept_tensors``);
the others are skipped, each with the reason it differs. When ``max_skipped``
iterations have been skipped and no group is complete, it raises
``IrregularIterations`` saying what differed and what to do, so that no
profile holds iterations its reader would reject.
"""

from __future__ import annotations

import difflib
import hashlib
import os
import sys
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch.utils._python_dispatch import _disable_current_modes

from profiles import Profile, TeraioError
from torch_patch.identity import CARRIED_FLAG, INPUT_BASE, LONG_BASE, PRODUCED_BASE, persistent_names
from torch_patch.opstream import OpInfo, OpStream

__all__ = ["IrregularIterations", "IterationSummary", "ProfileComplete", "Tracer", "signature_of"]

_READ, _WRITE = 0, 1


def _allocated(device: torch.device | None) -> tuple[int, int]:
    """CUDA's allocated bytes on ``device`` (None: the current one), now and at their peak since the
    counter was last restarted: one read of the allocator's statistics (``memory_allocated`` and its
    peers make one each), (0, 0) before CUDA has allocated anything there."""
    stats = torch.cuda.memory_stats_as_nested_dict(device).get("allocated_bytes", {}).get("all", {})
    return int(stats.get("current", 0)), int(stats.get("peak", 0))


def _cuda_device(inputs: list[tuple[int, torch.Tensor, bool]]) -> torch.device | None:
    """The device of an op's first CUDA input: the one it allocates on (None: the current one)."""
    return next((t.device for _, t, _ in inputs if t.is_cuda), None)


class ProfileComplete(BaseException):  # noqa: N818 (a control-flow signal, not an error)
    """Raised out of the training script once the requested iterations are recorded."""


def _job_store() -> Any:
    """The store of this process's job (the default process group's), or None: no group, or a
    fake one (one process plays one rank of it)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() == "fake":
        return None
    return dist.distributed_c10d._get_default_store()


def _global_rank(func: Any, args: tuple[Any, ...], peer_arg: int) -> int:
    """The job's rank of a point-to-point op's other end: its argument ``peer_arg`` is a rank
    of the op's process group (a subgroup: a pipeline's, in a job of several dimensions)."""
    import torch.distributed as dist

    rank = int(args[peer_arg])
    names = [a.name for a in func._schema.arguments]
    if "process_group" not in names:
        return rank
    group = torch._C._distributed_c10d.ProcessGroup.unbox(args[names.index("process_group")])
    return rank if group is dist.group.WORLD else dist.get_global_rank(group, rank)


RANK_WAIT_S = 120.0  # NOTE [ Ranks out of step ]
RANK_WAIT_NOTICE_S = 20.0


class IrregularIterations(TeraioError):
    """No ``iters`` recorded iterations were alike (NOTE [ Steady iterations ])."""


class IterationSummary(dict[str, Any]):
    """What ``on_iteration`` receives: iteration, recorded (kept in the profile so far),
    skipped (a reason, if it differs from the others), num_ops, time_us."""


Tables = tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]  # kernels, tensors, accesses


def _shape_key(tables: Tables) -> str:
    """What two iterations must share to be one profile's (NOTE [ Steady iterations ]): their
    op names, and the sizes of the storages their ops access (as a multiset: PyTorch's ZB-V
    schedule accumulates weight gradients in an order that changes from step to step)."""
    kernels, tensors, accesses = tables
    h = hashlib.sha256()
    h.update("\n".join(kernels["op_name"]).encode())
    h.update(np.sort(_accessed_sizes(tables)).tobytes())
    return h.hexdigest()


def _accessed_sizes(tables: Tables) -> np.ndarray:
    """(num_accesses,) int64: the size of the storage of every access."""
    sizes = tables[1].set_index("tensor_id")["size_bytes"]
    return sizes.reindex(tables[2]["tensor_id"]).fillna(-1).to_numpy(np.int64)


# NOTE [ The larger shape ]: a loop whose every third step has a smaller batch (the last of a
# short epoch, or a rank's share under a DistributedSampler) records three shapes of the same
# ops where the step's tail (after the optimizer's step, so in the next iteration) reads the
# batch: the small head, the small tail, neither. The first shape with ``iters`` iterations was
# the small head's, and a plan made for it ran the full batches' iterations as its own, their
# larger activations left in: iterations 3, 4 and 6 of such a script at 1.20x the budget. So a
# complete shape is kept only once no shape of the same ops with more bytes waits for its
# ``iters``, for at most ``max_skipped`` recorded iterations beyond the ``iters`` kept (a larger
# first batch that never comes again), and of complete shapes of the first one's ops the largest
# (a shape of other ops, an evaluation's, is never preferred for its bytes: the test suite found
# an averaged model's evaluations kept over its training steps). A plan for the larger shape
# runs a smaller one with its offloads of other sizes left alone (NOTE [ Other sizes ] in
# runtime.executor), which the same script held within 0.95x.
def _bytes(tables: Tables) -> int:
    return int(tables[1]["size_bytes"].sum())


def _larger(a: Tables, b: Tables) -> bool:
    """Whether iteration ``a`` runs ``b``'s ops on more bytes (NOTE [ The larger shape ])."""
    return a[0]["op_name"].tolist() == b[0]["op_name"].tolist() and _bytes(a) > _bytes(b)


def _difference(a: Tables, b: Tables) -> tuple[str, bool, bool]:
    """How iteration tables ``b`` differ from ``a``, in words; whether only sizes differ; and
    whether sizes differ first (alone, or before the ops do: a packed sequence of other lengths
    runs other ops, and so does an evaluation on batches of another size).

    An op on another parameter or state than the same op's there (a branch some steps take, into a
    layer of the ops of the one it skips) differs in its ops, not its sizes, where it comes first:
    a sweep found such a branch told to pad its batches."""
    names_a, names_b = a[0]["op_name"].tolist(), b[0]["op_name"].tolist()
    sizes_a, sizes_b = _accessed_sizes(a), _accessed_sizes(b)
    ids_a, ids_b = a[2]["tensor_id"].to_numpy(), b[2]["tensor_id"].to_numpy()
    if names_a != names_b:
        k = next((i for i, (x, y) in enumerate(zip(names_a, names_b, strict=False)) if x != y),
                 min(len(names_a), len(names_b)))
        what = (f"op {k} is {names_b[k]}, not {names_a[k]}" if k < min(len(names_a), len(names_b))
                else f"it has {len(names_b)} ops, not {len(names_a)}")
        # the same ops before op k: their accesses align; those of carried storages (a last
        # evaluation's output, read at op 0) differ between iterations of one shape
        ops_a, ops_b = a[2]["op_index"].to_numpy(), b[2]["op_index"].to_numpy()
        before_a, before_b = ops_a < k, ops_b < k
        if before_a.sum() == before_b.sum():
            a_ids, b_ids = ids_a[before_a], ids_b[before_b]
            a_sizes, b_sizes = sizes_a[before_a], sizes_b[before_b]
            own = (a_ids & CARRIED_FLAG == 0) & (b_ids & CARRIED_FLAG == 0)
            i = _first_size_change(own & (a_sizes != b_sizes), own & _on_other_named(a_ids, b_ids))
            if i is not None:
                op = int(ops_b[before_b][i])
                return f"op {op} uses a tensor of {b_sizes[i]:,} bytes, not {a_sizes[i]:,}, and {what}", False, True
        return what, False, False
    if len(sizes_a) == len(sizes_b):
        other = _on_other_named(ids_a, ids_b)
        i = _first_size_change(sizes_a != sizes_b, other)
        if i is not None:
            op = int(b[2]["op_index"].iloc[i])
            return f"op {op} uses a tensor of {sizes_b[i]:,} bytes, not {sizes_a[i]:,}", True, True
        if other.any():
            op = int(b[2]["op_index"].iloc[int(np.argmax(other))])
            return f"op {op} uses another parameter or state than the kept iterations' op {op}", False, False
    return f"its ops use {len(sizes_b)} tensors, not {len(sizes_a)}", False, False


def _on_other_named(ids_a: np.ndarray, ids_b: np.ndarray) -> np.ndarray:
    """Of aligned accesses, those where one is on a parameter or state (a persistent id) and the
    other is not on it. Not a long-lived storage's: its id is the one it was given when it became
    long-lived (a data set made before the loop is carried into iteration 1 and long-lived from
    iteration 2: NOTE [ Kept for good ]), so two iterations may name one storage otherwise (a
    review found a smaller last batch of such a data set said to run other ops)."""
    bare_a, bare_b = ids_a & ~CARRIED_FLAG, ids_b & ~CARRIED_FLAG
    return ((bare_a < PRODUCED_BASE) | (bare_b < PRODUCED_BASE)) & (bare_a != bare_b)


def _first_size_change(differ: np.ndarray, other: np.ndarray) -> int | None:
    """The first of the aligned accesses whose tensor's size differs (``differ``), unless one on
    another parameter or state (``other``) comes first or with it (the ops differ there); None
    where none differs so."""
    if not differ.any():
        return None
    i = int(np.argmax(differ))
    return None if other.any() and int(np.argmax(other)) <= i else i


def _kept_tensors(group: list[Tables]) -> pd.DataFrame:
    """The tensor rows of iterations of one shape: every storage any of them had, each with
    the widest lifetime and the largest size seen. Storages that no op accesses may live longer in one iteration
    than in another: a storage a collective held is freed when the backend's thread lets it
    go (NOTE [ Frees on other threads ] in torch_patch.identity), and an evaluation's results
    may stay bound to a name. Counting the longest is the safe side for memory."""
    rows = pd.concat([t for _, t, _ in group], ignore_index=True)
    first = rows.drop_duplicates("tensor_id").set_index("tensor_id")
    first["size_bytes"] = rows.groupby("tensor_id")["size_bytes"].max()
    life = rows.groupby("tensor_id")[["alloc_op", "free_op"]].nunique()
    ids = life.index[(life["alloc_op"] > 1) | (life["free_op"] > 1)]
    if len(ids):
        alloc, free = _widest_lifetimes(rows[rows["tensor_id"].isin(ids)])
        first.loc[alloc.index, "alloc_op"] = alloc
        first.loc[free.index, "free_op"] = free
        first.loc[ids, "persistent"] = (alloc < 0) & (free < 0) | (alloc >= 0) & (free >= 0) & (free <= alloc)
    first["resizable"] = rows.groupby("tensor_id")["resizable"].all()
    return first.reset_index()[list(rows.columns)].sort_values("tensor_id", ignore_index=True)


def _widest_lifetimes(rows: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """(alloc_op, free_op) by tensor id: one lifetime that holds each of ``rows``' lifetimes of
    that id (NOTE [ Wrapping lifetimes ] in profiles.schema). A storage made late in each
    iteration and freed early in the next (a variable carried over the boundary: MAML's fast
    weights) stays a wrapping lifetime from its earliest making to its latest free, not one
    alive throughout: its making is an allocation the runtime must wait for room for."""
    alloc, free = rows["alloc_op"], rows["free_op"]
    wraps = (alloc >= 0) & (free >= 0) & (free <= alloc)
    by = rows.assign(whole=(alloc < 0) & (free < 0), at_start=(alloc < 0) | wraps, at_end=(free < 0) | wraps,
                     made=alloc.where(alloc >= 0), freed=free.where(free >= 0)).groupby("tensor_id")
    whole, at_start, at_end = by["whole"].any(), by["at_start"].any(), by["at_end"].any()
    made, freed = by["made"].min(), by["freed"].max()  # NaN: never made, never freed in an iteration
    # alive at the start and at the end: wrapping if the latest free comes by the earliest making
    whole |= at_start & at_end & ~(freed <= made)
    new_alloc = made.where(at_end | ~at_start, -1).where(~whole, -1)
    new_free = freed.where(at_start | ~at_end, -1).where(~whole, -1)
    return new_alloc.astype(np.int32), new_free.astype(np.int32)


def signature_of(op_names: list[str], sizes: dict[int, int]) -> str:
    """SHA-256 over one rank's op-name sequence and storage sizes (by tensor id)."""
    h = hashlib.sha256()
    h.update("\n".join(op_names).encode())
    for tid in sorted(sizes):
        h.update(f"{tid}:{sizes[tid]};".encode())
    return h.hexdigest()


class _Iteration:
    """The raw record of one iteration, in flat lists (cheap to append)."""

    def __init__(self, carried: dict[int, int]) -> None:
        self.carried = carried  # tensor id -> size of storages alive at the start
        self.op_names: list[str] = []
        self.phases: list[str] = []
        self.modules: list[str | None] = []
        self.start_ns: list[float] = []
        self.dur_ns: list[float] = []
        self.peers: list[int] = []  # the other rank of a point-to-point op, else -1
        self.scratch: list[int] = []  # CUDA: bytes each op allocated inside itself (NOTE [ Scratch ])
        self.acc_op: list[int] = []
        self.acc_tid: list[int] = []
        self.acc_kind: list[int] = []
        self.alloc: dict[int, int] = {}  # tensor id -> op index
        self.frees: dict[int, int] = {}  # tensor id -> first op it is not alive at
        self.events: list[tuple[Any, Any] | None] = []  # CUDA clock: each op's (start, end) events

    def timed(self, start_ns: float, dur_ns: float, scratch: int = 0, events: tuple[Any, Any] | None = None) -> None:
        """Record an op's timing: on the host's clock, or its CUDA ``events`` (NOTE [ Clock ])."""
        self.start_ns.append(start_ns)
        self.dur_ns.append(dur_ns)
        self.scratch.append(scratch)
        self.events.append(events)


def _fingerprint(storage: torch.UntypedStorage) -> torch.Tensor:
    """The wrapping 64-bit sum of ``storage``'s 8-byte words and of its last bytes, on its device,
    with no copy of it (a sum of narrower words converts them all first: 2-8 times the storage)."""
    data = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    n = storage.nbytes() // 8 * 8
    return data[:n].view(torch.int64).sum() + data[n:].sum(dtype=torch.int64)


_Ids = frozenset[tuple[int, int]]


def _kept_in_memory(tensors: pd.DataFrame, unseen: set[tuple[int, int]], iteration: int,
                    aligned: dict[int, int]) -> pd.DataFrame:
    """The tensors table of ``iteration`` with the storages written where teraio cannot see
    marked not resizable (never moved): ``unseen`` holds their (iteration, tensor id) pairs,
    ``aligned`` the renames of its carried ids in its tables (NOTE [ Writes teraio cannot see ])."""
    ids = [aligned.get(tid, tid) for it, tid in unseen if it == iteration]
    if not ids:
        return tensors
    return tensors.assign(resizable=tensors["resizable"] & ~tensors["tensor_id"].isin(ids))


class Tracer(OpStream):
    def __init__(
        self,
        warmup: int = 1,
        iters: int = 2,
        on_iteration: Callable[[IterationSummary], None] | None = None,
        cuda_timing: bool | None = None,
        max_skipped: int = 4,
    ) -> None:
        super().__init__()
        if warmup < 1:
            raise ValueError("warmup must be at least 1: iteration 0 creates optimizer state")
        if iters < 1:
            raise ValueError("iters must be at least 1")
        self.warmup = warmup
        self.iters = iters
        self.max_skipped = max_skipped
        self._place: tuple[int, int] | None = None
        self.on_iteration = on_iteration
        # NOTE [ Clock ]: the clock is CUDA's events once the script has touched a CUDA tensor,
        # the host's before that and for a script that never does (None: choose so; a bool forces it)
        self.cuda_timing = bool(cuda_timing)
        self._choose_clock = cuda_timing is None and torch.cuda.is_available()
        # CUDA's allocated peak over the ops recorded so far and what ran before them, which
        # ``torch.cuda.max_memory_allocated`` no longer gives (NOTE [ Scratch ])
        self.cuda_peak_bytes = 0
        self.sizes: dict[int, int] = {}
        self.dtypes: dict[int, str] = {}
        self.kinds: dict[int, str] = {}
        self.names: dict[int, str | None] = {}
        self.resizable: dict[int, bool] = {}
        self.alloc_phase: dict[int, str] = {}
        # the steady iterations kept, by number (NOTE [ Steady iterations ])
        self.done: list[tuple[int, Tables]] = []
        self._complete = False  # every rank has its steady iterations: stop at this boundary's end
        self.groups: dict[str, list[tuple[int, Tables]]] = {}  # shape -> (iteration, tables)
        self.skipped: list[dict[str, Any]] = []  # {"iteration", "reason"} of those not kept
        self.first: Tables | None = None  # iteration 0
        self._boundary_at: float | None = None  # time.monotonic() at the last boundary
        self._longest_s = 0.0  # the longest step so far: from one boundary to the next
        self.rank_wait_s = RANK_WAIT_S  # NOTE [ Ranks out of step ]
        self.first_carried: dict[int, int] = {}  # steady id -> its id in iteration 1, made in 0
        self._long_after: dict[int, dict[int, int]] = {}  # iteration -> flagged id -> long id taken at its end
        self._rec: _Iteration | None = None
        self._t0 = time.perf_counter_ns()
        self._now = time.perf_counter_ns
        # NOTE [ Writes teraio cannot see ]: the named storages' fingerprints at the last
        # boundary, the storages ops wrote since, and the names written unseen
        # name (or, unnamed, the storage's id()) -> (the storage, its fingerprint at the last
        # boundary, and unnamed, the (iteration, tensor id) it had at each boundary so far)
        self._prints: dict[str | int, tuple[weakref.ref[torch.UntypedStorage], int, _Ids]] = {}
        # the unnamed storages written unseen, and the (iteration, tensor id) of each, for the
        # tables of the iterations they were in (ids recur: another iteration's may be another's)
        self._unseen_unnamed: weakref.WeakSet[torch.UntypedStorage] = weakref.WeakSet()
        self.num_unseen_unnamed = 0
        self._unseen_at: set[tuple[int, int]] = set()
        self._aligned: dict[int, dict[int, int]] = {}  # iteration -> its carried ids' renames in its tables
        self._written: set[int] = set()
        self.written_unseen: set[str] = set()

    @property
    def rank(self) -> int:
        return self.place()[0]

    @property
    def world_size(self) -> int:
        return self.place()[1]

    def place(self) -> tuple[int, int]:
        """(rank, world size) of this process: its process group's, once the script made one
        (a fake process group too), else torchrun's environment's."""
        if self._place is None:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                self._place = (dist.get_rank(), dist.get_world_size())
            else:
                return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        return self._place

    @property
    def recording(self) -> bool:
        return self._rec is not None

    # ---- per op ---------------------------------------------------------------
    def run_op(self, index, func, args, kwargs, inputs):  # type: ignore[no-untyped-def]
        rec = self._rec
        if rec is None:
            return func(*args, **kwargs)
        self._note_peer(rec, func, args)
        t0 = self._now()
        if self.cuda_timing:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            device = _cuda_device(inputs)
            before, peak_before = _allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            start.record()
            out = func(*args, **kwargs)
            end.record()
            after, peak = _allocated(device)
            self.cuda_peak_bytes = max(self.cuda_peak_bytes, peak_before, peak)
            rec.timed(t0, 0.0, max(0, peak - max(before, after)), (start, end))
        else:
            out = func(*args, **kwargs)
            rec.timed(t0, float(self._now() - t0))
        return out

    # NOTE [ Scratch ]: on CUDA an op may allocate memory inside itself and free it before it
    # returns, below the dispatcher where teraio sees no storage: ``_softmax_backward_data``
    # allocates a buffer the size of its output (512 MiB for the 2k GPU example's attention
    # scores), a reduction its partial sums. Measured on an H200, this put CUDA's peak 577 MiB
    # over a 2,713 MiB plan whose tracked bytes were on budget; with the scratch planned for, 65
    # MiB over (what libraries allocate once and hold, outside any op). The tracer records each op's
    # scratch, the allocator's peak during the op over the larger of what was allocated before
    # and after it, on the device of its first CUDA input (the peak counter is restarted before
    # each op: a script that reads ``torch.cuda.max_memory_allocated`` under `teraio profile` sees
    # a single op's peak; ``Tracer.cuda_peak_bytes`` holds the run's), and the planner counts it as
    # memory the op needs while it runs (``PlanProblem.scratch_bytes``). What another thread
    # allocates on the device while an op runs (a loader that copies batches to the GPU on a thread
    # of its own) counts as that op's scratch, which only leaves more room. On the CPU nothing
    # measures it: 0.
    # NOTE [ Clock ]: an op on CUDA returns once its kernels are queued, so the host's clock would
    # time the launch; CUDA events time the kernels. Which clock to use is the script's choice of
    # device, not the machine's: a script that trains on the CPU, profiled on a machine with a GPU,
    # must keep the host's clock (with events it records ops of about 0 us and a `cuda` profile).
    # So the tracer times with the host's clock until an op's input or output is a CUDA tensor, and
    # with events from the next op on; the iteration where that happens (iteration 0, where a
    # script moves its model to the GPU) places the event-timed ops on the host's time line from
    # the first of them. A script that keeps its model on the CPU and puts one tensor on a GPU gets
    # the CUDA clock for its CPU ops too, which times them as about 0 us: not supported.
    def _note_peer(self, rec: _Iteration, func: Any, args: tuple[Any, ...]) -> None:
        peer_arg = self._infos[func].peer_arg
        rec.peers.append(-1 if peer_arg is None or peer_arg >= len(args) else _global_rank(func, args, peer_arg))

    def after_op(self, index: int, info: OpInfo, inputs: list[tuple[int, torch.Tensor, bool]],
                 outputs: list[tuple[int, torch.Tensor, bool]]) -> None:
        if self._choose_clock and not self.cuda_timing:
            self.cuda_timing = any(t.is_cuda for _, t, _ in inputs) or any(t.is_cuda for _, t, _ in outputs)
        written = self._written  # an ``out=`` argument is among them: its schema marks it written
        for tid, _, write in inputs:
            if write:
                written.add(tid)
        rec = self._rec
        if rec is None:
            for tid, t, new in outputs:  # keep sizes of storages that outlive the warm-up
                if new:
                    self._note(tid, t, t.untyped_storage())
            for tid, t, _ in inputs:
                if tid not in self.sizes:
                    self._note(tid, t, self.input_storage(tid, t))
            return
        phase = self.phase()
        rec.op_names.append(info.name)
        rec.phases.append(phase)
        rec.modules.append(self.module())
        acc_op, acc_tid, acc_kind = rec.acc_op, rec.acc_tid, rec.acc_kind
        for tid, t, write in inputs:
            if tid not in rec.alloc and tid not in rec.carried:  # made outside any op
                self._note(tid, t, self.input_storage(tid, t))
                rec.alloc[tid] = index
                self.alloc_phase[tid] = phase
            elif tid not in self.dtypes:
                self._note(tid, t, self.input_storage(tid, t))
            acc_op.append(index)
            acc_tid.append(tid)
            acc_kind.append(_WRITE if write else _READ)
        for tid, t, new in outputs:
            if new:
                self._note(tid, t, t.untyped_storage())
                rec.alloc[tid] = index
                self.alloc_phase[tid] = phase
                acc_op.append(index)
                acc_tid.append(tid)
                acc_kind.append(_WRITE)

    # A storage on the meta device has a size and no memory (a module skeleton that
    # ``torch.func.functional_call`` runs with real weights): it counts as empty. Under fake mode
    # every storage is a meta one standing for the device's memory (NOTE [ The script's meta
    # tensors ] in torch_patch.fake).
    def _bytes(self, storage: torch.UntypedStorage) -> int:
        """The memory ``storage`` holds."""
        return 0 if storage.device.type == "meta" else storage.nbytes()

    def _note(self, tid: int, t: torch.Tensor, storage: torch.UntypedStorage | None) -> None:
        """Size, dtype and resizability of ``tid``, whose storage is ``storage`` (None: an input's
        storage gone during its op, ``input_storage``, counted as empty)."""
        self.sizes[tid] = self._bytes(storage) if storage is not None else 0
        self.dtypes[tid] = str(t.dtype).removeprefix("torch.")
        self.resizable[tid] = storage is not None and self.movable(storage)

    def on_foreign(self, storage: torch.UntypedStorage) -> None:
        tid = self.ids.get(storage)
        if tid is not None:
            self.resizable[tid] = False

    def on_free(self, tensor_id: int) -> None:
        rec = self._rec
        if rec is not None:
            rec.frees[tensor_id] = self.op_index

    # ---- iterations -------------------------------------------------------------
    def _record(self) -> None:
        """Start recording an iteration, with the storages alive now as carried into it."""
        # Each storage at its size now; one freed in place (FSDP2's unsharded parameters between
        # uses) at the size it was noted at. A carried id recurs every iteration for another
        # storage (profiles.ids), so the size noted under it may be an earlier one's.
        storages = self.ids.live()
        live = {tid: self._bytes(s) if s.nbytes() or s not in self.foreign else self.sizes.get(tid, 0)
                for tid, s in storages.items()}
        self.sizes.update(live)
        # and whether it may move, under the id it has now (one only data loading reads is
        # never noted by an op: NOTE [ Data loading is not counted ] in torch_patch.opstream)
        self.resizable.update({tid: self.movable(s) for tid, s in storages.items()})
        self._rec = _Iteration(live)
        self._t0 = self._now()
        if self.cuda_timing:
            torch.cuda.synchronize()

    def begin_iteration(self) -> None:
        if self._complete:
            raise ProfileComplete
        # Iteration 1 is traced even as a warm-up one: the storages iteration 0 hands to it
        # are mapped to their steady ids there (``first_carried``). A rank that has its
        # steady iterations records no more while the others finish theirs.
        if (self.iteration >= self.warmup and not self.done) or self.iteration == 1:
            self._record()

    def __enter__(self):  # type: ignore[no-untyped-def]
        out = super().__enter__()
        self._record()  # iteration 0
        return out

    # NOTE [ Writes teraio cannot see ]: an extension's kernel called directly (apex's and
    # DeepSpeed's fused Adam, bitsandbytes' 8-bit optimizers, a CUDA graph replayed) or an op on
    # another thread writes tensors below teraio's dispatch mode. A parameter such an optimizer
    # updates looks unchanged to teraio, so `teraio run` freed it against the copy it had kept
    # from before the update (NOTE [ Copies kept ] in planner.clean), and the update was lost:
    # an optimizer that wrote each parameter through ctypes trained to other losses from step 2
    # on under a plan at the smallest budget. It may also read tensors teraio has out. So at each
    # boundary the tracer takes a fingerprint of every named storage (parameters, buffers,
    # gradients, optimizer state: the wrapping 64-bit sum of its 8-byte words, ``_fingerprint``),
    # and one that lived through the iteration since the boundary before and changed in it, with
    # no op that teraio saw writing it there, is named in the profile (``written_unseen``). The
    # planner then moves none of the named storages: the code that wrote them may read any of them.
    # Not seen: a write that leaves the sum unchanged; an unseen write in an iteration where an op
    # also wrote the storage; a read alone; a write to a storage made in the same iteration
    # (gradients under ``zero_grad(set_to_none=True)``, which an extension that clips or unscales
    # them writes so).
    # Storages no module or optimizer names (a batch buffer a background thread fills again each
    # step) get the same check: one alive through an iteration that changed in it unseen is kept
    # in memory, marked not resizable (``num_unseen_unnamed`` counts them), as freeing it
    # while that code writes it would crash the process; the named ones stay movable then.
    def _fingerprints(self) -> None:
        """Compare every storage alive at this boundary with its fingerprint at the boundary
        before, and take new ones (NOTE [ Writes teraio cannot see ])."""
        named, _ = persistent_names(self.named_roots(), self.optimizers())
        keyed: list[tuple[str | int, torch.UntypedStorage]] = [(pn.name, pn.storage) for pn in named]
        seen = {id(s) for _, s in keyed}
        keyed += [(id(s), s) for s in self.ids.live().values() if id(s) not in seen]
        # (meta storages of fake mode and FSDP2's freed unsharded ones left out)
        keyed = [(k, s) for k, s in keyed if s.device.type in ("cpu", "cuda") and s.nbytes()]
        with _disable_current_modes(), torch.no_grad():  # not ops of the script's
            sums = [_fingerprint(s) for _, s in keyed]
            values = [0] * len(sums)
            for device in {v.device for v in sums}:  # one copy to the host per device
                at = [i for i, v in enumerate(sums) if v.device == device]
                for i, v in zip(at, torch.stack([sums[i] for i in at]).tolist(), strict=True):
                    values[i] = int(v)
        prints: dict[str | int, tuple[weakref.ref[torch.UntypedStorage], int, _Ids]] = {}
        for (key, storage), value in zip(keyed, values, strict=True):
            before = self._prints.get(key)
            if before is not None and before[0]() is not storage:
                before = None
            tid = self.ids.get(storage)
            ids = before[2] if before is not None else frozenset()
            if isinstance(key, int) and tid is not None:
                ids |= {(self.iteration, tid)}
            prints[key] = (weakref.ref(storage), value, ids)
            if isinstance(key, int) and storage in self._unseen_unnamed:
                self._unseen_at |= ids  # its id in this iteration too
            if before is None or before[1] == value or (tid is not None and tid in self._written):
                continue
            if isinstance(key, str):
                self.written_unseen.add(key)
            else:
                self.num_unseen_unnamed += storage not in self._unseen_unnamed
                self._unseen_unnamed.add(storage)
                self._unseen_at |= ids
        self._prints = prints
        self._written = set()

    def end_iteration(self) -> None:
        now = time.monotonic()
        if self._boundary_at is not None:
            self._longest_s = max(self._longest_s, now - self._boundary_at)
        self._boundary_at = now
        self._fingerprints()
        rec = self._rec
        recorded = self.iteration >= self.warmup
        summary = IterationSummary(iteration=self.iteration, recorded=False, skipped=None,
                                   num_ops=self.op_index, time_us=None)
        status = "done" if self.done else "more"
        if rec is not None:
            # a storage that became unmovable since an op noted it (``.numpy()`` of a gradient,
            # which PyTorch then keeps from resizing) is so in this iteration's rows
            for tid, storage in self.ids.live().items():
                if self.resizable.get(tid) and not self.movable(storage):
                    self.resizable[tid] = False
            tables = self._close(rec)
            self._rec = None
            if self.iteration == 0:
                self.first = tables
            elif recorded and not self.done:
                k = tables[0]
                summary["time_us"] = float((k["start_us"] + k["duration_us"]).max()) if len(k) else 0.0
                status = self._keep(tables, summary)
        if self.on_iteration is not None:
            self.on_iteration(summary)
        if not recorded:
            return
        statuses = self._agree(status)
        self._boundary_at = time.monotonic()  # a wait for the others is not this rank's step
        if statuses[self.rank] == "irregular":
            raise IrregularIterations(self.irregular_message() or "the recorded iterations are not alike")
        if "irregular" in statuses:
            raise IrregularIterations(f"rank {statuses.index('irregular')}'s recorded iterations are not "
                                      "alike (its error says how); this rank stops with it")
        if all(s == "done" for s in statuses):
            self._complete = True  # raised once the boundary has named what it carries (NOTE [ Kept for good ])

    # NOTE [ Ranks stop together ]: each rank of a job keeps its own steady iterations, but
    # they must all stop at the same boundary, or a rank still training waits for ever in
    # a collective with one that stopped. At every recorded boundary each rank says, through
    # the job's store (torchrun's), whether it has what it needs, and reads every rank's
    # word: all stop once all are done; all stop with an error if one cannot be done.
    def _agree(self, status: str) -> list[str]:
        """Every rank's status at this boundary (``done``, ``more`` or ``irregular``)."""
        store = _job_store() if self.world_size > 1 else None
        if store is None:
            return [status] * max(self.world_size, self.rank + 1)
        prefix = f"teraio/profile/{self.iteration}"
        store.set(f"{prefix}/{self.rank}", status)
        keys = [f"{prefix}/{r}" for r in range(self.world_size)]
        self._wait_for_ranks(store, keys)
        return [store.get(k).decode() for k in keys]

    # NOTE [ Ranks out of step ]: the ranks meet at each boundary only if each does the same
    # steps. One that runs out of data first (DDP's ``join()`` with uneven inputs: it then
    # shadows the others' all-reduces, stepping no optimizer) or does more steps than the others
    # never comes, while it may itself wait for this rank in a collective: the job would hang
    # until the process group's timeout (30 minutes on gloo), then blame the script. So a rank
    # waits for the others' word at most ``rank_wait_s`` (`teraio profile --rank-wait`), or 10
    # times its longest step if that is longer (ranks in step arrive within about one optimizer
    # step of each other), saying after RANK_WAIT_NOTICE_S why it waits, and then stops the job
    # with an error naming who is late.
    def _wait_for_ranks(self, store: Any, keys: list[str]) -> None:
        limit_s = max(self.rank_wait_s, 10 * self._longest_s)
        start, pause, noticed = time.monotonic(), 0.0005, False

        def late() -> str:
            return ", ".join(str(r) for r, k in enumerate(keys) if not store.check([k]))

        while not store.check(keys):
            waited_s = time.monotonic() - start
            if waited_s > limit_s:
                raise IrregularIterations(
                    f"rank {self.rank} waited {waited_s:.0f} s at the end of iteration {self.iteration} "
                    f"for rank {late()}, which has not ended its iteration {self.iteration}: the ranks do not "
                    "step together (a rank that ran out of data, as with DDP's join() and uneven inputs, "
                    "or one that steps more often than the others?); a profile needs every rank to take "
                    "the same steps until it has its warmup + iters iterations (a long evaluation or "
                    "save on one rank inside them: raise --rank-wait)")
            if waited_s > min(RANK_WAIT_NOTICE_S, limit_s / 2) and not noticed:
                noticed = True
                warnings.warn(f"teraio: rank {self.rank} has waited {waited_s:.0f} s at the end of iteration "
                              f"{self.iteration} for rank {late()} (NOTE [ Ranks out of step ] in "
                              f"torch_patch/tracer.py); it stops the job after {limit_s:.0f} s (--rank-wait)",
                              stacklevel=1)
            time.sleep(pause)
            pause = min(2 * pause, 0.05)

    def _keep(self, tables: Tables, summary: IterationSummary) -> str:
        """File a recorded iteration by its shape (NOTE [ Steady iterations ]); ``done`` once
        ``iters`` are alike (and no larger shape of the same ops is on its way), ``irregular``
        when too many were set aside, else ``more``."""
        group = self.groups.setdefault(_shape_key(tables), [])
        group.append((self.iteration, tables))
        biggest = max(self.groups.values(), key=len)
        summary["recorded"] = group is biggest
        if group is not biggest:
            summary["skipped"] = f"differs from iteration {biggest[0][0]}: {_difference(biggest[0][1], tables)[0]}"
        too_many = sum(len(g) for g in self.groups.values()) - len(biggest) > self.max_skipped
        kept = self._complete_shape()
        if kept is None:
            return "irregular" if too_many else "more"
        waited = sum(len(g) for g in self.groups.values()) - self.iters  # recorded, not to be kept
        if waited <= self.max_skipped and any(len(g) < self.iters and _larger(g[0][1], kept[0][1])
                                              for g in self.groups.values()):
            return "more"  # NOTE [ The larger shape ]
        self._keep_shape(kept)
        return "done"

    def _complete_shape(self) -> list[tuple[int, Tables]] | None:
        """The first shape to have ``iters`` iterations, or one of the same ops and more bytes
        that has them too (NOTE [ The larger shape ]); None while there is none."""
        complete = [g for g in self.groups.values() if len(g) >= self.iters]
        if not complete:
            return None
        first = min(complete, key=lambda g: g[self.iters - 1][0])
        return max((g for g in complete if g is first or _larger(g[0][1], first[0][1])), key=lambda g: _bytes(g[0][1]))

    def _keep_shape(self, group: list[tuple[int, Tables]]) -> None:
        self.done = group[:self.iters]
        self.skipped = [{"iteration": it, "reason": why, "sizes_only": sizes_only, "sizes_first": sizes_first,
                         "num_ops": len(t[0])}
                        for g in self.groups.values() if g is not group for it, t in g
                        for why, sizes_only, sizes_first in [_difference(self.done[0][1], t)]]

    def settle(self) -> bool:
        """At the script's end: keep a complete shape that waited for a larger one which did not
        come (NOTE [ The larger shape ]); whether the profile has its iterations."""
        kept = None if self.done else self._complete_shape()
        if kept is not None:
            self._keep_shape(kept)
        return bool(self.done)

    # NOTE [ Kept for good ]: a storage alive across two boundaries (a data set or a table made
    # before the loop, a cache made in the first step) is carried into the next iteration under a
    # flagged id and becomes long-lived at its end (NOTE [ Carried storages ], profiles.ids). A
    # profile keeps two iterations, so it had two rows of it, both alive throughout: a 1 MiB
    # table counted twice in the peak, and a 16 MiB one raised a script's profiled peak from 19
    # to 35 MiB. So the first kept iteration's tables name such storages by their long ids, and
    # the runtime maps the long id to the flagged one in that iteration:
    # - a default profile keeps iteration 1 from on; iteration 0's plan hands such storages on
    #   under their long ids (``first_carried``, NOTE [ Boundaries ] in runtime.boundary);
    # - one that set iteration 1 aside keeps 2 from on, where what iteration 1 made (DDP's
    #   buckets, rebuilt there) is flagged: the profile's ``kept_for_good`` maps the long ids to
    #   those for that iteration. Without it a plan that named the buckets by their long ids went
    #   22% over its budget in iteration 2; with both rows, a DDP profile counted every bucket
    #   twice (7.69 MB against 6.81 for the job test's rank);
    # - one that set iterations 1 and 2 aside keeps 3 from on (a DistributedSampler's smaller last
    #   batch in iteration 2), where the buckets are long-lived already; but a run follows the plan
    #   in iteration 2 too, with them flagged, so ``kept_for_good`` maps each iteration from 2 to
    #   the first kept one (the map of iteration 2 alone, before: 1.20-1.29x the budget there).
    # The kept tables are named so when the profile is made, and a profile ends only once its
    # last boundary has named what it carries (``begin_iteration`` raises ``ProfileComplete``):
    # one that kept iteration 1 alone (``--iters 1``) ended before, and named such a storage by
    # its flagged id, which a run has in iteration 1 alone (2 through the map): planned out, it
    # stayed in from iteration 3 on.
    def renamed(self, new_ids: dict[int, int]) -> None:
        long = {old: new for old, new in new_ids.items() if old & CARRIED_FLAG and LONG_BASE <= new < CARRIED_FLAG}
        if long:
            self._long_after[self.iteration] = long
        if self.iteration == 1:
            self.first_carried.update({new: old for old, new in long.items()})

    def _named_for_good(self, iteration: int, tables: Tables) -> Tables:
        """``tables`` of ``iteration`` with the storages that became long-lived at its end under
        their long ids (NOTE [ Kept for good ])."""
        long = self._long_after.get(iteration)
        if not long:
            return tables
        kernels, tensors, accesses = tables
        return (kernels, tensors.assign(tensor_id=tensors["tensor_id"].replace(long)),
                accesses.assign(tensor_id=accesses["tensor_id"].replace(long)))

    def irregular_message(self) -> str | None:
        """Why the recorded iterations are not alike, and what to do; None if they are."""
        if len(self.groups) < 2:
            return None
        groups = sorted(self.groups.values(), key=lambda g: g[0][0])
        (first_it, a), (other_it, b) = groups[0][0], groups[1][0]
        what, sizes_only, sizes_first = _difference(a, b)
        counted = ", ".join(f"{len(g)} like iteration {g[0][0]}" for g in groups)
        if sizes_first and not sizes_only:
            advice = ("tensor sizes change from step to step, and the ops with them (variable-length "
                      "batches, packed or not? an evaluation on batches of another size?): pad or bucket "
                      "the batches to one fixed shape and profile again (planning for several shapes is "
                      "not supported yet); if these are evaluation steps, profile a stretch of training "
                      "steps that are alike (raise --warmup past them, or run more steps)")
        elif sizes_only:
            advice = ("tensor sizes change from step to step (dynamic padding or variable-length "
                      "batches, packed or not? sparse gradients, whose rows are the distinct ids of each batch? "
                      "sizes the data decides inside the model, as a mixture of experts' tokens per expert "
                      "from nonzero or topk?): pad or bucket the batches to one fixed shape (e.g. "
                      "padding='max_length' with a tokenizer), give each expert a fixed capacity, or use "
                      "dense gradients, and profile again; planning for several shapes is not supported yet")
        else:
            advice = ("the ops differ between steps (an evaluation, logging or a checkpoint every "
                      "few steps? a loop whose length the data decides, as an episode's, a branch some "
                      "steps take, a mixture of experts' routing that skips an empty expert?): profile a "
                      "stretch of steps that are alike (raise --warmup past "
                      "the irregular ones, or run more steps), or call teraio.mark_iteration() "
                      "where each step ends; steps whose ops the data decides cannot be planned: make "
                      "every step run the same ops (pad to a fixed length, take the branch every step)")
        return (f"no {self.iters} of the {sum(len(g) for g in groups)} recorded iterations are "
                f"alike ({counted}); iteration {other_it} differs from iteration {first_it}: "
                f"{what}; {advice}")

    def _align_carried(self, rec: _Iteration) -> dict[int, int]:
        """Give storages carried in from the previous iteration the ids of their successors;
        returns the pairs (old id -> the successor's id).

        NOTE [ Carried storages ]: a transient storage that outlives the boundary
        (the last loss or batch, still bound to a Python name) is given
        ``CARRIED_FLAG`` at the boundary so that its id cannot collide with
        this iteration's ids. Carried storages that die in this iteration are
        paired with the storages this iteration makes that outlive it (and get
        no persistent name): in steady state these are the same variables. A
        carried storage made at the same op and position as one this iteration
        makes is paired with it (in steady state both are that op's output);
        the rest are paired by order, which also maps iteration 0, whose op
        indices include the script's set-up, onto the steady state; where
        their numbers differ in iteration 1, by order among those of equal sizes
        (iteration 0 may carry fewer: a tensor a script makes after its first step, as a
        queue's index, is carried from the second on; unpaired, none of
        iteration 0's was known to the steady plan, which then left them in
        memory through iteration 1, 12-15% over its budget). If the old
        copy dies before the new one is made, both share the new one's id and
        its lifetime wraps (NOTE [ Wrapping lifetimes ] in ``profiles.schema``);
        if the two overlap (a batch or a model output that lives until the next
        one is made), the old copy keeps its own row under the new one's id
        with the flag, which is its id in every steady iteration, so that the
        memory of both copies counts.
        """
        prev = sorted(t for t in rec.carried if t & CARRIED_FLAG and t in rec.frees)
        new = sorted(t for t in rec.alloc
                     if t >= PRODUCED_BASE and t not in rec.frees and t not in self.labels)
        made = set(new)
        # (in iteration 1 by position and by order only where the sizes agree: iteration 0's op
        # indices include the set-up, so its loss, made at the op whose index iteration 1 gives a
        # bf16 copy, took the copy's size, and iteration 1 was set aside as of other sizes)
        first = self.iteration == 1
        pairs = {t: t & ~CARRIED_FLAG for t in prev  # by position
                 if t & ~CARRIED_FLAG in made and (not first or rec.carried[t] == self.sizes.get(t & ~CARRIED_FLAG))}
        paired = set(pairs.values())
        prev = [t for t in prev if t not in pairs]
        new = [t for t in new if t not in paired]
        if prev and len(prev) == len(new) and (not first or [rec.carried[t] for t in prev]
                                                == [self.sizes.get(t, -1) for t in new]):
            pairs.update(zip(prev, new, strict=True))
        elif prev and new and first:  # (later ones: frees on gloo's thread vary)
            a, b = [rec.carried[t] for t in prev], [self.sizes.get(t, -1) for t in new]
            for block in difflib.SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks():
                pairs.update(zip(prev[block.a:block.a + block.size], new[block.b:block.b + block.size],
                                 strict=True))
        rename = self._regrown(rec)
        for old, succ in pairs.items():
            target = succ if rec.frees[old] <= rec.alloc[succ] else succ | CARRIED_FLAG
            if target != old and (target not in rec.carried or target in pairs):
                rename[old] = target
                tables: tuple[dict[int, Any], ...] = (self.sizes, self.dtypes, self.resizable, self.alloc_phase)
                for table in tables:
                    if old in table:
                        table.setdefault(target, table[old])
        if rename:
            rec.carried = {rename.get(t, t): n for t, n in rec.carried.items()}
            rec.frees = {rename.get(t, t): f for t, f in rec.frees.items()}
            rec.acc_tid = [rename.get(t, t) for t in rec.acc_tid]
        return pairs

    # NOTE [ Gradients re-made ]: with ``zero_grad(set_to_none=True)`` a gradient is freed in each
    # iteration and made again later in it: the one alive at the start carries the persistent
    # number its name got at the boundary, the new one an op's id until the next boundary names
    # it. Two rows, so the planner saw the old one as a storage alive from the start with no
    # access, which no period covers: every gradient counted in memory until ``zero_grad``, though
    # nothing reads it. Where it runs after the batch is made, the smallest budget of a plain loop
    # held all the gradients (8.2 MiB against 2.0 with ``zero_grad`` right after the step). So the
    # old one takes the new one's id where it dies before the new one is made: one storage whose
    # lifetime wraps (NOTE [ Wrapping lifetimes ] in profiles.schema), out from its last use in the
    # step until ``zero_grad`` frees it, never read back. The run names it as the plan does: by the
    # op's id until the boundary, and its number after it, through the boundary's own renaming.
    def _regrown(self, rec: _Iteration) -> dict[int, int]:
        """Old id -> new of each gradient (a named storage) freed in ``rec`` and made again after
        its free under the same name (NOTE [ Gradients re-made ])."""
        made = {name: t for t, (name, _) in self.labels.items() if t in rec.alloc and t not in rec.frees}
        out = {}
        for old in rec.carried:
            if old < PRODUCED_BASE and old in rec.frees and old in self.persistent:
                new = made.get(self.persistent[old][0])
                if new is not None and rec.frees[old] <= rec.alloc[new] and self.sizes.get(new) == rec.carried[old]:
                    out[old] = new
        return out

    def _close(self, rec: _Iteration) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
        """The tables of the iteration ``rec`` recorded."""
        it = self.iteration
        pairs = self._align_carried(rec)
        self._aligned[it] = pairs
        if it == 1:
            self.first_carried = {new: old for old, new in pairs.items()}
        n = len(rec.op_names)
        starts = [(t - self._t0) / 1e3 for t in rec.start_ns]
        durs = [d / 1e3 for d in rec.dur_ns]
        timed = [(i, e) for i, e in enumerate(rec.events) if e is not None]
        if timed:  # NOTE [ Clock ]: from the first op the CUDA clock timed, on its time line
            torch.cuda.synchronize()
            at, first = starts[timed[0][0]], timed[0][1][0]
            for i, (start, end) in timed:
                starts[i] = at + first.elapsed_time(start) * 1e3
                durs[i] = start.elapsed_time(end) * 1e3
        kernels = pd.DataFrame({
            "rank": self.rank, "iteration": it, "op_index": range(n), "op_name": rec.op_names,
            "phase": rec.phases, "module": rec.modules, "start_us": starts, "duration_us": durs,
            "peer": rec.peers, "scratch_bytes": rec.scratch,
        })
        accesses = pd.DataFrame({
            "rank": self.rank, "iteration": it, "op_index": rec.acc_op, "tensor_id": rec.acc_tid,
            "access": np.array(["read", "write"])[np.asarray(rec.acc_kind, np.int64)],
        }).drop_duplicates(ignore_index=True)
        return kernels, self._tensor_rows(rec, rec.phases), accesses

    def _kind(self, tid: int, alloc_phase: str | None, free_phase: str | None) -> str:
        if tid in self.persistent:
            return self.persistent[tid][1]
        if tid in self.labels:
            return self.labels[tid][1]
        if tid & ~CARRIED_FLAG >= LONG_BASE:
            return "other"  # long-lived and unnamed (profiles.ids)
        if tid & ~CARRIED_FLAG >= INPUT_BASE:
            return "input"
        if tid < PRODUCED_BASE or tid & CARRIED_FLAG:  # made before the iteration
            return "other"
        if alloc_phase == "forward":
            return "temporary" if free_phase == "forward" else "activation"
        if alloc_phase in ("backward", "optimizer"):
            return "temporary"
        return "other"

    def _tensor_rows(self, rec: _Iteration, phases: list[str]) -> pd.DataFrame:
        rows = []
        tids = sorted(set(rec.carried) | set(rec.alloc))
        for tid in tids:
            alloc = rec.alloc.get(tid, -1)
            free = rec.frees.get(tid, -1)
            if tid in rec.carried and alloc >= 0 and (free < 0 or free > alloc):
                # Not made by _align_carried (overlapping copies get ids of their own);
                # should it happen, count one copy throughout.
                alloc = free = -1
            free_phase = phases[free - 1] if alloc < free <= len(phases) else None
            name = self.persistent.get(tid, self.labels.get(tid, (None, "")))[0]
            rows.append((
                self.rank, tid, self.sizes[tid], self._kind(tid, self.alloc_phase.get(tid), free_phase),
                self.dtypes.get(tid, "uint8"), name,
                alloc < 0 and free < 0 or (alloc >= 0 and 0 <= free <= alloc),
                alloc, free, self.resizable.get(tid, True),
            ))
        return pd.DataFrame(rows, columns=[
            "rank", "tensor_id", "size_bytes", "kind", "dtype", "name", "persistent",
            "alloc_op", "free_op", "resizable",
        ])

    # ---- result -------------------------------------------------------------------
    def profile(self, meta: dict[str, Any]) -> Profile:
        if not self.done:
            raise RuntimeError("no iteration recorded")
        i0 = self.done[0][0]
        done = [self._named_for_good(it, t) if it == i0 else t for it, t in self.done]  # NOTE [ Kept for good ]
        merged = _kept_tensors(done)
        kernels = pd.concat([k for k, _, _ in done], ignore_index=True)
        long = self._long_after.get(i0, {})
        aligned = self._aligned.get(i0, {})
        aligned = {t: long.get(a, a) for t, a in aligned.items()} | {t: n for t, n in long.items() if t not in aligned}
        tensors = _kept_in_memory(merged, self._unseen_at, i0, aligned)
        accesses = pd.concat([a for _, _, a in done], ignore_index=True)
        k0 = done[0][0]
        sizes = dict(zip(tensors["tensor_id"], tensors["size_bytes"], strict=True))
        device = "cuda" if self.cuda_timing else "cpu"
        full = {
            "mode": "real",
            "device_type": device,
            "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "device_memory_bytes": torch.cuda.get_device_properties(0).total_memory
            if device == "cuda" else None,
            "world_size": self.world_size,
            "ranks": [self.rank],
            "iterations": [int(i) for i in kernels["iteration"].unique()],
            "iterations_identical": True,  # NOTE [ Steady iterations ]
            "skipped_iterations": self.skipped,
            "compiled": list(self.compiled),
            "written_unseen": {str(self.rank): sorted(self.written_unseen)},  # NOTE [ Writes teraio cannot see ]
            "torch_version": torch.__version__,
            "python_version": sys.version.split()[0],
            "signature": signature_of(k0["op_name"].tolist(), sizes),
            **meta,
        }
        full["signatures"] = {str(self.rank): full["signature"]}
        first = None
        if self.first is not None:
            k, t, a = self.first
            t = _kept_in_memory(t, self._unseen_at, 0, self._aligned.get(0, {}))
            signature = signature_of(k["op_name"].tolist(), dict(zip(t["tensor_id"], t["size_bytes"], strict=True)))
            carried = {str(new): old for new, old in sorted(self.first_carried.items())}
            first = Profile(meta={
                **full, "iterations": [0], "iterations_identical": True, "skipped_iterations": [],
                "signature": signature, "signatures": {str(self.rank): signature},
                "carried_into_next": {str(self.rank): carried},
            }, kernels=k, tensors=t, accesses=a)
        # NOTE [ Kept for good ]; for iteration 1 the first iteration's plan has them
        kept = {str(i): {str(new): old for old, new in sorted(self._long_after[i].items())}
                for i in range(2, i0 + 1) if self._long_after.get(i)}
        if kept:
            full["kept_for_good"] = {str(self.rank): kept}
        return Profile(meta=full, kernels=kernels, tensors=tensors, accesses=accesses, first=first)
