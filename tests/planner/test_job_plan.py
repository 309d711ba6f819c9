"""A job's plan: the job's keys of the summary, the plan's world size and signatures, check_rank."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from planner import Hardware, PlanFormatError, build_plan, load_plan, plan_rank, problem_from_profile, save_plan
from planner.job import predict_job, rank_ops
from planner.make import RankPlan, job_summary
from planner.plan import Plan, check_rank, signatures_of
from profiles.synthetic import synthetic_pipeline_profile, synthetic_profile


@pytest.fixture(scope="module")
def job() -> tuple[dict[int, RankPlan], Hardware, dict]:
    prof = synthetic_pipeline_profile(2, 4, 4, 2, schedule="1f1b", seed=1)
    problems = {r: problem_from_profile(prof, r) for r in prof.ranks}
    peak = max(int(p.memory_bytes.max()) for p in problems.values())
    hw = Hardware(gpu_mem_bytes=int(0.6 * peak), ssd_read_bw_bytes_per_s=4e9, ssd_write_bw_bytes_per_s=4e9)
    return {r: plan_rank(p, hw) for r, p in problems.items()}, hw, prof.meta


def test_job_summary_from_the_ranks_simulations(job: tuple[dict[int, RankPlan], Hardware, dict]) -> None:
    rank_plans, _, _ = job
    s = job_summary(rank_plans)
    assert set(s) == {"job_iteration_us", "job_ideal_iteration_us", "job_slowdown", "critical_rank",
                      "critical_us_by_rank"}
    assert any(rp.sim.stall_us > 0 for rp in rank_plans.values())  # the budget makes someone wait
    assert s["job_iteration_us"] >= s["job_ideal_iteration_us"] > 0
    assert s["job_slowdown"] == pytest.approx(s["job_iteration_us"] / s["job_ideal_iteration_us"])
    # this profile's sends and receives all take the same time, so no rank's own chain is cut short:
    # the job takes at least as long as any rank simulated alone
    assert s["job_iteration_us"] >= max(rp.sim.iteration_us for rp in rank_plans.values()) - 1e-6
    ideal = predict_job({r: rank_ops(rp.problem) for r, rp in rank_plans.items()})
    assert s["job_ideal_iteration_us"] == ideal.iteration_us
    assert s["critical_rank"] in rank_plans
    assert sum(s["critical_us_by_rank"].values()) == pytest.approx(s["job_iteration_us"])


def test_the_job_counts_what_copies_cost_the_compute(job: tuple[dict[int, RankPlan], Hardware, dict]) -> None:
    """On a CPU profile each rank's prediction includes what its copies and the runtime cost its
    ops (NOTE [ Copies on the compute ]); the job's prediction is made of the same op times."""
    rank_plans, hw, _ = job
    costly = dataclasses.replace(hw, copy_cost_s_per_byte=2e-10, op_overhead_s=5e-6)
    plans = {r: plan_rank(rp.problem, costly) for r, rp in rank_plans.items()}
    for rp in plans.values():
        assert rp.sim.copy_charge_us > 0 and rp.sim.op_overhead_us > 0
        run = rp.sim.op_run_us
        extra = rp.sim.copy_charge_us + rp.sim.op_overhead_us + rp.sim.refault_us
        assert run.sum() == pytest.approx(rp.problem.duration_us.sum() + extra)
        assert run.sum() + rp.sim.stall_us == pytest.approx(rp.sim.iteration_us)
    s = job_summary(plans)
    assert s["job_iteration_us"] >= max(rp.sim.iteration_us for rp in plans.values()) - 1e-6


def test_job_plan_round_trip_and_agreement(tmp_path: Path, job: tuple[dict[int, RankPlan], Hardware, dict]) -> None:
    rank_plans, hw, meta = job
    plan = build_plan(rank_plans, hw, meta["signature"], job=job_summary(rank_plans), world_size=2,
                      signatures=signatures_of(meta))
    back = load_plan(save_plan(plan, tmp_path / "plan.json"))
    assert back.world_size == 2
    assert back.signatures == {0: meta["signatures"]["0"], 1: meta["signatures"]["1"]}
    assert back.signatures[0] != back.signatures[1]
    assert back.summary["critical_rank"] == plan.summary["critical_rank"]
    assert back.summary["job_iteration_us"] == pytest.approx(plan.summary["job_iteration_us"])
    for rank in (0, 1):
        check_rank(back, rank, 2)
    with pytest.raises(PlanFormatError, match=r"this plan was made for a job of 2 ranks; this job has 4: "
                                              r"profile this job \(`teraio profile --nproc 4`\)"):
        check_rank(back, 0, 4, source=tmp_path / "plan.json")
    with pytest.raises(PlanFormatError, match="made for a job of 2 ranks; this job has 1"):
        check_rank(back, 0, 1)


def test_check_rank_without_a_section_or_world_size() -> None:
    one = Plan(signature="s", parameters={}, summary={}, migrations={0: []}, op_names={0: ["aten.mm"]},
               made_bytes={0: [0]})
    check_rank(one, 0, 1)  # a plan that does not say is for the ranks it has
    with pytest.raises(PlanFormatError, match="made for a job of 1 rank; this job has 2"):
        check_rank(one, 1, 2)
    partial = Plan(signature="s", parameters={}, summary={}, migrations={0: [], 2: []}, world_size=3)
    check_rank(partial, 2, 3)
    with pytest.raises(PlanFormatError) as exc:
        check_rank(partial, 1, 3, source="plan.json")
    assert str(exc.value).startswith("plan.json: this plan has no section for rank 1 (it has ranks [0, 2] of 3)")
    assert "\n" not in str(exc.value)


def test_signatures_of_profile_meta() -> None:
    assert signatures_of({"signature": "a", "signatures": {"0": "a", "1": "b"}}) == {0: "a", 1: "b"}
    assert signatures_of({"signature": "a", "ranks": [2, 3]}) == {2: "a"}
    assert signatures_of({"signature": "a"}) == {0: "a"}
    assert signatures_of({}) == {}


def test_single_rank_plan_is_unchanged(tmp_path: Path) -> None:
    prof = synthetic_profile(2, 4, 2, seed=4)
    problem = problem_from_profile(prof)
    hw = Hardware(gpu_mem_bytes=int(problem.memory_bytes.max() * 0.7), ssd_read_bw_bytes_per_s=16e9,
                  ssd_write_bw_bytes_per_s=16e9)
    plan = build_plan({0: plan_rank(problem, hw)}, hw, prof.signature)
    doc = json.loads(save_plan(plan, tmp_path / "plan.json").read_text())
    assert not {"world_size", "signatures"} & set(doc)
    assert not any(k.startswith("job_") or k == "critical_rank" for k in doc["summary"])
    assert load_plan(tmp_path / "plan.json").job_size == 1
