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
- its *cost* is the time of the transfer out and back, and on a CPU the
  runtime's own work for each transfer (``Hardware.transfer_cost_s``).

A trailing period (``reads_back`` false, NOTE [ Trailing periods ] in
``planner.problem``) is an offload-only candidate: its window runs from the op
after its offload can complete to its ``end_op`` (the storage's death), its
cost is the write alone, and it reserves no read bandwidth.

Destination: the SSD while any candidate fits its bandwidth; then host memory,
within the host-memory limit. What still does not fit is fixed by offloads that
ops wait for (see NOTE [ Stall fixes ]). Last, each offload's deadline moves to
the first op that needs its room, and moves no op needs are dropped (NOTE [
Deadlines where memory is needed ]).

NOTE [ Lazy greedy ]: benefits only shrink as the plan grows (windows narrow
as bandwidth is reserved, ``M'`` only goes down), so each candidate's last
score is an upper bound of its score now: a *key*. The initial keys are upper
bounds computed for all candidates at once with prefix sums.

``tolerance = 0`` (exact, tested against re-scoring every candidate each
round): a heap of keys; re-score the top and accept it if it still beats the
next key. Scoring is batched: up to ``_BATCH`` entries are popped at once and
scored in one numpy pass (windows from ``planner.channels``, benefits from
``planner.excess``, NOTE [ Excess blocks ]). The scored ones since the last
choice are *fresh*; the first of them (in the order popped) that wins against
the other fresh ones and the heap's top is accepted, and the others go back
with their exact scores as keys.

``tolerance = eps > 0``: the threshold greedy in levels (after Badanidiyuru
and Vondrak, SODA 2014), with the keys in one array. A level starts at
``top``, the largest key, and accepts only candidates whose score now is at
least ``(1 - eps) * top``. Every key above that threshold that is not exact
is re-scored first, in batches of up to ``_LEVEL_CHUNK`` (if ``top`` falls,
the level starts again lower); then the best is accepted, and the others above
the threshold are re-checked in order, a few at a time, each accepted if its
score is still above. Guarantee: every accepted candidate scores at least
``1 - eps`` times the best score any candidate has at that moment (keys only
fall, so no candidate scores over the level's ``top``; tested). The level
ends when none above the threshold is left, or after ``_MAX_MISSES`` re-checks
in a row fall under it: every choice narrows the over-capacity stretch a
little for most candidates, so their scores tend to fall together, and the
next level re-scores them in one batch rather than one call each. A candidate
is re-scored about once per level it takes part in, and levels fall by about
``1 - eps`` each: some log(range) / eps times in all, as with the heap, but
nearly all of it in batches of thousands (at 100k ops, 3.2 million re-scorings
in 879 batches and 56 thousand single re-checks for 55 thousand choices).
A single re-check scores its candidate without a batch's array bookkeeping
(``_score_one``: the same windows and, up to float rounding, the same score;
tested), in about half the time of a batch of one (0.12 against 0.27 ms under
cProfile at 100k ops).
The choices differ from the heap's (BENCHMARKS.md, planner tolerance).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from planner.channels import Channel
from planner.excess import Excess, OverLedger
from planner.hardware import Hardware
from planner.problem import PlanProblem, check_capacity, cyclic_add

__all__ = ["DEFAULT_TOLERANCE", "Move", "plan_greedy"]


@dataclass(frozen=True)
class Move:
    """One planned inactive period: its offload and its prefetch, on the unrolled op axis.

    An offload starts before op ``offload_trigger``; the greedy counts its
    memory free from op ``offload_deadline`` on (-1: none), and an op waits
    for it only when it needs the room (NOTE [ Room ] in ``runtime.executor``).
    A prefetch starts before op ``prefetch_trigger`` (its memory is counted
    from then) and must be complete before op ``prefetch_deadline``, the next
    use. Channels serve transfers by
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
    # NOTE [ Copies kept ] in planner.clean: the offload writes nothing where the copy the
    # previous move's prefetch kept is still good; the prefetch keeps its copy for the next move.
    reuse_copy: bool = False
    keep_copy: bool = False

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

# Candidates scored at once (NOTE [ Lazy greedy ]): by the heap; at most, by the threshold levels.
_BATCH = 32
_LEVEL_CHUNK = 4096
_MAX_MISSES = 64
_ONE_BY_ONE = 4  # re-checks of at most this many candidates score them one at a time

Progress = Callable[[str], None]  # takes a line of text on how far a long plan is
_REPORT_EVERY_S = 5.0


def quantize_array(x: np.ndarray) -> np.ndarray:
    """``x`` (>= 0) rounded to ``_BITS`` significant bits; monotone, 0 stays 0."""
    mantissa, exponent = np.frexp(np.asarray(x, np.float64))
    return np.ldexp(np.round(mantissa * 2.0**_BITS), exponent - _BITS)


def quantize(x: float) -> float:
    """``quantize_array`` of one number (the same rounding: half to even)."""
    mantissa, exponent = math.frexp(x)
    return math.ldexp(round(mantissa * 2.0**_BITS), exponent - _BITS)


@dataclass
class _Candidates:
    """The candidates of one threshold stage (NOTE [ Lazy greedy ]), as parallel arrays."""

    cand: np.ndarray  # (m,) int64 period indices
    key: np.ndarray  # (m,) float64 upper bound of each score; 0: no longer helps
    first: np.ndarray = field(init=False)  # (m,) int64 the window when last scored: first op free
    start: np.ndarray = field(init=False)  # (m,) int64 ... and the op the prefetch starts at
    exact: np.ndarray = field(init=False)  # (m,) bool scored since the last acceptance: the key is exact

    def __post_init__(self) -> None:
        self.first = np.zeros(len(self.cand), np.int64)
        self.start = np.zeros(len(self.cand), np.int64)
        self.exact = np.zeros(len(self.cand), bool)


class _Planner:
    """The mutable state of one planning run (the public entry point is ``plan_greedy``)."""

    def __init__(self, problem: PlanProblem, hw: Hardware, progress: Progress | None = None) -> None:
        self.p = problem
        self.hw = hw
        self.progress = progress
        self._reported = time.monotonic()
        n = problem.num_ops
        self.n = n
        self.tau = problem.duration_us
        self.excess = Excess(self.tau, np.maximum(problem.memory_bytes - hw.gpu_mem_bytes, 0).astype(np.float64))
        slot_s = problem.duration_us * 1e-6
        latency = hw.latency_bytes()
        self.channels = {name: Channel(bw * slot_s, latency[name]) for name, bw in hw.channel_bw().items()}
        self.host_used = np.zeros(n, np.float64)
        self.selected = np.zeros(problem.num_periods, bool)
        self.moves: list[Move] = []
        # (capacity, 4) int64, a row per move: its period's start and end op, and the window
        # [first op, prefetch start) over which its memory is free; rows past len(moves) unused
        self.spans = np.zeros((64, 4), np.int64)
        self.num_over_at_start = self.excess.num_over
        self.ledger: OverLedger | None = None  # ``over`` during the stall fixes (fix_with_stalls)

    def _report(self) -> None:
        """Tell ``progress`` how far the plan is, at most every ``_REPORT_EVERY_S`` seconds."""
        now = time.monotonic()
        if self.progress is not None and now - self._reported >= _REPORT_EVERY_S:
            self._reported = now
            over = self.excess if self.ledger is None else self.ledger
            self.progress(f"{len(self.moves):,} moves so far; {over.num_over:,} of "
                          f"{self.num_over_at_start:,} ops still over capacity")

    # ---- window arithmetic on the unrolled axis ------------------------------------------
    def _segments(self, a: int, b: int) -> list[tuple[int, int]]:
        n = self.n
        if b <= n:
            return [(a, b)]
        if a >= n:
            return [(a - n, b - n)]
        return [(a, n), (0, b - n)]

    def _pieces(self, a: int, b: int) -> list[tuple[int, int, int]]:
        """``_segments(a, b)``, each with its offset: its unrolled ops are ``[lo + off, hi + off)``."""
        n = self.n
        if b <= n:
            return [(a, b, 0)]
        if a >= n:
            return [(a - n, b - n, n)]
        return [(a, n, 0), (0, b - n, n)]

    def _free_memory(self, a: int, b: int, size: float) -> None:
        over = self.excess if self.ledger is None else self.ledger
        for lo, hi in self._segments(a, b):
            over.free(lo, hi, size)

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

    def _windows(self, cand: np.ndarray, target: str) -> tuple[np.ndarray, np.ndarray]:
        """Per period of ``cand`` on ``target`` now: the first op with its memory free and the op its
        prefetch starts at (a trailing period: its end), on the unrolled axis."""
        p = self.p
        s, e, size = p.start_op[cand], p.end_op[cand], p.size_bytes[cand].astype(np.float64)
        first = np.minimum(self.channels[f"{target}_write"].earliest_end(s + 1, size) + 1, 2 * self.n)
        start = np.where(p.reads_back[cand], self.channels[f"{target}_read"].latest_start(e, size), e)
        return first, start

    def _cost_s(self, cand: np.ndarray, target: str, size: np.ndarray) -> np.ndarray:
        """Seconds of each period's transfers on ``target`` (out, and back unless trailing), each
        with the runtime's own work for it (``transfer_cost_s``: it makes a small tensor's move
        cost far more than its bytes)."""
        bw, back = self.hw.channel_bw(), self.p.reads_back[cand]
        per_byte = 1 / bw[f"{target}_write"] + np.where(back, 1 / bw[f"{target}_read"], 0.0)
        return size * per_byte + (1 + back) * self.hw.transfer_cost_s

    def _scores(self, cand: np.ndarray, target: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Exact benefit/cost of each period of ``cand`` on ``target`` now (0 if its window is empty),
        with its window ``[first, start)``."""
        n = self.n
        first, start = self._windows(cand, target)
        size = self.p.size_bytes[cand].astype(np.float64)
        # The window's parts in this iteration and in the next, as rows of one batch.
        parts = self.excess.benefits(np.concatenate([np.minimum(first, n), np.maximum(first, n) - n]),
                                     np.concatenate([np.minimum(start, n), np.maximum(start, n) - n]),
                                     np.concatenate([size, size]))
        score = quantize_array((parts[:len(cand)] + parts[len(cand):]) / self._cost_s(cand, target, size))
        return np.where(start > first, score, 0.0), first, start

    def _score_one(self, i: int, target: str) -> tuple[float, int, int]:
        """``_scores`` of the one period ``i``: the single re-checks after each acceptance."""
        n, p = self.n, self.p
        s, e, size = int(p.start_op[i]), int(p.end_op[i]), float(p.size_bytes[i])
        first = min(self.channels[f"{target}_write"].earliest_end_one(s + 1, size) + 1, 2 * n)
        back = bool(p.reads_back[i])
        start = self.channels[f"{target}_read"].latest_start_one(e, size) if back else e
        if start <= first:
            return 0.0, first, start
        benefit = (self.excess.benefit(min(first, n), min(start, n), size)
                   + self.excess.benefit(max(first, n) - n, max(start, n) - n, size))
        bw = self.hw.channel_bw()
        cost = (size * (1 / bw[f"{target}_write"] + (1 / bw[f"{target}_read"] if back else 0.0))
                + (1 + back) * self.hw.transfer_cost_s)  # as _cost_s
        return quantize(benefit / cost), first, start

    # ---- the greedy stages ------------------------------------------------------------------
    def _initial_key_array(self, cand: np.ndarray, target: str) -> np.ndarray:
        """(len(cand),) upper bounds of each candidate's score now, from prefix sums over each window."""
        first, start = self._windows(cand, target)
        last = np.maximum(start, first)
        size = self.p.size_bytes[cand].astype(np.float64)
        over = self.excess.values()
        t_over = np.concatenate([[0.0], np.cumsum(np.tile(self.tau * over, 2))])
        t_any = np.concatenate([[0.0], np.cumsum(np.tile(self.tau * (over > 0), 2))])
        ub = np.minimum(t_over[last] - t_over[first], size * (t_any[last] - t_any[first]))
        return quantize_array(ub * (1 + 1e-9) / self._cost_s(cand, target, size))  # stays >= exact

    def _initial_keys(self, cand: np.ndarray, target: str) -> list[tuple[float, float, int]]:
        """Heap entries ``(-upper bound of score, -size, period)`` of the candidates that may help."""
        score = self._initial_key_array(cand, target)
        size = self.p.size_bytes[cand].astype(np.float64)
        keep = score > 0
        return list(zip((-score[keep]).tolist(), (-size[keep]).tolist(), cand[keep].tolist(), strict=True))

    def greedy_stage(self, target: str, tolerance: float = 0.0) -> None:
        """Accept candidates on ``target`` by best benefit/cost until memory fits or none helps.

        ``tolerance = 0``: the lazy heap, exact; above 0: the threshold levels (NOTE [ Lazy greedy ]).
        """
        p = self.p
        # Out at s + 1 at the earliest, free from s + 2, back by e - 1 at the latest (or dead at e).
        useful = (p.end_op - p.start_op >= np.where(p.reads_back, 4, 3)) & ~self.selected
        if tolerance > 0:
            self._threshold_stage(np.flatnonzero(useful), target, tolerance)
        else:
            self._heap_stage(np.flatnonzero(useful), target)

    def _threshold_stage(self, cand: np.ndarray, target: str, tolerance: float) -> None:
        """The threshold greedy in levels (NOTE [ Lazy greedy ]); ``tolerance > 0``."""
        c = _Candidates(cand, self._initial_key_array(cand, target))
        size = self.p.size_bytes[cand].astype(np.float64)
        while self.excess.num_over > 0 and len(cand) and (top := float(c.key.max())) > 0:
            # Keys are upper bounds and only fall: until the level ends no candidate scores over ``top``.
            threshold = (1.0 - tolerance) * top
            stale = np.flatnonzero((c.key >= threshold) & ~c.exact)
            if len(stale):
                for chunk in np.array_split(stale, len(stale) // _LEVEL_CHUNK + 1):
                    self._rescore_into(c, chunk, target)
                continue  # ``top`` may have fallen
            level = np.flatnonzero(c.key >= threshold)
            level = level[np.lexsort((cand[level], -size[level], -c.key[level]))]  # best first; ties: larger, lower
            j, pos = int(level[0]), 1
            while j >= 0:
                self._accept(int(cand[j]), target, int(c.first[j]), int(c.start[j]))
                c.key[j] = 0.0
                c.exact[:] = False
                j, pos = self._next_in_level(c, level, pos, threshold, target)

    def _next_in_level(self, c: _Candidates, level: np.ndarray, pos: int, threshold: float,
                       target: str) -> tuple[int, int]:
        """The next of ``level[pos:]`` whose score now is at least ``threshold`` and the position after it;
        ``(-1, pos)`` when none is left or after ``_MAX_MISSES`` in a row fell under (a new level then
        re-scores the stale ones in one batch: scores tend to fall together)."""
        step, misses = 1, 0
        while pos < len(level) and misses < _MAX_MISSES and self.excess.num_over > 0:
            ahead = pos + np.flatnonzero(c.key[level[pos:pos + 4 * step]] >= threshold)[:step]
            if not len(ahead):  # already under it
                pos += 4 * step
                continue
            self._rescore_into(c, level[ahead], target)
            hits = np.flatnonzero(c.key[level[ahead]] >= threshold)
            if len(hits):
                return int(level[ahead[hits[0]]]), int(ahead[hits[0]]) + 1
            misses += len(ahead)
            pos = int(ahead[-1]) + 1
            step = min(2 * step, _MAX_MISSES)
        return -1, pos

    def _rescore_into(self, c: _Candidates, idx: np.ndarray, target: str) -> None:
        """Score candidates ``idx`` of ``c`` now: exact keys and current windows."""
        c.exact[idx] = True
        if len(idx) <= _ONE_BY_ONE:
            for j in idx.tolist():
                i = int(c.cand[j])
                if target == "host" and not self._host_fits(i):
                    c.key[j] = 0.0
                    continue
                one, c.first[j], c.start[j] = self._score_one(i, target)
                c.key[j] = min(one, c.key[j])
            return
        if target == "host":
            fits = np.array([self._host_fits(int(i)) for i in c.cand[idx]], bool)
            c.key[idx[~fits]] = 0.0
            idx = idx[fits]
            if not len(idx):
                return
        score, first, start = self._scores(c.cand[idx], target)
        # Keys are upper bounds; the min keeps a float-noise excess of the exact score out.
        c.key[idx] = np.minimum(score, c.key[idx])
        c.first[idx] = first
        c.start[idx] = start

    def _heap_stage(self, cand: np.ndarray, target: str) -> None:
        """The lazy heap with batches, exact (``tolerance = 0``; NOTE [ Lazy greedy ])."""
        tolerance = 0.0
        heap = self._initial_keys(cand, target)
        heapq.heapify(heap)
        # Scored since the last acceptance, in the order popped, each better than those before it
        # (one after a better one is never chosen first) and within the tolerance of the last, the best.
        fresh: list[tuple[float, float, int, int, int]] = []
        while (heap or fresh) and self.excess.num_over > 0:
            chosen = self._first_winner(fresh, heap[0] if heap else None, tolerance)
            if chosen is not None:
                self._accept(chosen[2], target, chosen[3], chosen[4])
                for entry in fresh:
                    if entry is not chosen:
                        heapq.heappush(heap, entry[:3])
                fresh = []
                continue
            batch: list[tuple[float, float, int]] = []
            while heap and len(batch) < _BATCH and not (fresh and self._wins(fresh[-1], heap[0], tolerance)):
                batch.append(heapq.heappop(heap))
            # Those left out wait in the heap: until the next acceptance the best only gets better.
            for entry in self._rescore(batch, target):
                if fresh and fresh[-1][:3] <= entry[:3]:
                    heapq.heappush(heap, entry[:3])
                    continue
                while fresh and not self._wins(fresh[0], entry, tolerance):
                    heapq.heappush(heap, fresh.pop(0)[:3])
                fresh.append(entry)

    def _rescore(self, batch: list[tuple[float, float, int]], target: str) -> list[tuple[float, float, int, int, int]]:
        """Fresh entries ``(-score, -size, period, first, start)`` of the heap entries ``batch``; those
        that can no longer help are dropped (scores only fall, host use only grows)."""
        if target == "host":
            batch = [entry for entry in batch if self._host_fits(entry[2])]
        cand = np.array([i for _, _, i in batch], np.int64)
        score, first, start = self._scores(cand, target)
        # Keys are upper bounds; the min keeps a float-noise excess of the exact score out.
        score = np.minimum(score, [-key for key, _, _ in batch])
        keep = score > 0
        size = self.p.size_bytes[cand[keep]].astype(np.float64)
        return list(zip((-score[keep]).tolist(), (-size).tolist(), cand[keep].tolist(),
                        first[keep].tolist(), start[keep].tolist(), strict=True))

    @classmethod
    def _first_winner(cls, fresh: list[tuple[float, float, int, int, int]], top: tuple[float, float, int] | None,
                      tolerance: float) -> tuple[float, float, int, int, int] | None:
        """The first entry of ``fresh`` that wins against the heap's ``top`` (None: an empty heap), if any.

        ``fresh`` is ordered worst to best, so those that win are a suffix of it: found by bisection.
        """
        if not fresh or (top is not None and not cls._wins(fresh[-1], top, tolerance)):
            return None
        if top is None:
            return fresh[0]
        lo, hi = 0, len(fresh) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if cls._wins(fresh[mid], top, tolerance):
                hi = mid
            else:
                lo = mid + 1
        return fresh[lo]

    @staticmethod
    def _wins(entry: tuple[float, ...], rival: tuple[float, ...], tolerance: float) -> bool:
        """Whether a fresh ``entry`` may be accepted before ``rival`` (a heap top: before all of the heap)."""
        return entry[:3] <= rival[:3] or (tolerance > 0 and -entry[0] >= (1.0 - tolerance) * -rival[0])

    def _accept(self, i: int, target: str, first: int, start: int) -> None:
        p = self.p
        s, size = int(p.start_op[i]), float(p.size_bytes[i])
        self.channels[f"{target}_write"].reserve(s + 1, size)
        if p.reads_back[i]:
            self.channels[f"{target}_read"].reserve(start, size)
        self._add_move(i, target, first, start)

    def _add_move(self, i: int, target: str, first: int, start: int) -> None:
        """Record period ``i``'s move (bandwidth already reserved): memory free over ``[first, start)``."""
        self._report()
        p = self.p
        s, e, size = int(p.start_op[i]), int(p.end_op[i]), float(p.size_bytes[i])
        if target == "host":
            self._take_host(i)
        self._free_memory(first, start, size)
        self.selected[i] = True
        m = len(self.moves)
        if m == len(self.spans):
            self.spans = np.concatenate([self.spans, np.zeros_like(self.spans)])
        self.spans[m] = (s, e, first, start)
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
        # The stall fixes ask only ``over`` at one op and free ranges: a ledger does both in O(log n)
        # (the blocks of ``Excess`` rewrite a crossing block per free, O(sqrt n) numpy work).
        self.ledger = ledger = OverLedger(self.excess.values())
        over = np.flatnonzero(ledger.values() > 0)
        if not len(over):
            return
        # run_end[j]: the op after the run of consecutive over-capacity ops that holds over[j]
        breaks = np.flatnonzero(np.diff(over) > 1)
        run_end = np.repeat(np.r_[over[breaks], over[-1:]] + 1, np.diff(np.r_[0, breaks + 1, len(over)]))
        for k, end_k in zip(over.tolist(), run_end.tolist(), strict=True):
            if ledger.at(k) <= 0:
                continue
            while nxt < len(events) and add_at[nxt] <= k:
                heapq.heappush(heap, events[nxt])
                nxt += 1
            while ledger.at(k) > 0 and heap:
                _, neg_end, i, sh = heapq.heappop(heap)
                if -neg_end <= k or self.selected[i]:
                    continue
                self._accept_stalling(i, k + sh)
            if ledger.at(k) > 0:
                self._stretch_moves(k, ledger, end_k)
        self.finish_stretches()

    def _accept_stalling(self, i: int, k: int) -> None:
        """Plan period ``i`` so that its memory is free at unrolled op ``k``, stalling if need be."""
        p = self.p
        s, e, size = int(p.start_op[i]), int(p.end_op[i]), float(p.size_bytes[i])
        target = "ssd"
        if self.hw.host_mem_bytes > 0 and self._host_fits(i):
            ssd_done = self.channels["ssd_write"].earliest_end_one(s + 1, size)
            host_done = self.channels["host_write"].earliest_end_one(s + 1, size)
            target = "host" if host_done < ssd_done else "ssd"
        done = self.channels[f"{target}_write"].reserve(s + 1, size)
        first = min(done + 1, k)
        if not p.reads_back[i]:
            self._add_move(i, target, first, e)
            return
        read = self.channels[f"{target}_read"]
        start = read.latest_start_one(e, size)
        if start <= k:  # the read channel is taken: the prefetch will be late, but not early
            start = read.latest_start_alone(e, size)
        start = min(max(start, k + 1), e)
        read.reserve(start, size)
        self._add_move(i, target, first, start)

    def _stretch_moves(self, k: int, ledger: OverLedger, run_end: int) -> None:
        """Widen planned windows to cover op ``k`` (see NOTE [ Stall fixes ]), the least widening first.

        A window ``[first, start)`` that misses an unrolled op ``ku`` idle in its period grows to
        cover it: a write still in flight at ``ku`` must be done before it (``first = ku``); a
        prefetch started by ``ku`` starts after it, and after the ops from ``k`` to ``run_end``
        (those over capacity when the fixes began), which would otherwise push it one op at a time.
        Only the ops it newly covers are freed (all of it when the window was empty: the write was
        to end after the read had to start). The moves take their new windows in ``finish_stretches``.
        """
        spans = self.spans[:len(self.moves)]
        for ku in (k, k + self.n):
            s, e, first, start = spans.T
            cand = np.flatnonzero((s < ku) & (ku < e) & ~((first <= ku) & (ku < start)))
            widen = np.maximum(first[cand] - ku, 0) + np.maximum(ku + 1 - start[cand], 0)
            for m in cand[np.argsort(widen, kind="stable")].tolist():
                if ledger.at(k) <= 0:
                    return
                f0, s0 = int(first[m]), int(start[m])
                f1 = min(f0, ku)
                s1 = s0 if s0 > ku else min(int(e[m]), ku + 1 + max(run_end - k - 1, 0))
                size = self.moves[m].size_bytes
                if s0 > f0:
                    self._free_memory(f1, f0, size)
                    self._free_memory(s0, s1, size)
                else:
                    self._free_memory(f1, s1, size)
                spans[m, 2:] = (f1, s1)

    def finish_stretches(self) -> None:
        """Give each move the window ``_stretch_moves`` left in ``spans``."""
        for m, mv in enumerate(self.moves):
            first, start = (int(x) for x in self.spans[m, 2:])
            if first != mv.offload_deadline or (mv.reads_back and start != mv.prefetch_trigger):
                self.moves[m] = replace(mv, offload_deadline=first,
                                        prefetch_trigger=start if mv.reads_back else mv.end_op)

    # NOTE [ Deadlines where memory is needed ]: a move's offload deadline is where the
    # greedy first counted its bytes free (``first``). The greedy frees more than capacity needs
    # at many ops: an early choice's bytes are counted free over its whole window, and later
    # choices, their windows placed by the bandwidth left, free the same ops again; a move that
    # no op needs moves bytes for nothing. So, once the moves are chosen, each move in turn, the
    # last chosen first, keeps its bytes counted free only from the first op of its window where
    # the plan without them would go over capacity (its new deadline), and a move no op needs is
    # dropped. A window that runs into the next iteration keeps its deadline in the iteration it
    # started in (iteration 0's own plan has no next iteration). Each step keeps the planned
    # memory at or under capacity wherever it was, so the plan still fits; what the greedy left
    # over capacity (a budget it could not meet) stays as it was. No op waits at a deadline: the
    # simulator and the runtime wait for a write only when an op needs its room (NOTE [ Room ]
    # in runtime.executor). Waiting at every deadline was a stall for nothing where the room was
    # free anyway (Llama3-8B at batch 16 with the SSD alone: a forward op waited 0.27 s, every
    # micro-batch, for a write while 40 of its 80 GiB were free).
    def relax_deadlines(self) -> list[Move]:
        """The moves with each offload's deadline at the first op that needs its room, and those
        no op needs left out (NOTE [ Deadlines where memory is needed ]), in priority order."""
        n, moves = self.n, self.moves
        if not moves or n == 0:
            return moves
        spans = self.spans[:len(moves)]
        sizes = np.array([mv.size_bytes for mv in moves], np.float64)
        freed = np.zeros(n)
        cyclic_add(freed, spans[:, 2], np.maximum(spans[:, 3], spans[:, 2]), sizes)
        # slack[k]: bytes op k could still take with every move's bytes free over its window
        slack = float(self.hw.gpu_mem_bytes) - (self.p.memory_bytes - freed)
        keep = np.ones(len(moves), bool)
        deadline = spans[:, 2].copy()
        for m in range(len(moves) - 1, -1, -1):
            first, start, size = int(spans[m, 2]), int(spans[m, 3]), sizes[m]
            need = start  # the first op of the window that needs the bytes free; start: none
            for lo, hi, off in self._pieces(first, start):
                tight = np.flatnonzero(slack[lo:hi] < size)
                if len(tight):
                    need = off + lo + int(tight[0])
                    break
            if first < n <= need < start:
                need = n - 1  # not past the iteration it was in: iteration 0's plan has no next one
            for lo, hi, _ in self._pieces(first, need):
                slack[lo:hi] -= size
            if need >= start:
                keep[m] = False
            deadline[m] = need
        kept = np.flatnonzero(keep)
        self.moves = [moves[m] if deadline[m] == moves[m].offload_deadline
                      else replace(moves[m], offload_deadline=int(deadline[m])) for m in kept.tolist()]
        self.spans = spans[kept].copy()
        self.spans[:, 2] = deadline[kept]
        return self.moves


# Measured (BENCHMARKS.md, planner tolerance), with the lazy heap: against exact greedy, 0.1
# moves the same bytes and predicts an iteration time within 0.3%, at 3 to 40 times less
# planning time than 0.02 or 0. The threshold levels stay within 0.5% of the heap's plans.
DEFAULT_TOLERANCE = 0.1


def plan_greedy(problem: PlanProblem, hw: Hardware, *, tolerance: float = DEFAULT_TOLERANCE,
                progress: Progress | None = None) -> list[Move]:
    """The moves that bring ``problem``'s memory under ``hw.gpu_mem_bytes``, in priority order.

    ``tolerance`` (NOTE [ Lazy greedy ]): 0 makes exactly Algorithm 1's
    choices; ``eps > 0`` accepts a candidate whose score is within a factor
    ``1 - eps`` of the best one's, which bounds how often a candidate is
    re-scored. Raises ``InfeasibleBudgetError`` if some op needs more than the
    capacity resident at once. Pure: no I/O, the problem is not modified;
    ``progress``, if given, is called with a line of text every few seconds.
    """
    if not 0.0 <= tolerance < 1.0:
        raise ValueError(f"tolerance must be in [0, 1), not {tolerance}")
    check_capacity(problem, hw.gpu_mem_bytes)
    planner = _Planner(problem, hw, progress)
    if planner.excess.num_over:
        planner.greedy_stage("ssd", tolerance)
    if planner.excess.num_over and hw.host_mem_bytes > 0:
        planner.greedy_stage("host", tolerance)
    if planner.excess.num_over:
        planner.fix_with_stalls()
    return planner.relax_deadlines()
