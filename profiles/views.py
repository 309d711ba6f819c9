"""Derived views of a profile that the planner and ``teraio inspect`` need.

All views are of one rank and one recorded iteration (the iterations of a
profile are identical in ops and tensors; timing may differ slightly).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from profiles.ids import CARRIED_FLAG
from profiles.model import Profile
from profiles.ops import UNTOUCHED_MIN_BYTES

__all__ = ["active_bytes", "inactive_periods", "iteration_time_us", "live_intervals", "made_bytes", "memory_curve"]


def iteration_time_us(profile: Profile, rank: int = 0, iteration: int | None = None) -> float:
    k = profile.kernels_of(rank, iteration)
    return float((k["start_us"] + k["duration_us"]).max()) if len(k) else 0.0


def live_intervals(tensors: pd.DataFrame, num_ops: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Half-open op intervals ``[begin, end)`` in which each storage is alive.

    Returns ``(row, begin, end)``: ``row`` indexes ``tensors``; a wrapping
    lifetime (see NOTE [ Wrapping lifetimes ] in ``profiles.schema``) yields two
    intervals, ``[0, free_op)`` and ``[alloc_op, num_ops)``.
    """
    alloc = tensors["alloc_op"].to_numpy(np.int64)
    free = tensors["free_op"].to_numpy(np.int64)
    begin = np.where(alloc < 0, 0, alloc)
    end = np.where(free < 0, num_ops, free)
    wraps = (alloc >= 0) & (free >= 0) & (free <= alloc)
    rows = np.arange(len(tensors))
    end = np.where(wraps, num_ops, end)
    row = np.concatenate([rows, rows[wraps]])
    begin = np.concatenate([begin, np.zeros(int(wraps.sum()), np.int64)])
    end = np.concatenate([end, free[wraps]])
    return row, begin, end


def memory_curve(profile: Profile, rank: int = 0, iteration: int | None = None) -> np.ndarray:
    """(num_ops,) int64: bytes of live storages at each op."""
    num_ops = len(profile.kernels_of(rank, iteration))
    tensors = profile.tensors_of(rank)
    row, begin, end = live_intervals(tensors, num_ops)
    size = tensors["size_bytes"].to_numpy(np.int64)[row]
    diff = np.zeros(num_ops + 1, np.int64)
    np.add.at(diff, np.clip(begin, 0, num_ops), size)
    np.add.at(diff, np.clip(end, 0, num_ops), -size)
    return np.cumsum(diff[:-1])


def made_bytes(profile: Profile, rank: int = 0, iteration: int | None = None) -> np.ndarray:
    """(num_ops,) int64: bytes of the storages each op allocates (``alloc_op``)."""
    num_ops = len(profile.kernels_of(rank, iteration))
    tensors = profile.tensors_of(rank)
    alloc = tensors["alloc_op"].to_numpy(np.int64)
    made = (alloc >= 0) & (alloc < num_ops)
    out = np.zeros(num_ops, np.int64)
    np.add.at(out, alloc[made], tensors["size_bytes"].to_numpy(np.int64)[made])
    return out


def active_bytes(profile: Profile, rank: int = 0, iteration: int | None = None) -> np.ndarray:
    """(num_ops,) int64: bytes of the distinct storages each op reads or writes."""
    num_ops = len(profile.kernels_of(rank, iteration))
    acc = profile.accesses_of(rank, iteration).drop_duplicates(["op_index", "tensor_id"])
    sizes = profile.tensors_of(rank).set_index("tensor_id")["size_bytes"]
    out = np.zeros(num_ops, np.int64)
    np.add.at(out, acc["op_index"].to_numpy(np.int64), sizes.loc[acc["tensor_id"]].to_numpy())
    return out


def inactive_periods(profile: Profile, rank: int = 0, iteration: int | None = None) -> pd.DataFrame:
    """Every stretch in which a storage is alive but unused, spanning at least one op.

    Columns: ``tensor_id, size_bytes, kind, start_op`` (the last op that
    accesses it before the stretch), ``end_op``, ``num_ops`` (ops strictly
    inside the stretch), ``duration_us`` (from the end of ``start_op`` to the
    start of ``end_op``), ``wraps`` (``end_op >= num_ops``: ``end_op`` is op
    ``end_op - num_ops`` of the next iteration) and ``reads_back``.

    With ``reads_back`` true, ``end_op`` is the next op that accesses the
    storage: a gap between two consecutive accesses, or, for a storage alive
    across the iteration boundary (``alloc_op == free_op == -1``, or a wrapping
    lifetime accessed on both sides of the boundary, see NOTE [ Wrapping
    lifetimes ] in ``profiles.schema``), the gap from its last access before
    the boundary to its first access after it; for a storage made in the
    iteration that outlives it while its successor is made, whose old copy
    the next iteration reads at op 0, ``num_ops`` (NOTE [ Carried copies ]).
    With ``reads_back`` false (a
    *trailing* period), ``end_op`` is the op at which the storage is no longer
    alive and nothing accesses it from ``start_op`` on: from its last access
    to ``free_op``, or to ``num_ops`` when it outlives the iteration
    (``free_op == -1``), or to ``free_op + num_ops`` for a wrapping lifetime
    not accessed before its ``free_op``. A storage that is alive before its
    first access in the iteration (``alloc_op == -1``) has no period for that
    stretch; one alive throughout that no op accesses has a trailing period
    from op 0 to ``num_ops + 1`` (NOTE [ Untouched storages ]). A ``uint8`` storage under 64
    KiB has none (NOTE [ Random states ]).
    """
    kernels = profile.kernels_of(rank, iteration)
    num_ops = len(kernels)
    start_us = kernels["start_us"].to_numpy(np.float64)
    end_us = start_us + kernels["duration_us"].to_numpy(np.float64)
    iter_us = float(end_us.max()) if num_ops else 0.0

    tensors = profile.tensors_of(rank).set_index("tensor_id")
    acc = profile.accesses_of(rank, iteration)[["tensor_id", "op_index"]]
    acc = acc.drop_duplicates().sort_values(["tensor_id", "op_index"])
    tid = acc["tensor_id"].to_numpy(np.int64)
    op = acc["op_index"].to_numpy(np.int64)
    row = tensors.index.get_indexer(pd.Index(tid))
    if (row < 0).any():
        raise ValueError(f"accesses of tensor ids not in the tensors table: {sorted(set(tid[row < 0]))[:5]}")
    alloc = tensors["alloc_op"].to_numpy(np.int64)[row]  # per access, of its storage
    free = tensors["free_op"].to_numpy(np.int64)[row]
    resident = (alloc < 0) & (free < 0)
    wrapping = (alloc >= 0) & (free >= 0) & (free <= alloc)
    # A wrapping storage's accesses before its free_op are of the previous iteration's copy.
    part = (wrapping & (op >= free)).astype(np.int64)

    # Gaps between consecutive accesses of one copy (a copy's death is no gap).
    same = (tid[1:] == tid[:-1]) & ~((free[:-1] >= 0) & (op[:-1] < free[:-1]) & (free[:-1] <= op[1:]))
    gap = same & (op[1:] - op[:-1] >= 2)
    periods = [(tid[:-1][gap], op[:-1][gap], op[1:][gap], True)]

    # Per copy (a run of accesses of one storage and part): its first and last access.
    new_copy = np.r_[True, (tid[1:] != tid[:-1]) | (part[1:] != part[:-1])] if len(tid) else np.zeros(0, bool)
    first_idx = np.flatnonzero(new_copy)
    last_idx = np.r_[first_idx[1:] - 1, len(tid) - 1].astype(np.int64) if len(tid) else first_idx
    c_tid, c_last, c_first = tid[first_idx], op[last_idx], op[first_idx]
    c_res, c_wrap, c_part, c_free = resident[first_idx], wrapping[first_idx], part[first_idx], free[first_idx]
    # The copy before, when it is the previous iteration's copy of the same storage.
    has_old = np.r_[False, (c_tid[1:] == c_tid[:-1]) & (c_part[:-1] == 0)] & c_wrap & (c_part == 1)
    old_first = np.r_[0, c_first[:-1]]
    wrap_end = np.where(c_res, c_first, old_first) + num_ops
    w = (c_res | has_old) & (wrap_end - c_last >= 2)
    periods.append((c_tid[w], c_last[w], wrap_end[w], True))
    death = np.where(c_wrap, c_free + num_ops * c_part, np.where(c_free < 0, num_ops, c_free))
    # NOTE [ Carried copies ]: a storage made in the iteration that outlives it while its
    # successor is made (the last loss, a model output the script keeps) is, in the next
    # iteration, a row of its own: its id with the carried flag (NOTE [ Carried storages ] in
    # torch_patch.tracer), alive from op 0 to its free. Its period ran to the iteration's end
    # and read nothing back, though the next iteration may read it (a loss printed after the
    # step: ``loss.item()``, the next iteration's op 0), so the plan had it out there and every
    # iteration read it on demand (a script that computes its accuracy from the last logits
    # after the step, at its smallest budget: 3 such reads an iteration, 2 with this rule). So
    # where that row (of its size: in iteration 1, a storage of iteration 0 the tracer could not
    # pair keeps the id it had there) is first accessed at op 0, the period ends there and reads
    # back. Not where it is later, nor where no op reads the copy before it dies: the plan would
    # then count it out from op 0 on, and an iteration after one that did not follow the plan
    # (iteration 1, the one after an evaluation) has it in memory there: 1.105x the budget in
    # iteration 1 of a review's script that kept its last batch, under a first version of this
    # rule.
    sizes = tensors["size_bytes"]
    same_size = sizes.reindex(c_tid | CARRIED_FLAG).to_numpy(np.float64) == sizes.reindex(c_tid).to_numpy(np.float64)
    read_again = (~c_res & ~c_wrap & (c_free < 0) & same_size
                  & np.isin(c_tid | CARRIED_FLAG, acc["tensor_id"][acc["op_index"] == 0]))
    r = read_again & (num_ops - c_last >= 2)
    periods.append((c_tid[r], c_last[r], np.full(int(r.sum()), num_ops), True))
    t = ~(c_res | has_old | read_again) & (death - c_last >= 2)
    periods.append((c_tid[t], c_last[t], death[t], False))
    # NOTE [ Untouched storages ]: one alive throughout that no op of the iteration uses (a copy
    # of the initial weights kept for the end, the best weights so far) had no period, so it
    # counted at every op. It gets a trailing one from op 0 to op 0 of the next iteration (end_op
    # ``num_ops + 1``): out after op 0, out at the boundary and so through op 0 too, for as long
    # as the plan is followed (ending at ``num_ops``, op 0 still had to hold every such copy: 4.04
    # MiB of budget against 2.07 for three copies of 1.3 MiB); written once, so the simulator
    # charges no write of it in a steady iteration. Not one under 64 KiB: those are
    # few bytes, and a saved random state (5 KiB), which ``torch.Generator.set_state`` reads with
    # no op teraio sees, is one of them. A copy made anew later: NOTE [ Left over ] in
    # runtime.executor.
    alive = ((tensors["alloc_op"].to_numpy(np.int64) < 0) & (tensors["free_op"].to_numpy(np.int64) < 0)
             & (tensors["size_bytes"].to_numpy(np.int64) >= UNTOUCHED_MIN_BYTES))
    untouched = np.setdiff1d(tensors.index.to_numpy(np.int64)[alive], tid)
    if num_ops >= 3 and len(untouched):
        n = len(untouched)
        periods.append((untouched, np.zeros(n, np.int64), np.full(n, num_ops + 1), False))

    tensor_id = np.concatenate([p[0] for p in periods]).astype(np.int64)
    start_op = np.concatenate([p[1] for p in periods]).astype(np.int64)
    end_op = np.concatenate([p[2] for p in periods]).astype(np.int64)
    reads_back = np.concatenate([np.full(len(p[0]), p[3]) for p in periods]).astype(bool)
    # NOTE [ Random states ]: a random state (a CPU generator's is a 5,056-byte uint8 tensor, a
    # CUDA one's 16 bytes) is read by ``torch.Generator.set_state`` with no op teraio sees, a C++
    # type that takes no patch. A resumed script's state, loaded with its checkpoint, was sent out
    # by the plan of iteration 0 at the smallest budget, and the restore failed with "data is not
    # allocated yet" (and where the script read it by an op first, so did a first rule that left
    # out storages no op reads). So a uint8 storage under 64 KiB is never moved: too few bytes to
    # matter, and the likeliest to be such a state.
    small_bytes = ((tensors["dtype"] == "uint8") & (tensors["size_bytes"] < UNTOUCHED_MIN_BYTES)).to_numpy(bool)
    keep = ~small_bytes[tensors.index.get_indexer(pd.Index(tensor_id))] if len(tensor_id) else np.zeros(0, bool)
    tensor_id, start_op, end_op, reads_back = tensor_id[keep], start_op[keep], end_op[keep], reads_back[keep]
    if num_ops:
        next_start = start_us[end_op % num_ops] + (end_op // num_ops) * iter_us
        duration = next_start - end_us[start_op]
    else:
        duration = np.zeros(0)
    info = tensors.loc[tensor_id]
    return pd.DataFrame(
        {
            "tensor_id": tensor_id,
            "size_bytes": info["size_bytes"].to_numpy(np.int64),
            "kind": info["kind"].to_numpy(),
            "start_op": start_op,
            "end_op": end_op,
            "num_ops": end_op - start_op - 1,
            "duration_us": np.maximum(duration, 0.0),
            "wraps": end_op >= num_ops,
            "reads_back": reads_back,
        }
    )
