"""SSD wear and the bandwidth a target speed needs."""

from __future__ import annotations

import pytest

from planner import Hardware, plan_rank, problem_from_profile
from planner.operate import bandwidth_needed, ssd_wear
from profiles.synthetic import synthetic_profile


def test_ssd_wear_by_hand() -> None:
    # 1 GB per 100 ms iteration: 864 TB a day; 70 PBW last 70e15 / (864e12 * 365) years
    w = ssd_wear(10**9, 100_000.0, 70.0)
    assert w["ssd_bytes_per_day"] == pytest.approx(864e12)
    assert w["ssd_life_years"] == pytest.approx(70e15 / (864e12 * 365))
    assert ssd_wear(0, 100_000.0)["ssd_life_years"] is None
    with pytest.raises(ValueError, match="positive"):
        ssd_wear(1, 1.0, 0.0)


def test_bandwidth_needed_brackets_the_target() -> None:
    problem = problem_from_profile(synthetic_profile(4, 6, 3, seed=2))
    hw = Hardware(gpu_mem_bytes=int(problem.memory_bytes.max() * 0.6), ssd_read_bw_bytes_per_s=16e9,
                  ssd_write_bw_bytes_per_s=16e9)
    need = bandwidth_needed(problem, hw, 0.9, steps=5)
    assert need is not None

    def speed(gb_per_s: float) -> float:
        sim = plan_rank(problem, Hardware(gpu_mem_bytes=hw.gpu_mem_bytes, ssd_read_bw_bytes_per_s=gb_per_s * 1e9,
                                          ssd_write_bw_bytes_per_s=gb_per_s * 1e9)).sim
        return 1 / sim.slowdown if sim.fits else 0.0

    assert speed(need) >= 0.9
    step = (4096 / 0.25) ** (1 / 2**5)  # the search's resolution with steps=5
    if need > 0.25:  # the lower end of the search reaches it otherwise
        assert speed(need / step * 0.99) < 0.9
