"""The planning problem of one rank, as plain arrays built from a profile.

NOTE [ Unrolled op axis ]: op ``k`` of an iteration of ``num_ops`` ops is also
op ``k + num_ops`` of the next one. A period that wraps the iteration boundary
(a persistent tensor idle from its last access to its first access of the next
iteration) has ``start_op < num_ops <= end_op < 2 * num_ops``; everything the
planner computes about it (windows, bandwidth, memory) lives on this unrolled
axis ``[0, 2 * num_ops)`` and is folded back modulo ``num_ops``, because every
iteration runs the same plan.

NOTE [ Busy in a collective ]: a c10d op (all-reduce, all-gather, send, recv...)
returns before its transfer is done; the backend's threads read and write its
tensors until a wait that no dispatch mode sees (docs/distributed-notes.md). So
a tensor stays active from a collective to its next access (a correct program
waits before it touches it again): the inactive period that starts at a
collective, trailing ones included, is never planned. So too for the functional
collectives (``_c10d_functional.*``, which DTensor and tensor parallelism use),
whose result is filled until an op on it waits (``profiles.ops.leaves_in_flight``):
planned, a job whose rank 1 reached its all-reduce 50 ms late had the result
sent out and back while gloo filled it, and trained to other losses, then crashed.
A view of that result is taken without waiting, so a period that starts at a
view op after such an op is busy too (``_busy_in_flight``), and so is one of the
collective's inputs that starts before an op waits for its result (the script
may read an all-gather's input while the gather still reads it).

NOTE [ Trailing periods ]: a period with ``reads_back`` false runs from a
storage's last access to its death: ``end_op`` is the op at which it is no
longer alive (``>= num_ops``: it dies in the next iteration), not a use. Such
a tensor can be offloaded and never prefetched: it costs only the write, and
its memory is free from the end of the offload until ``end_op``, where the
memory curve drops it anyway (``profiles.views.inactive_periods``).

NOTE [ Unchanged periods ]: a period is *unchanged* when the previous period
of its storage (the one before it in the storage's cyclic order of periods,
the last one an iteration earlier for its first) reads back and no op writes
the storage from that period's ``end_op`` through this one's ``start_op``:
the storage (alive throughout: its making and freeing count as writes) holds
the same bytes it held when it went out last. A copy of it
kept since that prefetch is still good, so its offload need not write
anything (NOTE [ Copies kept ] in ``planner.clean``). Parameters read in
forward and backward are so; gradients accumulated, optimizer state and
fresh activations are not.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

from planner.errors import InfeasibleBudgetError
from profiles import Profile, active_bytes, inactive_periods, made_bytes, memory_curve
from profiles.ids import CARRIED_FLAG
from profiles.ops import is_view_op, leaves_in_flight

__all__ = ["PlanProblem", "check_capacity", "cyclic_add", "first_problem", "median_durations_us",
           "problem_from_profile", "resident_need_bytes", "written_unseen"]


@dataclass(frozen=True, eq=False)
class PlanProblem:
    """What the planner needs to know about one rank's iteration. Times us, sizes bytes."""

    rank: int
    signature: str
    op_names: tuple[str, ...]
    duration_us: np.ndarray  # (num_ops,) float64
    # (num_ops,) int64: bytes each op needs with nothing moved: the live storages and its scratch
    memory_bytes: np.ndarray
    active_bytes: np.ndarray  # (num_ops,) int64: bytes each op reads or writes
    made_bytes: np.ndarray  # (num_ops,) int64: bytes each op allocates: its new storages and its scratch
    phase: np.ndarray  # (num_ops,) object: forward|backward|optimizer|other
    module: np.ndarray  # (num_ops,) object: dotted module path or None
    # One row per inactive period; see NOTE [ Unrolled op axis ].
    tensor_id: np.ndarray  # (num_periods,) int64
    size_bytes: np.ndarray  # (num_periods,) int64
    kind: np.ndarray  # (num_periods,) object: the tensor kind (param, activation, ...)
    start_op: np.ndarray  # (num_periods,) int64: last op that uses it before the gap
    end_op: np.ndarray  # (num_periods,) int64: next op that uses it; >= num_ops wraps
    # (num_periods,) bool: false for a trailing period, whose end_op is the storage's death
    # (NOTE [ Trailing periods ]).
    reads_back: np.ndarray
    # (num_periods,) bool: NOTE [ Unchanged periods ]; None: none is
    unchanged: np.ndarray | None = None
    # tensor id -> name (parameter, gradient, optimizer state) for the named tensors moved
    names: dict[int, str] = field(default_factory=dict)
    # (num_ops,) int32: the other rank of a point-to-point op (c10d send: its destination,
    # recv: its source), -1 for every other op (kernels.peer); None: none known, all -1.
    peer: np.ndarray | None = None
    # (num_ops,) int64: what each op allocates and frees inside itself (NOTE [ Scratch ] in
    # torch_patch.tracer), counted in memory_bytes and made_bytes; None: none measured
    scratch_bytes: np.ndarray | None = None

    @property
    def num_ops(self) -> int:
        return len(self.duration_us)

    @property
    def scratch(self) -> np.ndarray:
        """(num_ops,) int64: ``scratch_bytes``, zeros where none was measured."""
        return np.zeros(self.num_ops, np.int64) if self.scratch_bytes is None else self.scratch_bytes

    @property
    def num_periods(self) -> int:
        return len(self.tensor_id)

    @property
    def wraps(self) -> np.ndarray:
        return self.end_op >= self.num_ops

    @property
    def ideal_iteration_us(self) -> float:
        """The iteration with infinite memory: the ops back to back (host gaps left out)."""
        return float(self.duration_us.sum())


def _alike(profile: Profile, rank: int, kernels: pd.DataFrame, column: str, dtype: type) -> np.ndarray:
    """(iterations, num_ops): ``column`` of each recorded iteration whose ops are those of ``kernels``
    (the kept ones are: docs/formats.md); ``kernels``' own where none is."""
    names = kernels["op_name"].tolist()
    k = profile.kernels[profile.kernels["rank"] == rank]
    rows = [it[column].to_numpy(dtype) for _, it in k.sort_values("op_index").groupby("iteration")
            if it["op_name"].tolist() == names]
    return np.stack(rows) if rows else kernels[column].to_numpy(dtype)[None]


def median_durations_us(profile: Profile, rank: int, kernels: pd.DataFrame) -> np.ndarray:
    """(num_ops,) float64: each op's median time over the recorded iterations whose ops are those of
    ``kernels``: one iteration's times on a shared CPU were 6% apart from the next's here, and the
    plan's prediction stands on their sum."""
    return np.median(_alike(profile, rank, kernels, "duration_us", np.float64), axis=0)


def op_scratch_bytes(profile: Profile, rank: int, kernels: pd.DataFrame) -> np.ndarray:
    """(num_ops,) int64: each op's scratch (NOTE [ Scratch ] in torch_patch.tracer), the most of the
    recorded iterations whose ops are those of ``kernels``: the plan must make room for the largest."""
    if "scratch_bytes" not in kernels:  # a profile made in memory without it: none measured
        return np.zeros(len(kernels), np.int64)
    return _alike(profile, rank, kernels, "scratch_bytes", np.int64).max(axis=0)


NAMED_KINDS = ("param", "buffer", "grad", "optimizer_state")


def written_unseen(profile: Profile, rank: int = 0) -> list[str]:
    """The named storages of ``rank`` that code teraio cannot see wrote while it was profiled
    (NOTE [ Writes teraio cannot see ] in torch_patch.tracer); none in a profile that predates it."""
    return list((profile.meta.get("written_unseen") or {}).get(str(rank), []))


def _functional(op_name: str) -> bool:
    """A functional collective (NOTE [ Busy in a collective ]): in flight, not c10d's."""
    return leaves_in_flight(op_name) and not op_name.startswith("c10d.")


def _busy_in_flight(periods: pd.DataFrame, names: np.ndarray, accesses: pd.DataFrame,
                    tensors: pd.DataFrame) -> np.ndarray:
    """Which of ``periods`` start where a collective still uses the tensor (NOTE [ Busy in a
    collective ]): at an op that leaves it in flight, or at a view op (``is_view_op``) of it whose
    accesses before, back to a functional collective, are all views: the collective's result runs
    views without waiting, and a plan that moved the tensor after ``fc.all_reduce(x).view(...)``
    had gloo fill a freed storage (a corrupted heap). For a storage alive across the iteration's
    boundary the walk goes on through the iteration before (a result made before the optimizer's
    step and viewed after it). Not after c10d's ops, which a script waits for (``Work.wait``)
    before it uses their tensors: a profile with none of the functional ones is planned as before."""
    if not len(names):
        return np.zeros(len(periods), bool)
    num = len(names)
    starts, tids = periods["start_op"].to_numpy(), periods["tensor_id"].to_numpy()
    busy = np.array([leaves_in_flight(str(names[k % num])) for k in starts], bool)
    if not any(_functional(str(name)) for name in set(names)):
        return busy
    ops_of = accesses.groupby("tensor_id")["op_index"].unique()
    _inputs_until_the_wait(busy, starts % num, tids, names, accesses, ops_of)
    views = [i for i in np.flatnonzero(~busy) if is_view_op(str(names[starts[i] % num]))]
    if not views:
        return busy
    life = {int(t): (int(a), int(f)) for t, a, f in
            zip(tensors["tensor_id"], tensors["alloc_op"], tensors["free_op"], strict=True)}
    empty = np.array([], np.int64)
    for i in views:
        start, tid = int(starts[i] % num), int(tids[i])
        ops = np.sort(ops_of.get(tid, empty))
        walk = [ops[ops < start][::-1]]  # back through the views to what made it
        if tid in life:  # on through the iteration before, where the storage lived then
            alloc, free = life[tid]
            if alloc < 0 and free < 0:
                walk.append(ops[ops > start][::-1])
            elif 0 <= free <= alloc and start < free:  # made late in an iteration, freed in the next
                walk.append(ops[ops >= alloc][::-1])
            elif tid & CARRIED_FLAG and (base := tid & ~CARRIED_FLAG) in life:
                made = np.sort(ops_of.get(base, empty))
                walk.append(made[made >= life[base][0]][::-1])
        for op in np.concatenate(walk):
            name = str(names[op])
            if _functional(name):  # not c10d's: the script waits first
                busy[i] = True
            if not is_view_op(name):
                break
    return busy


def _inputs_until_the_wait(busy: np.ndarray, starts: np.ndarray, tids: np.ndarray, names: np.ndarray,
                           accesses: pd.DataFrame, ops_of: pd.Series) -> None:
    """Marks ``busy`` the periods of a functional collective's inputs that start before an op
    waits for its result (NOTE [ Busy in a collective ]): the backend reads them until then, and
    the script may read them too (``y = fc.all_gather_tensor(x, ...); z = x * 2``), which would
    start a period a plan could free ``x`` in while the gather still reads it. The wait is the
    first op on a result (what the collective writes: a tensor it makes, or one it fills in place)
    that is not its wrapping or a view; with none in the iteration, its end."""
    collectives = [k for k, name in enumerate(names) if _functional(str(name))
                   and "._wrap_tensor_autograd." not in str(name)]
    at = accesses[accesses["op_index"].isin(collectives)]
    written = at[at["access"] == "write"].groupby("op_index")["tensor_id"].unique()
    empty = np.array([], np.int64)
    for k, used in at.groupby("op_index")["tensor_id"].unique().items():
        results = list(written.get(k, empty))  # what it makes, or fills in place (``all_reduce_``)
        wait = len(names)
        for t in results:
            later = np.sort(ops_of.get(t, empty))
            for op in later[later > k]:
                name = str(names[op])
                if not (is_view_op(name) or "._wrap_tensor_autograd." in name):
                    wait = min(wait, int(op))
                    break
        for t in used:
            if t not in results:
                busy |= (tids == t) & (starts > k) & (starts < wait)


def problem_from_profile(profile: Profile, rank: int = 0, iteration: int | None = None) -> PlanProblem:
    """The arrays of one rank's (first recorded, by default) iteration of ``profile``; by default its
    op times are the median over the recorded iterations (``median_durations_us``)."""
    kernels = profile.kernels_of(rank, iteration)
    periods = inactive_periods(profile, rank, iteration)
    tensors = profile.tensors_of(rank)
    # A storage that cannot be freed in place (numpy- or shared-memory-backed) is never moved;
    # nor is one between a collective and its next use (NOTE [ Busy in a collective ]), nor any
    # named one where code teraio cannot see wrote some (NOTE [ Writes teraio cannot see ] in
    # torch_patch.tracer).
    fixed = tensors["tensor_id"][~tensors["resizable"]] if "resizable" in tensors else pd.Series([], dtype=np.int64)
    if written_unseen(profile, rank):
        fixed = pd.concat([fixed, tensors["tensor_id"][tensors["kind"].isin(NAMED_KINDS)]])
    names = kernels["op_name"].to_numpy(object)
    busy = _busy_in_flight(periods, names, profile.accesses_of(rank, iteration), tensors)
    periods = periods[(periods["size_bytes"] > 0) & ~periods["tensor_id"].isin(fixed) & ~busy]
    named = tensors[tensors["name"].notna() & tensors["tensor_id"].isin(periods["tensor_id"])]
    num_ops = len(kernels)
    scratch = op_scratch_bytes(profile, rank, kernels)
    return PlanProblem(
        rank=rank,
        signature=str(profile.meta.get("signature", "")),
        op_names=tuple(kernels["op_name"].astype(str)),
        duration_us=(kernels["duration_us"].to_numpy(np.float64).copy() if iteration is not None
                     else median_durations_us(profile, rank, kernels)),
        memory_bytes=memory_curve(profile, rank, iteration).astype(np.int64) + scratch,
        active_bytes=active_bytes(profile, rank, iteration).astype(np.int64),
        made_bytes=made_bytes(profile, rank, iteration) + scratch,
        phase=kernels["phase"].to_numpy(object),
        module=kernels["module"].to_numpy(object),
        tensor_id=periods["tensor_id"].to_numpy(np.int64),
        size_bytes=periods["size_bytes"].to_numpy(np.int64),
        kind=periods["kind"].to_numpy(object),
        start_op=periods["start_op"].to_numpy(np.int64),
        end_op=periods["end_op"].to_numpy(np.int64),
        reads_back=periods["reads_back"].to_numpy(bool),
        unchanged=unchanged_periods(periods, profile.accesses_of(rank, iteration), num_ops, tensors),
        names=dict(zip(named["tensor_id"].astype(int), named["name"].astype(str), strict=True)),
        peer=kernels["peer"].to_numpy(np.int32) if "peer" in kernels else None,
        scratch_bytes=scratch if scratch.any() else None,
    )


def first_problem(profile: Profile, rank: int = 0) -> PlanProblem | None:
    """The problem of iteration 0 (``profile.first``, NOTE [ The first iteration ] in
    ``profiles.model``), or None if the profile did not record it.

    Iteration 0 runs once, not in a cycle: a storage it leaves alive has a
    trailing period from its last access to the end (offload only, NOTE [
    Trailing periods ]), and nothing is read back after the end, so a period
    that would wrap (a storage alive before the first op) is dropped.
    """
    if profile.first is None or rank not in profile.first.ranks:
        return None
    p = problem_from_profile(profile.first, rank)
    keep = ~(p.reads_back & (p.end_op >= p.num_ops))
    # Nothing was kept before iteration 0: no period of it is unchanged.
    return replace(p, tensor_id=p.tensor_id[keep], size_bytes=p.size_bytes[keep], kind=p.kind[keep],
                   start_op=p.start_op[keep], end_op=p.end_op[keep], reads_back=p.reads_back[keep],
                   unchanged=None)


def previous_periods(tensor_id: np.ndarray, start_op: np.ndarray) -> np.ndarray:
    """(num_periods,) int64: the index of each period's previous one of the same storage, in the
    storage's cyclic order by ``start_op`` (its last one for its first; itself for a storage of one)."""
    order = np.lexsort((start_op, tensor_id))
    tid = tensor_id[order]
    first = np.r_[True, tid[1:] != tid[:-1]]
    group_first = np.flatnonzero(first)
    group_last = np.r_[group_first[1:], len(tid)] - 1
    prev_pos = np.arange(len(tid)) - 1
    group = np.cumsum(first) - 1
    prev_pos[first] = group_last[group[first]]
    out = np.empty(len(tid), np.int64)
    out[order] = order[prev_pos] if len(tid) else order
    return out


def unchanged_periods(periods: pd.DataFrame, accesses: pd.DataFrame, num_ops: int,
                      tensors: pd.DataFrame | None = None) -> np.ndarray:
    """(num_periods,) bool of ``periods`` (``tensor_id, start_op, end_op, reads_back``): NOTE [
    Unchanged periods ], from the ``write`` rows of ``accesses`` (an output is a write too) and,
    as writes, the ops at which ``tensors`` (``tensor_id, alloc_op, free_op``) are made or freed:
    a storage that died in between is not the one that went out, even one made outside any op
    (first seen as an input, so no access writes it)."""
    tid = periods["tensor_id"].to_numpy(np.int64)
    start = periods["start_op"].to_numpy(np.int64)
    end = periods["end_op"].to_numpy(np.int64)
    back = periods["reads_back"].to_numpy(bool)
    if len(tid) == 0 or num_ops == 0:
        return np.zeros(len(tid), bool)
    prev = previous_periods(tid, start)
    # The stretch from the previous period's end to this one's start, on the unrolled axis:
    # the storage's first period's previous one is a whole iteration earlier.
    wrap = start[prev] >= start
    lo = end[prev] - np.where(wrap, num_ops, 0)
    writes = accesses[accesses["access"] == "write"]
    w_tid, wop = writes["tensor_id"].to_numpy(np.int64), writes["op_index"].to_numpy(np.int64)
    if tensors is not None:
        for col in ("alloc_op", "free_op"):
            at = tensors[tensors[col] >= 0]
            w_tid = np.r_[w_tid, at["tensor_id"].to_numpy(np.int64)]
            wop = np.r_[wop, at[col].to_numpy(np.int64)]
    codes, _ = pd.factorize(pd.Series(np.r_[tid, w_tid]))
    period_code, write_code = codes[:len(tid)], codes[len(tid):]
    # Every write three times (an iteration before, this one, the next), keyed by storage then op.
    span = 4 * num_ops
    keys = np.sort(np.concatenate([write_code * span + wop + shift
                                   for shift in (0, num_ops, 2 * num_ops)]))
    base = period_code * span + num_ops
    count = np.searchsorted(keys, base + start, "right") - np.searchsorted(keys, base + lo, "left")
    return back[prev] & (count == 0) & (lo <= start) & (start - lo < num_ops)


def cyclic_add(out: np.ndarray, begin: np.ndarray, end: np.ndarray, value: np.ndarray) -> None:
    """Add ``value`` to ``out[k % n]`` for each unrolled op ``k`` in ``[begin, end)``, vectorised.

    ``out`` has ``n = len(out)`` ops; ``0 <= begin <= end <= begin + n`` and ``end <= 2 * n``.
    """
    n = len(out)
    diff = np.zeros(n + 1, dtype=np.result_type(out.dtype, value.dtype))
    lo1, hi1 = np.minimum(begin, n), np.minimum(end, n)
    lo2, hi2 = np.maximum(begin, n) - n, np.maximum(end, n) - n
    np.add.at(diff, lo1, value)
    np.add.at(diff, hi1, -value)
    np.add.at(diff, lo2, value)
    np.add.at(diff, hi2, -value)
    out += np.cumsum(diff[:-1]).astype(out.dtype)


def resident_need_bytes(problem: PlanProblem) -> np.ndarray:
    """(num_ops,) int64: bytes that must be resident at each op whatever the plan moves.

    That is the live bytes minus those of tensors idle at that op (strictly
    inside one of their inactive periods, trailing ones included); it includes
    the op's own inputs and outputs, and its scratch.
    """
    idle = np.zeros(problem.num_ops, np.int64)
    cyclic_add(idle, problem.start_op + 1, problem.end_op, problem.size_bytes)
    return problem.memory_bytes - idle


def check_capacity(problem: PlanProblem, capacity_bytes: int) -> None:
    """Raise ``InfeasibleBudgetError`` naming the op that needs most if any op cannot fit."""
    need = resident_need_bytes(problem)
    if problem.num_ops and need.max() > capacity_bytes:
        k = int(need.argmax())
        raise InfeasibleBudgetError(k, problem.op_names[k], int(need[k]),
                                    int(problem.active_bytes[k]), capacity_bytes, int(problem.scratch[k]),
                                    str(problem.phase[k]))
