"""Memory above capacity per op, as the plan frees it, with the greedy's benefit sums over many windows at once.

The greedy planner (``planner.greedy``) keeps ``over[k] = max(M'[k] - capacity,
0)`` and asks two things of it, both on plain op ranges ``[lo, hi)`` of one
iteration:

- ``free(lo, hi, size)``: a planned offload frees ``size`` bytes there,
  ``over = max(over - size, 0)``;
- ``benefits(lo, hi, size)``: for arrays of windows, ``sum duration_us[k] *
  min(over[k], size)`` over each.

NOTE [ Excess blocks ]: both would cost O(window) per call op by op, and
windows span a good part of the iteration, so the plan would take O(n^2). The
ops are kept in blocks of about ``sqrt(n)``; per block: the largest ``over``,
the smallest positive one, and the running sums inside it of ``duration *
over`` and of ``duration`` where ``over > 0``. A block whose ``over`` stays at
or under ``size`` gives ``sum duration * over``; one whose positive values are
all at least ``size`` gives ``size * sum duration [over > 0]``; only a block
where ``over`` crosses ``size`` is summed op by op. Freeing is lazy: a block
whose positive values all exceed ``size`` only records ``size`` as *pending*
(its positive values are ``stored - pending``), one whose values are all at
most ``size`` is zeroed once for good, and only a crossing block is rewritten.
The memory curve changes gradually, so crossing blocks are few; a call costs
O(sqrt(n)) numpy work, and a batch of ``m`` windows O(m sqrt(n)).

Many windows at once (a batch of the greedy's threshold levels: thousands,
each over tens of blocks, each with its own size) are summed otherwise:
whether a block is under, above or crossing a size depends only on where the
size falls among the blocks' largest and smallest positive ``over``, so the
sizes fall into classes; per class present, prefix sums over the blocks of the
under blocks' sums and the above blocks' busy time give each window's whole
blocks in O(1), its crossing whole blocks are summed op by op, and its partial
first and last blocks piece by piece. That is O(classes * num_blocks) once and
O(1 + crossing blocks) per window instead of one piece per block (at 30k ops,
43 pieces and 0.7 crossing blocks per window in those batches).

A crossing whole block is summed in O(log block) from its ops sorted by
``over`` (lazy frees keep that order): with ``r`` the count of ops with ``over
<= size``, the ``r`` smallest give their ``over`` and the others ``size``, by
prefix sums in sorted order; ``r`` comes from a binary search of all such
blocks at once. Sorting is deferred to the next batch that needs it (blocks are
rewritten once or twice per choice, batches come some hundred times a plan);
a few windows, and the partial blocks at a window's ends, are summed op by op.
At 30k ops the batches' crossing blocks were 1.1 million, whole blocks nearly
all, and summing them op by op was about half the batches' time.

Bytes are whole numbers far below 2^53, so ``over`` and its pending
subtractions are exact in float64.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["Excess", "OverLedger"]

# ``benefits`` sums whole blocks by prefix sums for at least this many windows (NOTE [ Excess blocks ]).
_MANY_WINDOWS = 1024


class Excess:
    """``over`` (bytes above capacity, per op of one iteration) under frees, with windowed benefit sums."""

    def __init__(self, duration_us: np.ndarray, over_bytes: np.ndarray) -> None:
        self.n = n = len(duration_us)
        self.block = b = max(16, 1 << round(math.log2(math.sqrt(n + 1))))
        self.num_blocks = nb = -(-n // b) or 1
        self._tau = np.zeros((nb, b))  # (num_blocks, block) op durations, 0 past the last op
        self._tau.reshape(-1)[:n] = duration_us
        self._stored = np.zeros((nb, b))  # (num_blocks, block) over + pending where over > 0, else 0
        self._stored.reshape(-1)[:n] = over_bytes
        self._pending = np.zeros(nb)
        self._max = np.zeros(nb)  # largest over in each block
        self._min_pos = np.zeros(nb)  # smallest positive over in each block (inf if none)
        self._count = np.zeros(nb, np.int64)  # ops with over > 0
        self._sum = np.zeros((nb, b + 1))  # [j, r]: sum of duration * stored over the first r ops of block j
        self._busy = np.zeros((nb, b + 1))  # [j, r]: the same of duration where over > 0
        # The same in each block with its ops sorted by ``stored``: sums over a whole block in O(log block).
        self._sorted = np.zeros((nb, b))  # (num_blocks, block) stored, ascending
        self._sorted_sum = np.zeros((nb, b + 1))  # [j, r]: sum of duration * stored over the r smallest
        self._sorted_busy = np.zeros((nb, b + 1))  # [j, r]: the same of duration where over > 0
        self._unsorted = np.zeros(nb, bool)  # stored since the sorted sums were made
        self._store(np.arange(nb), self._stored.copy())

    @property
    def num_over(self) -> int:
        """Ops with memory over capacity."""
        return int(self._count.sum())

    def values(self) -> np.ndarray:
        """(n,) float64: ``over`` now (a copy)."""
        return self._actual(np.arange(self.num_blocks)).reshape(-1)[:self.n]

    def at(self, k: int) -> float:
        j, r = divmod(k, self.block)
        v = float(self._stored[j, r])
        return v - float(self._pending[j]) if v > 0 else 0.0

    def _actual(self, blocks: np.ndarray) -> np.ndarray:
        """(len(blocks), block): ``over`` in ``blocks`` now."""
        rows = self._stored[blocks]
        return np.where(rows > 0, rows - self._pending[blocks, None], 0.0)

    def _store(self, blocks: np.ndarray, rows: np.ndarray) -> None:
        """Set ``over`` in ``blocks`` to ``rows`` (nothing pending) and recompute their summaries."""
        pos = rows > 0
        tau = self._tau[blocks]
        self._stored[blocks] = rows
        self._pending[blocks] = 0.0
        self._max[blocks] = rows.max(axis=1)
        self._min_pos[blocks] = np.where(pos, rows, np.inf).min(axis=1)
        self._count[blocks] = np.count_nonzero(pos, axis=1)
        self._sum[blocks, 1:] = np.cumsum(tau * rows, axis=1)
        self._busy[blocks, 1:] = np.cumsum(np.where(pos, tau, 0.0), axis=1)
        self._unsorted[blocks] = True

    def _sort(self) -> None:
        """Bring the sorted sums of the blocks stored since the last call up to date (they are read only
        by batches, some hundred times in a plan, while blocks are stored once or twice per choice)."""
        blocks = np.flatnonzero(self._unsorted)
        if not len(blocks):
            return
        rows = self._stored[blocks]
        order = np.argsort(rows, axis=1)
        ranked = np.take_along_axis(rows, order, axis=1)
        ranked_tau = np.take_along_axis(self._tau[blocks], order, axis=1)
        self._sorted[blocks] = ranked
        self._sorted_sum[blocks, 1:] = np.cumsum(ranked_tau * ranked, axis=1)
        self._sorted_busy[blocks, 1:] = np.cumsum(np.where(ranked > 0, ranked_tau, 0.0), axis=1)
        self._unsorted[blocks] = False

    def free(self, lo: int, hi: int, size: float) -> None:
        """``over[lo:hi] = max(over[lo:hi] - size, 0)``; ``0 <= lo <= hi <= n``."""
        if hi <= lo:
            return
        b = self.block
        j0, j1 = lo // b, (hi - 1) // b + 1
        blocks = np.arange(j0, j1)
        shift = (blocks * b >= lo) & ((blocks + 1) * b <= hi) & (self._min_pos[j0:j1] > size)
        live = self._max[j0:j1] > 0
        exact = blocks[live & ~shift]  # crossing ``size``, all at or under it, or partly in the range
        lazy = blocks[live & shift]
        self._pending[lazy] += size
        self._max[lazy] -= size
        self._min_pos[lazy] -= size
        if len(exact):
            ops = exact[:, None] * b + np.arange(b)
            rows = self._actual(exact)
            self._store(exact, np.where((ops >= lo) & (ops < hi), np.maximum(rows - size, 0.0), rows))

    def benefits(self, lo: np.ndarray, hi: np.ndarray, size: np.ndarray) -> np.ndarray:
        """(m,) ``sum duration_us[k] * min(over[k], size)`` over ``k`` in ``[lo, hi)``, per window.

        ``lo``, ``hi``, ``size``: (m,) arrays, ``0 <= lo`` and ``hi <= n``; an empty window gives 0.
        """
        if len(lo) < _MANY_WINDOWS:
            return self._benefits_by_piece(lo, hi, size)
        return self._benefits_by_class(lo, hi, size)

    def benefit(self, lo: int, hi: int, size: float) -> float:
        """``benefits`` of one window: one piece per block, without a batch's bookkeeping."""
        if hi <= lo:
            return 0.0
        b = self.block
        j0, j1 = lo // b, (hi - 1) // b + 1
        x = np.zeros(j1 - j0, np.int64)
        y = np.full(j1 - j0, b)
        x[0], y[-1] = lo - j0 * b, hi - (j1 - 1) * b
        pieces = self._block_benefits(np.arange(j0, j1), x, y, np.full(j1 - j0, size))
        return float(np.cumsum(pieces)[-1])  # in order, as ``benefits`` sums them

    def _benefits_by_piece(self, lo: np.ndarray, hi: np.ndarray, size: np.ndarray) -> np.ndarray:
        """``benefits``, each window split into one piece per block it touches."""
        b = self.block
        m = len(lo)
        hi = np.maximum(hi, lo)
        # Split each window into pieces, at most one per block: (row, block, first op, end op in the block).
        first, last = lo // b, np.maximum(hi - 1, lo) // b
        counts = np.where(hi > lo, last - first + 1, 0)
        row = np.repeat(np.arange(m), counts)
        block = first[row] + (np.arange(len(row)) - np.repeat(np.cumsum(counts) - counts, counts))
        x = np.minimum(np.maximum(lo[row] - block * b, 0), b)
        y = np.minimum(np.maximum(hi[row] - block * b, 0), b)
        return np.bincount(row, weights=self._block_benefits(block, x, y, size[row]), minlength=m)

    def _benefits_by_class(self, lo: np.ndarray, hi: np.ndarray, size: np.ndarray) -> np.ndarray:
        """``benefits`` for many windows: the whole blocks inside each by prefix sums over the blocks
        (NOTE [ Excess blocks ], many windows), its partial first and last blocks piece by piece."""
        b, nb, m = self.block, self.num_blocks, len(lo)
        hi = np.maximum(hi, lo)
        # A block is under, above or crossing a size by where the size falls among the blocks'
        # largest and smallest positive ``over``: at one of those values (class 2g + 1) or strictly
        # between two (class 2g), each class with a representative size.
        crit = np.unique(np.concatenate([self._max, self._min_pos[np.isfinite(self._min_pos)]]))
        g = np.searchsorted(crit, size)
        at = (g < len(crit)) & (crit[np.minimum(g, len(crit) - 1)] == size)
        classes, which = np.unique(2 * g + at, return_inverse=True)
        cg = classes // 2
        below = np.where(cg > 0, crit[np.maximum(cg - 1, 0)], 0.0)
        above_v = np.where(cg < len(crit), crit[np.minimum(cg, len(crit) - 1)], 2 * crit[-1] + 2)
        rep = np.where(classes % 2 == 1, above_v, (below + above_v) / 2)[:, None]  # (classes, 1)
        under = self._max[None, :] <= rep  # (classes, num_blocks)
        above = ~under & (self._min_pos[None, :] >= rep)
        cross = ~(under | above)
        zero = np.zeros((len(classes), 1))
        whole_under = np.hstack([zero, np.cumsum(under * (self._sum[:, b] - self._pending * self._busy[:, b]), axis=1)])
        whole_busy = np.hstack([zero, np.cumsum(above * self._busy[:, b], axis=1)])
        num_cross = np.hstack([zero, np.cumsum(cross, axis=1)]).astype(np.int64)
        # The whole blocks inside each window: [first, end).
        end = hi // b
        first = np.minimum(-(-lo // b), end)
        total = (whole_under[which, end] - whole_under[which, first]
                 + size * (whole_busy[which, end] - whole_busy[which, first]))
        # Crossing whole blocks, summed op by op.
        counts = num_cross[which, end] - num_cross[which, first]
        if counts.sum():
            flat = np.flatnonzero(cross.reshape(-1))  # class * num_blocks + block, sorted
            begin = np.searchsorted(flat, which * nb + first)
            row = np.repeat(np.arange(m), counts)
            k = np.repeat(begin, counts) + (np.arange(len(row)) - np.repeat(np.cumsum(counts) - counts, counts))
            block = flat[k] % nb
            total += np.bincount(row, weights=self._block_benefits(block, np.zeros_like(block), np.full_like(block, b),
                                                                   size[row]), minlength=m)
        # The partial blocks at either end (a window inside one block: all of it in the first).
        head_end = np.minimum(hi, -(-lo // b) * b)
        edges = self._benefits_by_piece(np.concatenate([lo, np.maximum(end * b, head_end)]),
                                        np.concatenate([head_end, hi]), np.concatenate([size, size]))
        return total + edges[:m] + edges[m:]

    def _block_benefits(self, block: np.ndarray, x: np.ndarray, y: np.ndarray, s: np.ndarray) -> np.ndarray:
        """(len(block),) ``sum duration * min(over, s)`` over ops ``[x, y)`` of each ``block`` (offsets in it)."""
        b = self.block
        under = self._max[block] <= s
        above = ~under & (self._min_pos[block] >= s)
        busy = self._busy[block, y] - self._busy[block, x]
        total = np.where(under, self._sum[block, y] - self._sum[block, x] - self._pending[block] * busy,
                         np.where(above, s * busy, 0.0))
        # Many whole blocks: by their sorted sums; a few, or parts of blocks: op by op.
        whole = ~(under | above) & (x == 0) & (y == b) & (len(block) >= _MANY_WINDOWS)
        if whole.any():
            total[whole] = self._whole_crossing(block[whole], s[whole])
        cross = np.flatnonzero(~(under | above | whole))
        if len(cross):
            # duration * min(over, s), over = stored - pending where positive: in place, few passes.
            jc = block[cross]
            v = np.minimum(self._stored[jc] - self._pending[jc, None], s[cross, None])
            np.maximum(v, 0.0, out=v)
            v *= self._tau[jc]
            cols = np.arange(b)
            v[(cols < x[cross, None]) | (cols >= y[cross, None])] = 0.0
            total[cross] = v.sum(axis=1)
        return total

    def _whole_crossing(self, block: np.ndarray, s: np.ndarray) -> np.ndarray:
        """(len(block),) ``sum duration * min(over, s)`` over all of each ``block``, from its sorted sums.

        ``over <= s`` exactly where ``stored <= s + pending`` (zeros too); the count ``r`` of those is
        found by a binary search in each block's sorted ``stored``, all blocks at once (``block`` is a
        power of two): the ``r`` smallest give their ``over``, the others ``s``. O(log block) per block.
        """
        self._sort()
        b = self.block
        t = s + self._pending[block]
        r = np.zeros(len(block), np.int64)
        step = b
        while step:
            nxt = r + step
            fits = nxt <= b
            fits[fits] = self._sorted[block[fits], nxt[fits] - 1] <= t[fits]
            r = np.where(fits, nxt, r)
            step //= 2
        busy = self._sorted_busy[block, r]
        return self._sorted_sum[block, r] - self._pending[block] * busy + s * (self._sorted_busy[block, b] - busy)


class OverLedger:
    """``over`` under frees with point queries only, each O(log n): the stall fixes' view
    (``planner.greedy``, NOTE [ Stall fixes ]), which asks no benefit sums.

    Frees compose by addition: ``max(max(x - a, 0) - b, 0) == max(x - a - b, 0)`` for ``a, b >= 0``,
    so ``over[k]`` is ``max(start[k] - freed[k], 0)``, with the bytes freed at each op kept as a
    difference array in a Fenwick tree (whole bytes: the float sums are exact).
    """

    def __init__(self, over_bytes: np.ndarray) -> None:
        self.n = len(over_bytes)
        self._start = np.asarray(over_bytes, np.float64).copy()
        self._tree = [0.0] * (self.n + 1)  # Fenwick tree over the difference array of the frees
        self._diff = np.zeros(self.n + 1)  # the same array, for ``values``

    def _add(self, i: int, value: float) -> None:
        self._diff[i] += value
        i += 1
        tree, n = self._tree, self.n
        while i <= n:
            tree[i] += value
            i += i & -i

    def free(self, lo: int, hi: int, size: float) -> None:
        """``over[lo:hi] = max(over[lo:hi] - size, 0)``; ``0 <= lo <= hi <= n``."""
        if hi <= lo:
            return
        self._add(lo, size)
        if hi < self.n:
            self._add(hi, -size)

    def at(self, k: int) -> float:
        total, i, tree = 0.0, k + 1, self._tree
        while i > 0:
            total += tree[i]
            i -= i & -i
        return max(float(self._start[k]) - total, 0.0)

    def values(self) -> np.ndarray:
        """(n,) float64: ``over`` now."""
        return np.maximum(self._start - np.cumsum(self._diff)[:self.n], 0.0)

    @property
    def num_over(self) -> int:
        return int(np.count_nonzero(self.values() > 0))
