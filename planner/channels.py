"""Bandwidth reservations of one transfer channel, per op slot, queried many candidates at once.

NOTE [ Channel model ]: a channel (SSD write, SSD read, host write, host read)
moves ``bandwidth * duration_us[k]`` bytes during op ``k`` (its *slot*). The
planner reserves bandwidth in acceptance order, each reservation a *forward
fill*: from the slot where the transfer starts it takes all the capacity
still free in each slot until its bytes are covered (the last slot partly).
The simulator serves pending transfers in the same order, preemptively, so in
the ideal timeline every transfer finishes no later than the planner assumed
(``planner.simulate``); lower-priority work only ever sees more capacity than
was reserved for it. (Served in the order of their deadlines instead, the
prefetches of one iteration still all finish in time there: NOTE [ Prefetch
early, serve by deadline ] in ``planner.early``.)

Slots live on the unrolled axis of two iterations (NOTE [ Unrolled op axis ] in
``planner.problem``): slot ``k`` and ``k + n`` are the same bandwidth, so a
reservation updates both copies.

The free capacity is kept as prefix sums in blocks of about ``sqrt(2 n) / 4``
slots: the sum before each block, and the running sum inside each block. A
query is a binary search for the block and one in its running sums,
vectorised over arrays of transfers (the greedy scores batches of candidates,
two queries each), or one transfer at a time (``*_one``: the greedy's single
re-checks, and reservations). A reservation rewrites the slots it fills, the
running sums of their blocks and the sums before every block, O(filled slots +
block + 2n / block); the empty slots between its start and the first with room
are skipped (in a busy channel they were 6% of the axis per reservation at 30k
ops, which made reserving O(n) and planning O(n^2)).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["Channel"]

_TOL_BYTES = 0.5  # sums of float capacities: a transfer within half a byte fits


class Channel:
    """Free capacity (bytes) of one channel per slot of the two-iteration unrolled axis."""

    def __init__(self, slot_bytes: np.ndarray, latency_bytes: float = 0.0) -> None:
        # each transfer holds the channel this many bytes' time more (NOTE [ Transfer latency ] in
        # planner.simulate): every query and reservation below counts its size with it
        self.latency_bytes = latency_bytes
        self.n = n = len(slot_bytes)
        self.size = size = 2 * n
        self.block = b = 1 << max(4, round(math.log2(math.sqrt(size + 1) / 4)))
        num_blocks = size // b + 1  # slot ``size`` (the end of the axis) falls in a block too
        self._free = np.zeros((num_blocks, b))  # (num_blocks, block) free bytes, 0 past the axis
        self._free.reshape(-1)[:size] = np.tile(np.asarray(slot_bytes, np.float64), 2)
        self._local = np.zeros((num_blocks, b + 1))  # [j, r]: free bytes in the first r slots of block j
        self._before = np.zeros(num_blocks + 1)  # [j]: free bytes before block j
        self._recount([(0, size)])
        self._raw_prefix = np.concatenate([[0.0], np.cumsum(self.free)])  # (2n + 1,) before any reservation

    @property
    def free(self) -> np.ndarray:
        """(2n,) free bytes per slot (a view)."""
        return self._free.reshape(-1)[:self.size]

    def _recount(self, spans: list[tuple[int, int]]) -> None:
        """Slots ``[lo, hi)`` of each span changed: recompute the sums of their blocks and before every block."""
        b = self.block
        for lo, hi in spans:
            if hi > lo:
                j0, j1 = lo // b, (hi - 1) // b + 1
                np.cumsum(self._free[j0:j1], axis=1, out=self._local[j0:j1, 1:])
        np.cumsum(self._local[:, -1], out=self._before[1:])

    def prefix(self, slot: np.ndarray) -> np.ndarray:
        """Free bytes in slots ``[0, slot)``; ``0 <= slot <= 2n``."""
        j, r = np.divmod(slot, self.block)
        return self._before[j] + self._local[j, r]

    def _prefix_one(self, slot: int) -> float:
        """``prefix`` of one slot, with the same float operations."""
        j, r = divmod(slot, self.block)
        return float(self._before[j] + self._local[j, r])

    def _last_below(self, target: np.ndarray, inclusive: bool) -> np.ndarray:
        """The largest ``p`` in ``[0, 2n]`` with ``prefix(p) < target`` (``<=`` if ``inclusive``); -1 if none.

        A binary search for the block, then one in its running sums, all targets at once (the block is a
        power of two): O(log n) per target, not a scan of the block (which grew like sqrt(n)).
        """
        target = np.asarray(target, np.float64)
        t = target.reshape(-1)
        b = self.block
        j = np.searchsorted(self._before, t, side="right" if inclusive else "left") - 1
        jj = np.minimum(np.maximum(j, 0), len(self._local) - 1)
        base = self._before[jj]
        count = np.zeros(len(t), np.int64)  # slots r of block jj (0..b) whose prefix is under t
        step = 2 * b
        while step:
            nxt = count + step
            prefix = base + self._local[jj, np.minimum(nxt, b + 1) - 1]
            under = (nxt <= b + 1) & (prefix <= t if inclusive else prefix < t)
            count = np.where(under, nxt, count)
            step //= 2
        return np.where(j < 0, -1, np.minimum(jj * b + count - 1, self.size)).reshape(target.shape)

    def _last_below_one(self, target: float, inclusive: bool) -> int:
        """``_last_below`` of one target, with the same float operations: a scan of one block, few numpy calls."""
        j = int(self._before.searchsorted(target, side="right" if inclusive else "left")) - 1
        if j < 0:
            return -1
        j = min(j, len(self._local) - 1)
        row = self._before[j] + self._local[j]
        r = int(np.count_nonzero(row <= target if inclusive else row < target)) - 1
        return min(j * self.block + r, self.size)

    # ---- queries and reservations -------------------------------------------------------
    def earliest_end(self, start: np.ndarray, size_bytes: np.ndarray | float) -> np.ndarray:
        """The slot in which a transfer starting at slot ``start`` completes; ``2n`` if never."""
        need = size_bytes + self.latency_bytes
        return np.maximum(self._last_below(self.prefix(start) + need - _TOL_BYTES, inclusive=False), 0)

    def latest_start(self, end: np.ndarray, size_bytes: np.ndarray | float) -> np.ndarray:
        """The latest slot a transfer can start in and still be done before slot ``end``; -1 if none."""
        return self._last_below(self.prefix(end) - (size_bytes + self.latency_bytes) + _TOL_BYTES, inclusive=True)

    # One transfer at a time (the greedy's re-checks and reservations): the same answers as
    # ``earliest_end`` and ``latest_start``, without the array temporaries of a batch.
    def earliest_end_one(self, start: int, size_bytes: float) -> int:
        need = size_bytes + self.latency_bytes
        return max(self._last_below_one(self._prefix_one(start) + need - _TOL_BYTES, inclusive=False), 0)

    def latest_start_one(self, end: int, size_bytes: float) -> int:
        return self._last_below_one(self._prefix_one(end) - (size_bytes + self.latency_bytes) + _TOL_BYTES,
                                    inclusive=True)

    def latest_start_alone(self, end: int, size_bytes: float) -> int:
        """Like ``latest_start`` if the channel carried nothing else; -1 if none."""
        target = self._raw_prefix[end] - (size_bytes + self.latency_bytes) + _TOL_BYTES
        return int(np.searchsorted(self._raw_prefix, target, side="right")) - 1

    def reserve(self, start: int, size_bytes: float) -> int:
        """Forward-fill ``size_bytes`` from slot ``start``; returns the slot it completes in.

        When the channel runs out of capacity the remainder is dropped and
        ``2n`` returned (the transfer is late; the simulator says by how much).
        Past ``start + n`` every slot is the mirror of one already emptied, so a
        fill that needs more than that runs out.
        """
        n, free = self.n, self.free
        size_bytes += self.latency_bytes
        before = self._prefix_one(start)
        end = max(self._last_below_one(before + size_bytes - _TOL_BYTES, inclusive=False), 0)  # earliest_end_one
        stop = min(start + n, self.size)
        # Slots with nothing free are skipped: in a busy channel the fill starts far from ``start``,
        # and rewriting the empty slots between made a reservation O(n).
        lo = max(self._last_below_one(before, inclusive=True), start)
        if end >= stop:
            free[lo:stop] = 0.0
            end, last = self.size, stop
        else:
            remaining = size_bytes - (self._prefix_one(end) - before)
            free[lo:end] = 0.0
            free[end] = free[end] - remaining if free[end] > remaining + _TOL_BYTES else 0.0
            last = end + 1
        # The mirrors: slots under n at +n, the others at -n ([lo, last) spans at most n slots).
        spans = [(lo, last)]
        a, b = lo, min(last, n)
        if b > a:
            free[a + n:b + n] = free[a:b]
            spans.append((a + n, b + n))
        a, b = max(lo, n), last
        if b > a:
            free[a - n:b - n] = free[a:b]
            spans.append((a - n, b - n))
        self._recount(spans)
        return end
