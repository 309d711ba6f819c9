"""``Excess``: windowed benefit sums under frees, both ways of summing, against brute force."""

from __future__ import annotations

import numpy as np
import pytest

from planner.excess import Excess


@pytest.mark.parametrize("num_windows", [50, 3000])  # piece by piece; whole blocks by prefix sums
@pytest.mark.parametrize("seed", range(4))
def test_benefits_match_brute_force(seed: int, num_windows: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(20, 3000))
    duration = rng.uniform(1, 5, n)
    over = np.maximum(rng.normal(5, 8, n) + 10 * np.sin(np.arange(n) / 100), 0).round()
    excess = Excess(duration, over.copy())
    for _ in range(2):  # the second round: sums kept from the first queries must follow the frees between
        for _ in range(30):
            lo, hi = sorted(rng.integers(0, n + 1, 2).tolist())
            size = float(rng.integers(1, 12))
            excess.free(lo, hi, size)
            over[lo:hi] = np.maximum(over[lo:hi] - size, 0)
        assert np.array_equal(excess.values(), over)
        lo = rng.integers(0, n + 1, num_windows)
        hi = np.minimum(lo + rng.integers(0, n, num_windows), n)
        # Sizes equal to a block's largest or smallest positive excess too: the edges of its classes.
        edges = np.unique(np.concatenate([excess.values(), [1.0]]))
        size = np.where(rng.random(num_windows) < 0.5, rng.choice(edges[edges > 0], num_windows),
                        rng.integers(1, 40, num_windows).astype(np.float64))
        got = excess.benefits(lo, hi, size)
        want = np.array([(duration[a:b] * np.minimum(over[a:b], s)).sum()
                         for a, b, s in zip(lo, hi, size, strict=True)])
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-9)
        one = [excess.benefit(int(a), int(b), float(s)) for a, b, s in zip(lo[:20], hi[:20], size[:20], strict=True)]
        np.testing.assert_allclose(one, want[:20], rtol=1e-12, atol=1e-9)
