"""Bandwidth reservations of one transfer channel, per op slot, in O(log n) per query.

NOTE [ Channel model ]: a channel (SSD write, SSD read, host write, host read)
moves ``bandwidth * duration_us[k]`` bytes during op ``k`` (its *slot*). The
planner reserves bandwidth in acceptance order, each reservation a *forward
fill*: from the slot where the transfer starts it takes all the capacity
still free in each slot until its bytes are covered (the last slot partly).
The simulator serves pending transfers in the same order, preemptively, so in
the ideal timeline every transfer finishes no later than the planner assumed
(``planner.simulate``); lower-priority work only ever sees more capacity than
was reserved for it.

Slots live on the unrolled axis of two iterations (NOTE [ Unrolled op axis ] in
``planner.problem``): slot ``k`` and ``k + n`` are the same bandwidth, so a
reservation updates both copies.

The free capacity is a Fenwick tree over the ``2 n`` slots; a disjoint-set
"next slot with free capacity" pointer skips exhausted slots, so that each slot
is emptied once and a reservation costs O(log n) amortised.
"""

from __future__ import annotations

import numpy as np

__all__ = ["Channel"]

_TOL_BYTES = 0.5  # sums of float capacities: a transfer within half a byte fits


class Channel:
    """Free capacity (bytes) of one channel per slot of the two-iteration unrolled axis."""

    def __init__(self, slot_bytes: np.ndarray) -> None:
        self.n = n = len(slot_bytes)
        free = np.tile(np.asarray(slot_bytes, np.float64), 2)
        self.size = size = 2 * n
        self.free: list[float] = free.tolist()
        # Fenwick tree, 1-indexed: tree[i] = sum free[i - lowbit(i), i).
        prefix = np.concatenate([[0.0], np.cumsum(free)])
        self._raw_prefix = prefix  # (2n + 1,) capacity before any reservation
        idx = np.arange(1, size + 1)
        tree = np.zeros(size + 1)
        tree[1:] = prefix[idx] - prefix[idx - (idx & -idx)]
        self._tree: list[float] = tree.tolist()
        self._log = 1 << (size.bit_length() - 1) if size else 0
        # next_free[i]: a slot >= i that may have free capacity (path-compressed).
        nxt = np.arange(size + 1)
        zero = np.flatnonzero(free <= 0)
        nxt[zero] = zero + 1
        self._next: list[int] = nxt.tolist()

    # ---- Fenwick primitives ----------------------------------------------------------
    def prefix(self, i: int) -> float:
        """Free bytes in slots ``[0, i)``."""
        tree, s = self._tree, 0.0
        while i > 0:
            s += tree[i]
            i &= i - 1
        return s

    def _add(self, i: int, delta: float) -> None:
        tree, size = self._tree, self.size
        i += 1
        while i <= size:
            tree[i] += delta
            i += i & -i

    def _first_reaching(self, target: float) -> int:
        """Smallest slot ``j`` with ``prefix(j + 1) >= target``; ``size`` if none."""
        tree, pos, step = self._tree, 0, self._log
        while step:
            nxt = pos + step
            if nxt <= self.size and tree[nxt] < target:
                pos = nxt
                target -= tree[nxt]
            step >>= 1
        return pos

    def _last_at_most(self, target: float) -> int:
        """Largest ``p`` with ``prefix(p) <= target`` (``-1`` if ``target < 0``)."""
        if target < 0:
            return -1
        tree, pos, step = self._tree, 0, self._log
        while step:
            nxt = pos + step
            if nxt <= self.size and tree[nxt] <= target:
                pos = nxt
                target -= tree[nxt]
            step >>= 1
        return pos

    def _find_free(self, i: int) -> int:
        nxt = self._next
        root = i
        while nxt[root] != root:
            root = nxt[root]
        while nxt[i] != root:
            nxt[i], i = root, nxt[i]
        return root

    # ---- queries and reservations -------------------------------------------------------
    def earliest_end(self, start: int, size_bytes: float) -> int:
        """The slot in which a transfer starting at slot ``start`` completes; ``2n`` if never."""
        return self._first_reaching(self.prefix(start) + size_bytes - _TOL_BYTES)

    def latest_start(self, end: int, size_bytes: float) -> int:
        """The latest slot a transfer can start in and still be done before slot ``end``; -1 if none."""
        return self._last_at_most(self.prefix(end) - size_bytes + _TOL_BYTES)

    def latest_start_alone(self, end: int, size_bytes: float) -> int:
        """Like ``latest_start`` if the channel carried nothing else; -1 if none."""
        target = self._raw_prefix[end] - size_bytes + _TOL_BYTES
        return int(np.searchsorted(self._raw_prefix, target, side="right")) - 1

    def reserve(self, start: int, size_bytes: float) -> int:
        """Forward-fill ``size_bytes`` from slot ``start``; returns the slot it completes in.

        When the channel runs out of capacity the remainder is dropped and
        ``2n`` returned (the transfer is late; the simulator says by how much).
        """
        free, n, remaining = self.free, self.n, float(size_bytes)
        i = self._find_free(start)
        while i < self.size:
            take = free[i]
            mirror = i + n if i < n else i - n
            if take > remaining + _TOL_BYTES:
                free[i] -= remaining
                free[mirror] -= remaining
                self._add(i, -remaining)
                self._add(mirror, -remaining)
                return i
            free[i] = free[mirror] = 0.0
            self._add(i, -take)
            self._add(mirror, -take)
            self._next[i] = i + 1
            self._next[mirror] = mirror + 1
            remaining -= take
            if remaining <= _TOL_BYTES:
                return i
            i = self._find_free(i + 1)
        return self.size
