"""The Fenwick channel against brute force on random reservations."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.channels import Channel


def brute_end(free: np.ndarray, start: int, size: float) -> int:
    c = np.cumsum(free[start:])
    hit = np.flatnonzero(c >= size - 0.5)
    return start + int(hit[0]) if len(hit) else len(free)


def brute_start(free: np.ndarray, end: int, size: float) -> int:
    for p in range(end - 1, -1, -1):
        if free[p:end].sum() >= size - 0.5:
            return p
    return -1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=12),
       st.lists(st.tuples(st.integers(0, 23), st.integers(1, 120)), max_size=8))
def test_channel_matches_brute_force(slots: list[int], reservations: list[tuple[int, int]]) -> None:
    ch = Channel(np.array(slots, float))
    n = len(slots)
    free = np.tile(np.array(slots, float), 2)
    for start, size in reservations:
        start %= 2 * n
        assert ch.earliest_end(start, size) == ch.earliest_end_one(start, size) == brute_end(free, start, size)
        for end in range(2 * n + 1):
            want = brute_start(free, end, size)
            assert ch.latest_start(end, size) == ch.latest_start_one(end, size) == want, (end, size)
        # reserve in the brute model: forward fill, mirrored
        j, rem = start, float(size)
        while j < 2 * n and rem > 0.5:
            take = min(free[j], rem)
            free[j] -= take
            free[(j + n) % (2 * n)] = free[j]
            rem -= take
            j += 1
        ch.reserve(start, size)
        assert np.allclose(ch.free, free)
        assert min(ch.free) >= -1e-6  # never more than the channel carries
