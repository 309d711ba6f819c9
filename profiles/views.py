"""Derived views of a profile that the planner and ``teraio inspect`` need.

All views are of one rank and one recorded iteration (the iterations of a
profile are identical in ops and tensors; timing may differ slightly).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from profiles.model import Profile

__all__ = ["active_bytes", "inactive_periods", "iteration_time_us", "live_intervals", "memory_curve"]


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


def active_bytes(profile: Profile, rank: int = 0, iteration: int | None = None) -> np.ndarray:
    """(num_ops,) int64: bytes of the distinct storages each op reads or writes."""
    num_ops = len(profile.kernels_of(rank, iteration))
    acc = profile.accesses_of(rank, iteration).drop_duplicates(["op_index", "tensor_id"])
    sizes = profile.tensors_of(rank).set_index("tensor_id")["size_bytes"]
    out = np.zeros(num_ops, np.int64)
    np.add.at(out, acc["op_index"].to_numpy(np.int64), sizes.loc[acc["tensor_id"]].to_numpy())
    return out


def inactive_periods(profile: Profile, rank: int = 0, iteration: int | None = None) -> pd.DataFrame:
    """Every gap between two consecutive accesses of a storage that spans at least one op.

    Columns: ``tensor_id, size_bytes, kind, start_op`` (the last op that
    accesses it before the gap), ``end_op`` (the next op that accesses it;
    ``>= num_ops`` means that op of the next iteration), ``num_ops`` (ops
    strictly inside the gap), ``duration_us`` (from the end of ``start_op`` to
    the start of ``end_op``), ``wraps``. Storages alive across the iteration
    boundary (``alloc_op == free_op == -1``) get the gap from their last access
    to their first access of the next iteration.
    """
    kernels = profile.kernels_of(rank, iteration)
    num_ops = len(kernels)
    start_us = kernels["start_us"].to_numpy(np.float64)
    end_us = start_us + kernels["duration_us"].to_numpy(np.float64)
    iter_us = float(end_us.max()) if num_ops else 0.0

    acc = profile.accesses_of(rank, iteration)[["tensor_id", "op_index"]]
    acc = acc.drop_duplicates().sort_values(["tensor_id", "op_index"])
    tid = acc["tensor_id"].to_numpy(np.int64)
    op = acc["op_index"].to_numpy(np.int64)

    same = tid[1:] == tid[:-1]
    gap = same & (op[1:] - op[:-1] >= 2)
    starts, ends, tids = op[:-1][gap], op[1:][gap], tid[:-1][gap]

    tensors = profile.tensors_of(rank).set_index("tensor_id")
    resident = tensors.index[(tensors["alloc_op"] < 0) & (tensors["free_op"] < 0)]
    if len(tid):
        first_of = np.r_[True, tid[1:] != tid[:-1]]
        last_of = np.r_[tid[1:] != tid[:-1], True]
        w_tid, w_last, w_first = tid[last_of], op[last_of], op[first_of] + num_ops
        keep = np.isin(w_tid, resident.to_numpy()) & (w_first - w_last >= 2)
        w_tid, w_last, w_first = w_tid[keep], w_last[keep], w_first[keep]
    else:
        w_tid = w_last = w_first = np.zeros(0, np.int64)

    start_op = np.concatenate([starts, w_last])
    end_op = np.concatenate([ends, w_first])
    tensor_id = np.concatenate([tids, w_tid])
    wraps = np.r_[np.zeros(len(starts), bool), np.ones(len(w_tid), bool)]
    next_start = np.where(
        wraps, start_us[end_op % max(num_ops, 1)] + iter_us, start_us[np.minimum(end_op, num_ops - 1)]
    ) if num_ops else np.zeros(0)
    duration = next_start - end_us[start_op] if num_ops else np.zeros(0)
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
            "wraps": wraps,
        }
    )
