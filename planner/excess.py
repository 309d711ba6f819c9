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

Bytes are whole numbers far below 2^53, so ``over`` and its pending
subtractions are exact in float64.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["Excess"]


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
        b = self.block
        m = len(lo)
        hi = np.maximum(hi, lo)
        # Split each window into pieces, at most one per block: (row, block, first op, end op in the block).
        first, last = lo // b, np.maximum(hi - 1, lo) // b
        counts = np.where(hi > lo, last - first + 1, 0)
        row = np.repeat(np.arange(m), counts)
        block = first[row] + (np.arange(len(row)) - np.repeat(np.cumsum(counts) - counts, counts))
        x = np.clip(lo[row] - block * b, 0, b)
        y = np.clip(hi[row] - block * b, 0, b)
        s = size[row]
        under = self._max[block] <= s
        above = ~under & (self._min_pos[block] >= s)
        busy = self._busy[block, y] - self._busy[block, x]
        total = np.where(under, self._sum[block, y] - self._sum[block, x] - self._pending[block] * busy,
                         np.where(above, s * busy, 0.0))
        cross = np.flatnonzero(~(under | above))
        if len(cross):
            jc = block[cross]
            over = self._actual(jc)
            cols = np.arange(b)
            inside = (cols >= x[cross, None]) & (cols < y[cross, None])
            total[cross] = (np.where(inside, self._tau[jc], 0.0) * np.minimum(over, s[cross, None])).sum(axis=1)
        return np.bincount(row, weights=total, minlength=m)
