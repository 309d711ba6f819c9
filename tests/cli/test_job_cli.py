"""`teraio plan` and `teraio inspect` on a job profile of two pipeline stages (in-process, CliRunner)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner import load_plan
from profiles import write_profile
from profiles.synthetic import synthetic_pipeline_profile, synthetic_profile
from teraio.cli import app
from teraio.cmd_inspect import summarize_ranks

runner = CliRunner()


@pytest.fixture(scope="module")
def profiles(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("job")
    pipeline = synthetic_pipeline_profile(2, 4, 4, 2, schedule="1f1b", seed=5)
    write_profile(pipeline, root / "pp")
    kernels = pipeline.kernels.copy()
    lost = kernels.index[(kernels["rank"] == 1) & (kernels["op_name"] == "c10d.recv_.default")][-1]
    kernels.loc[lost, ["op_name", "peer"]] = ["aten.mm.default", -1]  # rank 0's last send to 1 is never received
    write_profile(type(pipeline)(meta=pipeline.meta, kernels=kernels, tensors=pipeline.tensors,
                                 accesses=pipeline.accesses), root / "broken")
    write_profile(synthetic_profile(2, 4, 2, seed=5), root / "one")
    return root


def test_plan_of_a_job_predicts_the_job(profiles: Path, tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    r = runner.invoke(app, ["plan", str(profiles / "pp"), "--gpu-mem", "60%", "--ssd-bw", "8", "--no-compare",
                            "--out", str(out)])
    assert r.exit_code == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("job "))
    assert "per iteration predicted for all ranks together" in line and "critical rank" in line
    plan = load_plan(out)
    s = plan.summary
    assert s["job_iteration_us"] >= s["job_ideal_iteration_us"] > 0
    assert f"critical rank {s['critical_rank']}" in line
    assert f"{s['job_iteration_us'] / 1e3:,.2f} ms" in line
    assert plan.world_size == 2 and set(plan.signatures) == {0, 1} and set(plan.migrations) == {0, 1}
    r = runner.invoke(app, ["plan", str(profiles / "pp"), "--gpu-mem", "60%", "--ssd-bw", "8", "--no-compare",
                            "--out", str(out), "--json"])
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["summary"]["critical_rank"] == s["critical_rank"]


def test_plan_of_ranks_that_do_not_fit_together_warns_and_plans_each_rank(profiles: Path, tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    r = runner.invoke(app, ["plan", str(profiles / "broken"), "--gpu-mem", "60%", "--no-compare",
                            "--out", str(out)])
    assert r.exit_code == 0, r.stderr
    assert "the job's iteration time is not predicted: rank 0's op" in r.stderr
    assert "(c10d.send.default) is send number 4 to rank 1, but rank 1 receives only 3" in r.stderr
    assert not any(x.startswith("job ") for x in r.stdout.splitlines())
    plan = load_plan(out)
    assert "job_iteration_us" not in plan.summary and set(plan.migrations) == {0, 1}


def test_plan_of_one_rank_has_no_job_line(profiles: Path, tmp_path: Path) -> None:
    r = runner.invoke(app, ["plan", str(profiles / "one"), "--gpu-mem", "60%", "--no-compare",
                            "--out", str(tmp_path / "plan.json"), "--json"])
    assert r.exit_code == 0, r.stderr
    summary = json.loads(r.stdout)["summary"]
    assert not any(k.startswith("job_") or k == "critical_rank" for k in summary)


def test_inspect_shows_each_rank_and_the_pipeline_imbalance(profiles: Path) -> None:
    r = runner.invoke(app, ["inspect", str(profiles / "pp")])
    assert r.exit_code == 0, r.stderr
    assert "ranks          2 of a job of 2" in r.stdout
    assert "stages' peak memory imbalance" in r.stdout and "critical rank" in r.stdout
    r = runner.invoke(app, ["inspect", str(profiles / "pp"), "--json"])
    job = json.loads(r.stdout)["job"]
    peaks = [row["peak_bytes"] for row in job["ranks"]]
    assert job["pipeline"]["peak_ratio"] == pytest.approx(max(peaks) / min(peaks))
    assert [row["peak_over_least_bytes"] for row in job["ranks"]] == [p - min(peaks) for p in peaks]
    assert job["job"]["iteration_us"] >= max(row["op_time_us"] for row in job["ranks"])
    r = runner.invoke(app, ["inspect", str(profiles / "broken"), "--json"])
    assert "is send number 4 to rank 1" in json.loads(r.stdout)["job"]["job"]["error"]
    r = runner.invoke(app, ["inspect", str(profiles / "one"), "--json"])
    assert "job" not in json.loads(r.stdout)


def test_one_f_one_b_holds_fewer_micro_batches_than_gpipe_on_later_stages() -> None:
    """GPipe keeps every micro-batch's activations on every stage at its peak, 1F1B only
    ``num_stages - s`` on stage ``s``: the difference is the rest, stage by stage, and 1F1B's
    stages are less even."""
    stages, micro, ops, act = 3, 6, 4, 1 << 20

    def ranks(schedule: str) -> dict:
        return summarize_ranks(synthetic_pipeline_profile(stages, micro, ops, 2, schedule=schedule, jitter=0.0,
                                                          activation_bytes=act, param_bytes=act))

    one_f, gpipe = ranks("1f1b"), ranks("gpipe")
    for s, (a, b) in enumerate(zip(one_f["ranks"], gpipe["ranks"], strict=True)):
        assert b["peak_bytes"] - a["peak_bytes"] == (micro - (stages - s)) * ops * act
    assert one_f["pipeline"]["peak_ratio"] > gpipe["pipeline"]["peak_ratio"]
