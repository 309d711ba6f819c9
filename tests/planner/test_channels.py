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


def test_a_latency_counts_with_every_transfer_s_bytes() -> None:
    """NOTE [ Transfer latency ]: 100 bytes fit one slot of 100, not with 50 bytes' latency."""
    plain, slow = Channel(np.full(4, 100.0)), Channel(np.full(4, 100.0), latency_bytes=50.0)
    assert plain.earliest_end_one(0, 100.0) == 0 and slow.earliest_end_one(0, 100.0) == 1
    assert int(slow.earliest_end(np.array([0]), 100.0)[0]) == 1
    assert plain.latest_start_one(4, 100.0) == 3 and slow.latest_start_one(4, 100.0) == 2
    assert int(slow.latest_start(np.array([4]), 100.0)[0]) == 2 and slow.latest_start_alone(4, 100.0) == 2
    assert slow.reserve(0, 100.0) == 1 and slow.free[:2].tolist() == [0.0, 50.0]
