"""Lifetime-aware, bandwidth-aware greedy planning: the Teraio paper's Algorithm 1, made fast.

While the planned memory ``M'`` exceeds the capacity at some op, take the
inactive period with the best benefit/cost, where

- its *window* is from the op after its offload can complete (given the
  write bandwidth already reserved, NOTE [ Channel model ] in
  ``planner.channels``) to the op its prefetch must start at to be done before
  the op that needs it (given the read bandwidth already reserved);
- its *benefit* is the reduction of memory above capacity integrated over the
  window: ``sum_k duration_us[k] * min(size, M'[k] - capacity)`` over the
  window's ops that are over capacity;
- its *cost* is the time of the transfer out and back.

A trailing period (``reads_back`` false, NOTE [ Trailing periods ] in
``planner.problem``) is an offload-only candidate: its window runs from the op
after its offload can complete to its ``end_op`` (the storage's death), its
cost is the write alone, and it reserves no read bandwidth.

Destination: the SSD while any candidate fits its bandwidth; then host memory,
within the host-memory limit. What still does not fit is fixed by offloads that
ops wait for (see NOTE [ Stall fixes ]).

NOTE [ Lazy greedy ]: benefits only shrink as the plan grows (windows narrow
as bandwidth is reserved, ``M'`` only goes down), so a heap keyed by an upper
bound of each candidate's score gives the same choices as re-scoring every
candidate each round: pop the top, re-score it exactly, accept it if it still
beats the next key, else push it back with its new score. The initial keys
are upper bounds computed for all candidates at once with prefix sums; an
exact score is one numpy pass over the window.

Exact lazy greedy still re-scores most candidates after each choice when many
share the over-capacity stretch (every choice narrows it a little for all of
them). With ``tolerance = eps`` a re-scored candidate is accepted if its score
is within ``1 - eps`` of the best key left (the threshold greedy of
Badanidiyuru and Vondrak, SODA 2014): each choice is at least ``1 - eps`` times
as good as the best, and a candidate is re-scored O(log(range) / eps) times
instead of once per choice. ``tolerance = 0`` is exact (tested).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, replace

import numpy as np

from planner.channels import Channel
from planner.hardware import Hardware
from planner.problem import PlanProblem, check_capacity

__all__ = ["DEFAULT_TOLERANCE", "Move", "plan_greedy"]


@dataclass(frozen=True)
class Move:
    """One planned inactive period: its offload and its prefetch, on the unrolled op axis.

    An offload starts before op ``offload_trigger`` and must be complete
    before op ``offload_deadline`` (-1: no deadline; its memory is counted
    free only once it is complete). A prefetch starts before op
    ``prefetch_trigger`` (its memory is counted from then) and must be complete
    before op ``prefetch_deadline``, the next use. Channels serve transfers by
    ``priority`` (lower first), urgent ones before all others.

    A move of a trailing period (``reads_back`` false) has no prefetch: the
    storage dies at ``end_op`` (``prefetch_trigger == prefetch_deadline ==
    end_op``), and its offloaded copy with it.
    """

    period: int
    tensor_id: int
    size_bytes: int
    target: str  # "ssd" | "host"
    start_op: int
    end_op: int
    offload_trigger: int
    offload_deadline: int
    prefetch_trigger: int
    prefetch_deadline: int
    priority: int
    prefetch_priority: int = -1  # -1: the same as ``priority``
    urgent_offload: bool = False
    urgent_prefetch: bool = False
    reads_back: bool = True

    @property
    def read_priority(self) -> int:
        return self.priority if self.prefetch_priority < 0 else self.prefetch_priority

    def with_urgency(self, offload: bool, prefetch: bool) -> Move:
        return replace(self, urgent_offload=self.urgent_offload or offload,
                       urgent_prefetch=self.urgent_prefetch or prefetch)


# Scores are compared rounded to 32 significant bits (about 1e-10 relative): windows
# that differ only by float noise tie, and ties go to the larger tensor, then the
# lower period index.
_BITS = 32


def quantize_array(x: np.ndarray) -> np.ndarray:
    """``x`` (>= 0) rounded to ``_BITS`` significant bits; monotone, 0 stays 0."""
    mantissa, exponent = np.frexp(np.asarray(x, np.float64))
    return np.ldexp(np.round(mantissa * 2.0**_BITS), exponent - _BITS)


def quantize(x: float) -> float:
    mantissa, exponent = math.frexp(x)
    return math.ldexp(round(mantissa * 2.0**_BITS), exponent - _BITS)


class _BlockPrefix:
    """Prefix sums of a per-op array under slice updates: O(1) queries, O(slice + n / block) updates."""

    def __init__(self, values: np.ndarray, block: int = 512) -> None:
        n = len(values)
        self.block = block
        num_blocks = max(-(-n // block), 1)
        self.vals = np.zeros((num_blocks, block))
        self.vals.reshape(-1)[:n] = values
        self.local = np.cumsum(self.vals, axis=1)  # inclusive prefix inside each block
        self.before = np.zeros(num_blocks + 1)  # sum of the blocks before block j
        np.cumsum(self.local[:, -1], out=self.before[1:])

    def prefix(self, k: int) -> float:
        """Sum of ``values[:k]``."""
        if k <= 0:
            return 0.0
        j, r = divmod(k - 1, self.block)
        return float(self.before[j] + self.local[j, r])

    def assign(self, lo: int, hi: int, values: np.ndarray) -> None:
        """``values[lo:hi] = values``."""
        if hi <= lo:
            return
        self.vals.reshape(-1)[lo:hi] = values
        j0, j1 = lo // self.block, (hi - 1) // self.block + 1
        np.cumsum(self.vals[j0:j1], axis=1, out=self.local[j0:j1])
        np.cumsum(self.local[:, -1], out=self.before[1:])


class _BlockExact:
    """Exact window sums of duration * min(over, size), block by block.

    ``over`` changes as the plan grows; per block of ``block`` ops this keeps its
    largest value and its smallest positive one. A block whose ``over`` stays at
    or under ``size`` contributes its sum of duration * over, one whose positive
    values are all at least ``size`` contributes size * its busy duration (both
    block totals of ``sums``/``busy``), and only the few blocks where ``over``
    crosses ``size`` are summed element by element. The memory curve changes
    gradually, so most blocks are of the first two kinds.
    """

    def __init__(self, tau: np.ndarray, over: np.ndarray, sums: _BlockPrefix, busy: _BlockPrefix) -> None:
        self.block = b = sums.block
        self.num_blocks = nb = sums.vals.shape[0]
        self.tau2d = np.zeros((nb, b))  # (num_blocks, block): durations, 0 past the last op
        self.tau2d.reshape(-1)[:len(tau)] = tau
        self.over2d = np.zeros((nb, b))  # a copy of ``over`` kept by ``refresh``
        self.over2d.reshape(-1)[:len(over)] = over
        self.sums, self.busy = sums, busy
        self.max = np.zeros(nb)
        self.min_pos = np.full(nb, np.inf)
        self.refresh(0, len(over), over)

    def refresh(self, lo: int, hi: int, over: np.ndarray) -> None:
        """``over[lo:hi]`` changed: copy it in and recompute the blocks it touches."""
        if hi <= lo:
            return
        b = self.block
        self.over2d.reshape(-1)[lo:hi] = over[lo:hi]
        j0, j1 = lo // b, (hi - 1) // b + 1
        blocks = self.over2d[j0:j1]
        self.max[j0:j1] = blocks.max(axis=1)
        self.min_pos[j0:j1] = np.where(blocks > 0, blocks, np.inf).min(axis=1)

    def window(self, lo: int, hi: int, size: float) -> float:
        b = self.block
        j0, j1 = -(-lo // b), hi // b  # the whole blocks inside [lo, hi)
        flat_t, flat_o = self.tau2d.reshape(-1), self.over2d.reshape(-1)
        if j0 >= j1:
            return float(flat_t[lo:hi] @ np.minimum(flat_o[lo:hi], size))
        total = float(flat_t[lo:j0 * b] @ np.minimum(flat_o[lo:j0 * b], size))
        total += float(flat_t[j1 * b:hi] @ np.minimum(flat_o[j1 * b:hi], size))
        under = self.max[j0:j1] <= size
        above = ~under & (self.min_pos[j0:j1] >= size)
        total += float(self.sums.local[j0:j1, -1][under].sum())
        total += size * float(self.busy.local[j0:j1, -1][above].sum())
        crossing = np.flatnonzero(~(under | above)) + j0
        if len(crossing):
            total += float((self.tau2d[crossing] * np.minimum(self.over2d[crossing], size)).sum())
        return total


class _Planner:
    """The mutable state of one planning run (the public entry point is ``plan_greedy``)."""

    def __init__(self, problem: PlanProblem, hw: Hardware) -> None:
        self.p = problem
        self.hw = hw
        n = problem.num_ops
        self.n = n
        self.tau = problem.duration_us
        self.over = np.maximum(problem.memory_bytes - hw.gpu_mem_bytes, 0).astype(np.float64)
        self.num_over = int(np.count_nonzero(self.over))
        # For upper bounds of benefits in O(1): sum of duration * over, and of duration where over > 0.
        self.sum_over = _BlockPrefix(self.tau * self.over)
        self.sum_busy = _BlockPrefix(self.tau * (self.over > 0))
        self.exact = _BlockExact(self.tau, self.over, self.sum_over, self.sum_busy)
        slot_s = problem.duration_us * 1e-6
        self.channels = {
            name: Channel(bw * slot_s) for name, bw in hw.channel_bw().items()
        }
        self.host_used = np.zeros(n, np.float64)
        self.selected = np.zeros(problem.num_periods, bool)
        self.moves: list[Move] = []
        self.windows: list[tuple[int, int]] = []  # per move: [first op, end op) of freed memory

    # ---- window arithmetic on the unrolled axis ------------------------------------------
    def _segments(self, a: int, b: int) -> list[tuple[int, int]]:
        n = self.n
        if b <= n:
            return [(a, b)]
        if a >= n:
            return [(a - n, b - n)]
        return [(a, n), (0, b - n)]

    def _benefit(self, a: int, b: int, size: float) -> float:
        return sum(self.exact.window(lo, hi, size) for lo, hi in self._segments(a, b))

    def _upper_bound(self, a: int, b: int, size: float) -> float:
        """An upper bound of ``_benefit`` in O(1): min(sum tau * over, size * sum tau [over > 0])."""
        t_over = t_busy = 0.0
        for lo, hi in self._segments(a, b):
            t_over += self.sum_over.prefix(hi) - self.sum_over.prefix(lo)
            t_busy += self.sum_busy.prefix(hi) - self.sum_busy.prefix(lo)
        return min(t_over, size * t_busy) * (1 + 1e-9) + 1e-9  # float noise must not make it too low

    def _free_memory(self, a: int, b: int, size: float) -> None:
        for lo, hi in self._segments(a, b):
            seg = self.over[lo:hi]
            before = int(np.count_nonzero(seg))
            np.maximum(seg - size, 0.0, out=seg)
            self.num_over -= before - int(np.count_nonzero(seg))
            tau = self.tau[lo:hi]
            self.sum_over.assign(lo, hi, tau * seg)
            self.sum_busy.assign(lo, hi, tau * (seg > 0))
            self.exact.refresh(lo, hi, self.over)

    # A host copy is held from the offload's trigger op through op ``end_op``, both
    # counted: the prefetch may end in that op's wait, and a trailing period's copy is
    # dropped when its storage dies, before ``end_op`` runs but after the offloads that op
    # triggers have started (planner.simulate).
    def _host_span(self, i: int) -> list[tuple[int, int]]:
        s, e = int(self.p.start_op[i]), int(self.p.end_op[i]) + 1
        return self._segments(s + 1, min(e, s + 1 + self.n))

    def _host_fits(self, i: int) -> bool:
        limit = self.hw.host_mem_bytes
        size = float(self.p.size_bytes[i])
        if size > limit:
            return False
        return all(hi <= lo or float(self.host_used[lo:hi].max()) + size <= limit
                   for lo, hi in self._host_span(i))

    def _take_host(self, i: int) -> None:
        for lo, hi in self._host_span(i):
            self.host_used[lo:hi] += float(self.p.size_bytes[i])

    def _window(self, i: int, target: str) -> tuple[int, int]:
        """First op with the memory free and the op the prefetch starts at (a trailing
        period: its end), on ``target``."""
        s, e, size = int(self.p.start_op[i]), int(self.p.end_op[i]), float(self.p.size_bytes[i])
        done = self.channels[f"{target}_write"].earliest_end(s + 1, size)
        if not self.p.reads_back[i]:
            return done + 1, e
        start = self.channels[f"{target}_read"].latest_start(e, size)
        return done + 1, start

    def _cost_per_byte(self, i: int, target: str) -> float:
        """Seconds per byte of period ``i``'s transfers on ``target``: out, and back unless trailing."""
        bw = self.hw.channel_bw()
        return 1 / bw[f"{target}_write"] + (1 / bw[f"{target}_read"] if self.p.reads_back[i] else 0.0)

    # ---- the greedy stages ------------------------------------------------------------------
    def _initial_keys(self, candidates: np.ndarray, target: str) -> list[tuple[float, float, int, int, int]]:
        """Heap entries ``(-upper bound of score, -size, period, window first op, window end)``
        for fresh ``target`` channels."""
        p, n = self.p, self.n
        s, e = p.start_op[candidates], p.end_op[candidates]
        back = p.reads_back[candidates]
        size = p.size_bytes[candidates].astype(np.float64)
        bw_w = getattr(self.hw, "ssd_write_bw_bytes_per_s" if target == "ssd" else "host_bw_bytes_per_s")
        bw_r = getattr(self.hw, "ssd_read_bw_bytes_per_s" if target == "ssd" else "host_bw_bytes_per_s")
        cap2 = np.tile(self.tau * 1e-6, 2)
        cw = np.concatenate([[0.0], np.cumsum(cap2 * bw_w)])
        cr = np.concatenate([[0.0], np.cumsum(cap2 * bw_r)])
        first = np.searchsorted(cw, cw[s + 1] + size - 0.5, side="left")  # = done slot + 1
        last = np.searchsorted(cr, cr[e] - size + 0.5, side="right") - 1  # prefetch start slot
        last = np.where(back, last, e)  # a trailing period's memory is free until it dies
        first = np.minimum(first, 2 * n)
        last = np.clip(last, 0, 2 * n)
        t_over = np.concatenate([[0.0], np.cumsum(np.tile(self.tau * self.over, 2))])
        t_any = np.concatenate([[0.0], np.cumsum(np.tile(self.tau * (self.over > 0), 2))])
        hi = np.maximum(last, first)
        ub = np.minimum(t_over[hi] - t_over[first], size * (t_any[hi] - t_any[first]))
        ub = np.where(last > first, ub, 0.0)
        cost = size / bw_w + np.where(back, size / bw_r, 0.0)
        score = quantize_array(ub * (1 + 1e-9) / cost)  # stays >= exact despite rounding
        keep = score > 0
        return list(zip((-score[keep]).tolist(), (-size[keep]).tolist(), candidates[keep].tolist(),
                        first[keep].tolist(), last[keep].tolist(), strict=True))

    def greedy_stage(self, target: str, tolerance: float = 0.0) -> None:
        """Accept candidates on ``target`` by best benefit/cost until memory fits or none helps.

        See NOTE [ Lazy greedy ] for ``tolerance``.
        """
        p = self.p
        # Out at s + 1 at the earliest, free from s + 2, back by e - 1 at the latest (or dead at e).
        useful = (p.end_op - p.start_op >= np.where(p.reads_back, 4, 3)) & ~self.selected
        heap = self._initial_keys(np.flatnonzero(useful), target)
        heapq.heapify(heap)
        while heap and self.num_over > 0:
            neg_key, neg_size, i, first, start = heapq.heappop(heap)
            size = -neg_size
            per_cost = 1.0 / (size * self._cost_per_byte(i, target))
            # Cheapest first: the bound over the window it had (windows only narrow), then the
            # bound over its current window, then the exact score; each is an upper bound of the
            # next (and the key it had stays one), so a candidate that loses at any step is
            # pushed back with that bound.
            score = min(-neg_key, quantize(self._upper_bound(first, start, size) * per_cost))
            if score <= 0:
                continue
            if not self._wins(heap, (-score, neg_size, i), tolerance):
                heapq.heappush(heap, (-score, neg_size, i, first, start))
                continue
            if target == "host" and not self._host_fits(i):
                continue  # host use only grows: it never fits again
            first, start = self._window(i, target)
            if start <= first:
                continue  # windows only narrow: never feasible again
            for exact in (False, True):
                benefit = self._benefit(first, start, size) if exact else self._upper_bound(first, start, size)
                score = min(score, quantize(benefit * per_cost))
                if score <= 0 or not self._wins(heap, (-score, neg_size, i), tolerance):
                    break
            else:
                self._accept(i, target, first, start)
                continue
            if score > 0:
                heapq.heappush(heap, (-score, neg_size, i, first, start))

    @staticmethod
    def _wins(heap: list[tuple[float, float, int, int, int]], key: tuple[float, float, int],
              tolerance: float) -> bool:
        """Whether a candidate with ``key`` may be accepted before everything left in ``heap``."""
        if not heap:
            return True
        top = heap[0]
        return key <= top[:3] or (tolerance > 0 and -key[0] >= (1.0 - tolerance) * -top[0])

    def _accept(self, i: int, target: str, first: int, start: int) -> None:
        p = self.p
        s, size = int(p.start_op[i]), float(p.size_bytes[i])
        self.channels[f"{target}_write"].reserve(s + 1, size)
        if p.reads_back[i]:
            self.channels[f"{target}_read"].reserve(start, size)
        self._add_move(i, target, first, start)

    def _add_move(self, i: int, target: str, first: int, start: int) -> None:
        """Record period ``i``'s move (bandwidth already reserved): memory free over ``[first, start)``."""
        p = self.p
        s, e, size = int(p.start_op[i]), int(p.end_op[i]), float(p.size_bytes[i])
        if target == "host":
            self._take_host(i)
        self._free_memory(first, start, size)
        self.selected[i] = True
        self.windows.append((first, start))
        self.moves.append(Move(
            period=i, tensor_id=int(p.tensor_id[i]), size_bytes=int(size), target=target,
            start_op=s, end_op=e, offload_trigger=s + 1, offload_deadline=first,
            prefetch_trigger=start, prefetch_deadline=e, priority=len(self.moves),
            reads_back=bool(p.reads_back[i]),
        ))

    # NOTE [ Stall fixes ]: when no candidate fits the bandwidth and memory is
    # still over capacity at op k, some tensor idle at k must be out before k
    # even if the op then waits for its offload (a stall; the transfer becomes
    # urgent). Ops are fixed in order; at each, the idle tensors of trailing
    # periods go first (nothing comes back), then those whose next use is
    # furthest away (their prefetch has most time). If those run out, planned
    # moves whose offload is still in flight at k get deadline k, and those
    # whose prefetch has started by k start after k instead.
    def fix_with_stalls(self) -> None:
        p, n = self.p, self.n
        s, e = p.start_op, p.end_op
        cand = np.flatnonzero(~self.selected & (e - s >= 2))
        # Each period covers unrolled ops [s+1, e); a wrapping one also covers [0, e-n) of this iteration.
        add = np.concatenate([s[cand] + 1, s[cand] + 1 - n])
        end = np.concatenate([e[cand], e[cand] - n])
        shift = np.concatenate([np.zeros(len(cand), np.int64), np.full(len(cand), n)])
        who = np.concatenate([cand, cand])
        ok = end > np.maximum(add, 0)
        add, end, shift, who = add[ok], end[ok], shift[ok], who[ok]
        order = np.argsort(np.maximum(add, 0), kind="stable")
        add_at = np.maximum(add[order], 0).tolist()
        events = list(zip(p.reads_back[who[order]].astype(int).tolist(), (-end[order]).tolist(),
                          who[order].tolist(), shift[order].tolist(), strict=True))
        heap: list[tuple[int, int, int, int]] = []
        nxt = 0
        for k in np.flatnonzero(self.over > 0).tolist():
            if self.over[k] <= 0:
                continue
            while nxt < len(events) and add_at[nxt] <= k:
                heapq.heappush(heap, events[nxt])
                nxt += 1
            while self.over[k] > 0 and heap:
                _, neg_end, i, sh = heapq.heappop(heap)
                if -neg_end <= k or self.selected[i]:
                    continue
                self._accept_stalling(i, k + sh)
            if self.over[k] > 0:
                self._stretch_moves(k)

    def _accept_stalling(self, i: int, k: int) -> None:
        """Plan period ``i`` so that its memory is free at unrolled op ``k``, stalling if need be."""
        p = self.p
        s, e, size = int(p.start_op[i]), int(p.end_op[i]), float(p.size_bytes[i])
        target = "ssd"
        if self.hw.host_mem_bytes > 0 and self._host_fits(i):
            ssd_done = self.channels["ssd_write"].earliest_end(s + 1, size)
            host_done = self.channels["host_write"].earliest_end(s + 1, size)
            target = "host" if host_done < ssd_done else "ssd"
        done = self.channels[f"{target}_write"].reserve(s + 1, size)
        first = min(done + 1, k)
        if not p.reads_back[i]:
            self._add_move(i, target, first, e)
            return
        read = self.channels[f"{target}_read"]
        start = read.latest_start(e, size)
        if start <= k:  # the read channel is taken: the prefetch will be late, but not early
            start = read.latest_start_alone(e, size)
        start = min(max(start, k + 1), e)
        read.reserve(start, size)
        self._add_move(i, target, first, start)

    def _stretch_moves(self, k: int) -> None:
        """Widen planned windows to cover op ``k`` (see NOTE [ Stall fixes ])."""
        n = self.n
        for m, mv in enumerate(self.moves):
            if self.over[k] <= 0:
                return
            for ku in (k, k + n):
                if not mv.start_op < ku < mv.end_op:
                    continue
                first, start = self.windows[m]
                if ku < first:
                    self._free_memory(ku, first, mv.size_bytes)
                    self.windows[m] = (ku, start)
                    self.moves[m] = replace(mv, offload_deadline=ku)
                elif ku >= start:
                    self._free_memory(start, ku + 1, mv.size_bytes)
                    self.windows[m] = (first, ku + 1)
                    self.moves[m] = replace(mv, prefetch_trigger=ku + 1)
                break


# Measured (BENCHMARKS.md, planner tolerance): against exact greedy, 0.1 moves the same bytes
# and predicts an iteration time within 0.3%, at 3 to 40 times less planning time than 0.02 or 0.
DEFAULT_TOLERANCE = 0.1


def plan_greedy(problem: PlanProblem, hw: Hardware, *, tolerance: float = DEFAULT_TOLERANCE) -> list[Move]:
    """The moves that bring ``problem``'s memory under ``hw.gpu_mem_bytes``, in priority order.

    ``tolerance`` (NOTE [ Lazy greedy ]): 0 makes exactly Algorithm 1's
    choices; ``eps > 0`` accepts a candidate whose score is within a factor
    ``1 - eps`` of the best one's, which bounds how often a candidate is
    re-scored. Raises ``InfeasibleBudgetError`` if some op needs more than the
    capacity resident at once. Pure: no I/O, the problem is not modified.
    """
    if not 0.0 <= tolerance < 1.0:
        raise ValueError(f"tolerance must be in [0, 1), not {tolerance}")
    check_capacity(problem, hw.gpu_mem_bytes)
    planner = _Planner(problem, hw)
    if planner.num_over:
        planner.greedy_stage("ssd", tolerance)
    if planner.num_over and hw.host_mem_bytes > 0:
        planner.greedy_stage("host", tolerance)
    if planner.num_over:
        planner.fix_with_stalls()
    return planner.moves
