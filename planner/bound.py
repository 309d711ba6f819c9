"""Lower bounds on the iteration time of any plan, from bytes and bandwidth alone.

NOTE [ Transfer bound ]: take any plan that fits (the simulator's model,
``planner.simulate``: a tensor's bytes are free once its offload completes and
counted again from the moment its prefetch starts; every prefetch reads the
whole tensor, every offload writes it unless it reuses a kept copy) and a
*window*, a run of ops ``[a, b]``.
Cut the iteration at the moment each window's first op is reached (before its
stall); the windows' stretches of time partition the iteration, and each is at
least its ops' compute time. Within the stretch of ``[a, b]``:

- *reads*: let ``A`` be the bytes of the tensors alive at op ``a`` that some
  op of ``[a, b]`` accesses. At most ``capacity`` bytes are resident when ``a``
  runs, so at least ``A - capacity`` of them are out then, with no prefetch
  started; each is read back, whole, after ``a`` starts and before its access,
  inside the stretch.
- *writes*: let ``Z`` be the bytes of the tensors alive at op ``b`` that some
  op of ``[a, b]`` accesses. At most ``capacity`` are resident when ``b``
  runs; each of the others was resident at its access in ``[a, b)``, so its
  offload started after that access and completed before ``b`` starts: at
  least ``Z - capacity`` bytes written inside the stretch. An unchanged
  period's offload may write nothing (NOTE [ Copies kept ] in
  ``planner.clean``), so ``Z`` counts none of those idle at ``b``: the ones
  that must be out can be them. A storage no op uses (NOTE [ Untouched
  storages ] in ``profiles.views``) is written once and stays out, which the
  simulator counts, but its write is left in here: for a profile with such
  storages this bounds plans that write them each iteration, a little above
  the best (left so because the greedy's clocks are paced by this bound: left
  out, a copy script's plan at half its peak ran 8.5 ms against 4.6).
- *host memory*: a tensor is out in one place; those read back (written out)
  from host memory were in host memory at ``a`` (at ``b``), at most
  ``host_mem_bytes`` of them. The SSD carries the rest.

So the stretch takes at least ``max(compute, t_read(A - capacity),
t_write(Z - capacity))``, where ``t(x)`` is the least time ``x`` bytes take on
the SSD and host channels of one direction running at once, no more than
``host_mem_bytes`` of them on the host; and the iteration at least the sum over
the windows. The window's first and last ops need not be where the most is at
stake: the same reasoning holds from any op ``a'`` of the window to its end
(its reads start after ``a'`` is reached, which is at least the compute of
``[a, a')`` after ``a`` is), and from its start to any op ``b'`` (its writes end
before ``b'`` starts, and ``[b', b]`` runs after), so the stretch takes at least
``compute[a, a') + t_read(A(a') - capacity)`` and ``t_write(Z(b') - capacity) +
compute[b', b]`` for every ``a'`` and ``b'`` in it, with ``A(a')`` the bytes
alive at ``a'`` that some op of ``[a', b]`` accesses and ``Z(b')`` those alive
at ``b'`` that some op of ``[a, b']`` accesses. Where a backward pass starts by
making the loss's gradient, its memory peaks a few ops in: for Llama3-8B at
batch 16 on 80 GiB, 3.9 GiB above its first op, which the window's first op
alone does not see. Any set of windows that covers the iteration in order
gives a bound; the function reports three and their maximum:

- *peak*: one window, the whole iteration from its peak op (for the reads)
  and the whole iteration up to the peak op (for the writes): the bytes out at
  the peak leave and come back once. When every tensor alive at the peak is
  used in the iteration, ``A = Z = peak``.
- *phases*: a window per run of ops of one phase (each micro-batch's forward,
  its backward, the optimizer step), each at its tightest ``a'`` and ``b'``. It
  sees what the peak bound cannot: an optimizer step that touches every
  parameter, gradient and moment in a short time must read all that is out
  when it starts within that time.
- *merged*: the same over runs of up to ``MERGED`` adjacent phase windows,
  the best partition of the iteration into such runs (a dynamic program over
  the runs, each at its tightest ``a'`` and ``b'``). A run sees what its
  windows alone do not: for Llama3-8B at batch 16 on one H100 with the SSD
  alone, the optimizer step's states (its moments among them, idle all the
  backward pass) must be read while the last backward pass reads its own
  inputs, with the same capacity for both: that backward pass and the step
  take at least 6.29 s, against 3.19 s and 2.67 s alone, and the iteration at
  least 55.09 s, against 53.62 s by the phases (at batch 16 with host memory
  51.51 s against 51.47 s, Llama3-70B at batch 16 with host memory 471.23 s
  against 470.98 s). Runs of more than two windows bounded none of
  ``bench/policies.py``'s one-GPU cases more tightly, searched up to the
  whole iteration (2026-11-27); runs of up to three are tried.
  The planner's clocks are paced by the phase windows alone
  (``planner.pace``).

``A`` and ``Z`` are counted from the problem's inactive periods and the bytes
each op accesses; a tensor idle at ``a`` whose period the problem leaves out (of
size 0, or shorter than one op) is not counted, which only lowers the bound.
What an op allocates inside itself (NOTE [ Scratch ] in ``torch_patch.tracer``)
must be resident while it runs as its inputs and outputs must, and counts with
them: at most ``capacity`` bytes are in at ``a`` (``b``), the scratch among them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.hardware import Hardware
from planner.problem import PlanProblem

__all__ = ["MERGED", "Bound", "iteration_bound", "phase_windows", "transfer_us"]

MERGED = 3
"""The most adjacent phase windows one run of the merged bound holds (NOTE [ Transfer bound ])."""


@dataclass(frozen=True)
class Bound:
    """Lower bounds of the iteration time of any plan that fits, in microseconds."""

    ideal_us: float
    """The ops back to back."""
    peak_us: float
    """The bytes out at the peak op, moved out and back once (NOTE [ Transfer bound ], peak)."""
    phases_us: float
    """The sum over the phase windows (NOTE [ Transfer bound ], phases)."""
    merged_us: float
    """The most of the sums over runs of adjacent phase windows (NOTE [ Transfer bound ], merged)."""
    window_first_op: np.ndarray  # (num_windows,) int64: each phase window's first op
    window_compute_us: np.ndarray  # (num_windows,) float64: its ops' time
    window_read_bytes: np.ndarray  # (num_windows,) float64: the least it must read back (the most from any op of it)
    window_write_bytes: np.ndarray  # (num_windows,) float64: the least it must write out (the most up to any op)
    # (num_windows,) float64: the least time its reads or writes hold it, the compute before
    # the reads can start or after the writes must end included
    window_transfer_us: np.ndarray
    window_us: np.ndarray  # (num_windows,) float64: the least time it takes: the larger of the two times

    @property
    def iteration_us(self) -> float:
        """The tightest of the bounds."""
        return max(self.ideal_us, self.peak_us, self.phases_us, self.merged_us)


def transfer_us(num_bytes: float | np.ndarray, ssd_bw_bytes_per_s: float, host_bw_bytes_per_s: float,
                host_mem_bytes: float) -> np.ndarray:
    """The least microseconds ``num_bytes`` take on an SSD channel and a host channel of one direction
    at once, at most ``host_mem_bytes`` of them on the host (the split that evens the two out, or all
    the host can take)."""
    x = np.maximum(np.asarray(num_bytes, np.float64), 0.0)
    on_host = np.minimum(np.minimum(x * host_bw_bytes_per_s / (ssd_bw_bytes_per_s + host_bw_bytes_per_s),
                                    float(host_mem_bytes)), x)
    return np.maximum((x - on_host) / ssd_bw_bytes_per_s, on_host / host_bw_bytes_per_s) * 1e6


def _t_read(x: np.ndarray, hw: Hardware) -> np.ndarray:
    return transfer_us(x, hw.ssd_read_bw_bytes_per_s, hw.host_bw_bytes_per_s, hw.host_mem_bytes)


def _t_write(x: np.ndarray, hw: Hardware) -> np.ndarray:
    return transfer_us(x, hw.ssd_write_bw_bytes_per_s, hw.host_bw_bytes_per_s, hw.host_mem_bytes)


def phase_windows(problem: PlanProblem) -> np.ndarray:
    """(num_windows,) int64: the first op of each run of ops of one phase (at least op 0)."""
    phase = problem.phase
    if problem.num_ops == 0:
        return np.zeros(0, np.int64)
    change = np.r_[True, phase[1:] != phase[:-1]]
    return np.flatnonzero(change).astype(np.int64)


def _periods_unrolled(problem: PlanProblem) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every period three times, shifted by ``-n``, 0 and ``n`` (NOTE [ Unrolled op axis ] in
    ``planner.problem``): ``(start_op, end_op, size, reads_back, written)`` on an axis of ops
    ``[-n, 3n)``; ``written``: not unchanged, so its offload writes (NOTE [ Unchanged periods ])."""
    n = problem.num_ops
    shifts = np.repeat(np.array([-n, 0, n], np.int64), problem.num_periods)
    written = np.ones(problem.num_periods, bool) if problem.unchanged is None else ~problem.unchanged
    return (np.tile(problem.start_op, 3) + shifts, np.tile(problem.end_op, 3) + shifts,
            np.tile(problem.size_bytes.astype(np.float64), 3), np.tile(problem.reads_back, 3),
            np.tile(written, 3))


def _own_bytes(problem: PlanProblem) -> np.ndarray:
    """(num_ops,) float64: what each op needs resident itself, its inputs, outputs and scratch (NOTE
    [ Scratch ] in torch_patch.tracer)."""
    return problem.active_bytes.astype(np.float64) + problem.scratch


def _used_bytes(problem: PlanProblem, first: np.ndarray, last: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per window ``[first, last]`` (unrolled ops, ``last < first + n``, both in ``[0, 2n)``): the bytes
    alive at ``first`` that the window accesses (``A``) and those alive at ``last`` (``Z``).

    A: accessed by op ``first``, or idle there (``s < first < e``) until a use ``e <= last``.
    Z: accessed by op ``last``, or idle there (``s < last < e``) since a use ``s >= first``.
    """
    n = problem.num_ops
    s, e, size, back, written = _periods_unrolled(problem)
    act = _own_bytes(problem)
    reads = np.empty(len(first))
    writes = np.empty(len(first))
    for w, (a, b) in enumerate(zip(first.tolist(), last.tolist(), strict=True)):
        reads[w] = act[a % n] + size[back & (s < a) & (a < e) & (e <= b)].sum()
        writes[w] = act[b % n] + size[written & (s >= a) & (s < b) & (b < e)].sum()
    return reads, writes


def _used_bytes_per_op(problem: PlanProblem, first: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(num_ops,) ``A(k)`` and ``Z(k)`` of each op ``k`` in its window (windows start at ``first``, which
    cover the iteration in order): the bytes alive at ``k`` that an op from ``k`` to the window's last
    accesses, and those that an op from the window's first to ``k`` accesses; as ``_used_bytes`` of the
    windows ``[k, last]`` and ``[first, k]``, for every op at once."""
    n = problem.num_ops
    first = np.asarray(first, np.int64)
    window = np.searchsorted(first, np.arange(n), side="right") - 1
    win_first, win_end = first[window], np.r_[first[1:], n][window]  # per op; the end excluded
    s, e, size, back, written = _periods_unrolled(problem)

    def swept(lo: np.ndarray, hi: np.ndarray, sz: np.ndarray) -> np.ndarray:
        keep = hi > lo
        diff = np.zeros(n + 1)
        np.add.at(diff, lo[keep], sz[keep])
        np.add.at(diff, hi[keep], -sz[keep])
        return np.cumsum(diff)[:n]

    act = _own_bytes(problem)
    # A(k): a period read back at e counts at the ops k of e's window with s < k < e.
    sel = back & (e >= 0) & (e < n)
    reads = act + swept(np.maximum(s[sel] + 1, win_first[e[sel]]), e[sel], size[sel])
    # Z(k): a period idle from s on counts at the ops k of s's window with s < k < e, unless
    # its offload may write nothing (NOTE [ Transfer bound ], writes).
    sel = written & (s >= 0) & (s < n)
    writes = act + swept(s[sel] + 1, np.minimum(e[sel], win_end[s[sel]]), size[sel])
    return reads, writes


def iteration_bound(problem: PlanProblem, hw: Hardware) -> Bound:
    """The bounds of NOTE [ Transfer bound ] for ``problem`` on ``hw``."""
    n = problem.num_ops
    ideal = problem.ideal_iteration_us
    if n == 0:
        empty = np.zeros(0)
        return Bound(ideal, ideal, ideal, ideal, np.zeros(0, np.int64), empty, empty, empty, empty, empty)
    cap = float(hw.gpu_mem_bytes)

    # The peak: reads over the iteration from the peak op, writes over the iteration up to it.
    # Each op gives a bound; that of the op with the most tensor bytes, and that of the op that
    # needs most with its scratch (NOTE [ Scratch ] in torch_patch.tracer) counted, are taken.
    tensors = problem.memory_bytes - problem.scratch
    at = np.unique([int(problem.memory_bytes.argmax()), int(tensors.argmax())])
    reads, _ = _used_bytes(problem, at, at + n - 1)
    _, writes = _used_bytes(problem, at + 1, at + n)
    peak = max(ideal, float(_t_read(reads - cap, hw).max()), float(_t_write(writes - cap, hw).max()))

    first = phase_windows(problem)
    compute, reads, writes, transfer, per_window = _windows(problem, hw, first)
    return Bound(ideal_us=ideal, peak_us=peak, phases_us=float(per_window.sum()),
                 merged_us=_merged_us(problem, hw, first, per_window), window_first_op=first,
                 window_compute_us=compute, window_read_bytes=reads, window_write_bytes=writes,
                 window_transfer_us=transfer, window_us=per_window)


def _windows(problem: PlanProblem, hw: Hardware, first: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per window (windows start at ``first``, which cover the iteration in order, ``first[0] == 0``):
    its ops' time, the least it must read back and write out (the most from, and up to, any op of
    it), the least time those hold it, and the least time it takes (NOTE [ Transfer bound ])."""
    n = problem.num_ops
    cap = float(hw.gpu_mem_bytes)
    reads, writes = _used_bytes_per_op(problem, first)
    reads, writes = np.maximum(reads - cap, 0.0), np.maximum(writes - cap, 0.0)
    # Per op k of a window: the compute of its ops before k, and of k and those after.
    d = problem.duration_us
    compute = np.add.reduceat(d, first)
    ops = np.diff(np.r_[first, n])
    before = np.cumsum(d) - d - np.repeat(np.cumsum(compute) - compute, ops)
    after = np.repeat(compute, ops) - before
    read_us = np.maximum.reduceat(before + _t_read(reads, hw), first)
    write_us = np.maximum.reduceat(_t_write(writes, hw) + after, first)
    transfer = np.maximum(read_us, write_us)
    return (compute, np.maximum.reduceat(reads, first), np.maximum.reduceat(writes, first), transfer,
            np.maximum(compute, transfer))


def _merged_us(problem: PlanProblem, hw: Hardware, first: np.ndarray, single: np.ndarray) -> float:
    """The most, over the partitions of the phase windows (starting at ``first``, each alone taking
    ``single``) into runs of up to ``MERGED`` adjacent ones, of the sum of the runs' least times
    (NOTE [ Transfer bound ], merged)."""
    num = len(first)
    least = {(w, w + 1): float(single[w]) for w in range(num)}  # (first window, end window) -> us
    for length in range(2, min(MERGED, num) + 1):
        for offset in range(length):  # the runs [offset + i * length, ...) and [0, offset) cover it
            starts = ([0] if offset else []) + list(range(offset, num, length))
            per_run = _windows(problem, hw, first[starts])[4]
            for i, w in enumerate(starts):
                least[w, starts[i + 1] if i + 1 < len(starts) else num] = float(per_run[i])
    best = np.full(num + 1, -np.inf)
    best[0] = 0.0
    for end in range(1, num + 1):
        best[end] = max(best[w] + least[w, end] for w in range(max(0, end - MERGED), end))
    return float(best[num])
