"""plan.json: round trip, the op-index rules for wrap-around periods, validation errors."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from planner import Hardware, PlanFormatError, build_plan, load_plan, plan_rank, problem_from_profile, save_plan
from planner.plan import Plan
from profiles.synthetic import synthetic_profile
from tests.conftest import ROOT


@pytest.fixture(scope="module")
def plan_doc() -> tuple[Plan, int]:
    prof = synthetic_profile(4, 6, 3, num_extra=2, seed=3)
    problem = problem_from_profile(prof)
    hw = Hardware(gpu_mem_bytes=int(problem.memory_bytes.max() * 0.6), ssd_read_bw_bytes_per_s=32e9,
                  ssd_write_bw_bytes_per_s=32e9, host_mem_bytes=1 << 30)
    return build_plan({0: plan_rank(problem, hw)}, hw, prof.signature), problem.num_ops


def test_round_trip(tmp_path: Path, plan_doc: tuple[Plan, int]) -> None:
    plan, _ = plan_doc
    path = save_plan(plan, tmp_path / "plan.json")
    back = load_plan(path)
    assert back == plan
    doc = json.loads(path.read_text())
    assert doc["format"] == "teraio-plan/6"
    assert set(doc) >= {"signature", "parameters", "summary", "ranks", "op_names", "num_ops", "made_bytes"}
    assert set(doc["summary"]) >= {"peak_before_bytes", "peak_after_bytes", "predicted_iteration_us",
                                   "ideal_iteration_us", "stall_us", "bytes_to_ssd", "bytes_to_host"}
    m = doc["ranks"]["0"][0]
    assert set(m) >= {"tensor_id", "size_bytes", "action", "trigger_op", "deadline_op", "start_us",
                      "end_us", "urgent", "wraps"}
    assert ("target" in m) == (m["action"] == "offload") and ("source" in m) == (m["action"] == "prefetch")


def test_the_first_iterations_plan_round_trips(tmp_path: Path, plan_doc: tuple[Plan, int]) -> None:
    plan, _ = plan_doc
    prof = synthetic_profile(3, 6, 3, seed=4)
    problem = problem_from_profile(prof)
    hw = Hardware(gpu_mem_bytes=int(problem.memory_bytes.max() * 0.7), ssd_read_bw_bytes_per_s=32e9,
                  ssd_write_bw_bytes_per_s=32e9)
    first = build_plan({0: plan_rank(problem, hw)}, hw, "first", carried_into_next={0: {12: 34}})
    whole = dataclasses.replace(plan, first=first)
    path = save_plan(whole, tmp_path / "plan.json")
    back = load_plan(path)
    assert back == whole and back.first is not None and back.first.carried_into_next == {0: {12: 34}}
    doc = json.loads(path.read_text())
    assert doc["first_iteration"]["parameters"]["gpu_mem_bytes"] == hw.gpu_mem_bytes
    assert "first_iteration" not in doc["first_iteration"]
    assert back.first.budget_bytes == hw.gpu_mem_bytes
    assert len(back.first.migrations[0]) > 0 and back.first.op_names[0] == list(problem.op_names)


def test_migrations_sorted_by_trigger_with_ops_folded_into_the_iteration(plan_doc: tuple[Plan, int]) -> None:
    plan, n = plan_doc
    ms = plan.migrations[0]
    assert ms, "the fixture must plan something"
    assert [m.trigger_op for m in ms] == sorted(m.trigger_op for m in ms)
    assert any(m.wraps for m in ms), "the fixture must move a wrap-around period"
    for m in ms:
        assert 0 <= m.trigger_op < n and 0 <= m.deadline_op < n
        span = {k % n for k in range(m.period_start_op + 1, m.period_end_op + 1)}
        assert m.trigger_op in span and m.deadline_op in span
        assert m.wraps == (m.period_end_op >= n)
        if m.action == "prefetch":
            assert m.deadline_op == m.period_end_op % n
        else:
            assert m.trigger_op == (m.period_start_op + 1) % n


def test_the_runtime_reads_plans_through_the_planners_model_without_heavy_imports(
        tmp_path: Path, plan_doc: tuple[Plan, int]) -> None:
    """One reader of plan.json: ``planner.plan``, light enough for the runtime (no numpy,
    pandas or pyarrow), whose schedule is built from it."""
    plan, n = plan_doc
    path = save_plan(plan, tmp_path / "plan.json")
    code = ("import sys, json; from planner.plan import load_plan; from runtime.boundary import Schedule; "
            f"p = load_plan({str(path)!r}); s = Schedule.of(p, 0); "
            "print(json.dumps([len(s.op_names), sum(map(len, s.triggers.values())), "
            "sorted(m for m in ('numpy', 'pandas', 'pyarrow', 'torch') if m in sys.modules)]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [n, len(plan.migrations[0]), []]


def test_made_bytes_are_what_each_op_allocates_in_the_profile(plan_doc: tuple[Plan, int]) -> None:
    """The runtime makes room before each op for these bytes (NOTE [ Room ]): each op's are the sizes
    of the storages whose ``alloc_op`` it is, and together they are every storage made in the iteration."""
    plan, n = plan_doc
    prof = synthetic_profile(4, 6, 3, num_extra=2, seed=3)
    t = prof.tensors_of(0)
    made = plan.made_bytes[0]
    assert len(made) == n and sum(made) > 0
    for k in (0, n // 2, n - 1):
        assert made[k] == int(t.loc[t["alloc_op"] == k, "size_bytes"].sum())
    assert sum(made) == int(t.loc[t["alloc_op"] >= 0, "size_bytes"].sum())


def test_the_maps_of_storages_kept_for_good_round_trip_and_older_plans_have_what_they_had(
        tmp_path: Path, plan_doc: tuple[Plan, int]) -> None:
    """``kept_for_good`` (NOTE [ Kept for good ] in torch_patch.tracer), new in version 6: a map
    per iteration from 2 to the first kept one; a version 5 plan had the first kept iteration's
    alone (``carried_into_first_kept``), a version 4 plan none (its profile named such storages
    twice)."""
    plan, _ = plan_doc
    maps = {2: {3 << 40: (1 << 47) | 5}, 3: {(3 << 40) + 1: (1 << 47) | 7}}
    kept = dataclasses.replace(plan, kept_for_good={0: maps})
    path = save_plan(kept, tmp_path / "plan.json")
    assert load_plan(path) == kept
    doc = json.loads(path.read_text())
    assert doc["kept_for_good"] == {"0": {"2": {str(3 << 40): (1 << 47) | 5}, "3": {str((3 << 40) + 1): (1 << 47) | 7}}}
    del doc["kept_for_good"]
    v5 = {**doc, "format": "teraio-plan/5",
          "carried_into_first_kept": {"0": {"iteration": 3, "ids": {str((3 << 40) + 1): (1 << 47) | 7}}}}
    path.write_text(json.dumps(v5))
    assert load_plan(path) == dataclasses.replace(plan, kept_for_good={0: {3: maps[3]}})
    path.write_text(json.dumps({**doc, "format": "teraio-plan/4"}))
    assert load_plan(path) == plan


@pytest.mark.parametrize("old", ["teraio-plan/1", "teraio-plan/2"])
def test_an_older_plan_is_refused_with_what_to_do(tmp_path: Path, plan_doc: tuple[Plan, int], old: str) -> None:
    plan, _ = plan_doc
    doc = plan.to_json()
    doc["format"] = old
    doc["parameters"]["profile"] = "profiles/train-1"
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(PlanFormatError, match=re.escape("written by an older teraio; make the plan again "
                                                        "from profiles/train-1 with `teraio plan`")):
        load_plan(path)


@pytest.mark.parametrize(("doc", "problem"), [
    ("[]", "not a JSON object"),
    ('{"format": "teraio-plan/0"}', "format 'teraio-plan/0'"),
    ('{"format": "teraio-plan/3", "signature": "x"}', "missing field 'ranks'"),
    ('{"format": "teraio-plan/3", "signature": "x", "ranks": {"0": [{"tensor_id": 1, "size_bytes": 4, '
     '"action": "evict", "target": "ssd", "trigger_op": 0, "deadline_op": 1}]}}', "action 'evict'"),
    ('{"format": "teraio-plan/3", "signature": "x", "op_names": {"0": ["a", "b"]}, "made_bytes": {"0": [0, 8]}, '
     '"ranks": {"0": [{"tensor_id": 1, "size_bytes": 4, "action": "offload", "target": "ssd", "trigger_op": 5, '
     '"deadline_op": 1}]}}', "trigger_op 5 outside [0, 2)"),
    ('{"format": "teraio-plan/3", "signature": "x", "op_names": {"0": ["a", "b"]}, "ranks": {"0": []}}',
     "rank 0: made_bytes has 0 entries for 2 ops"),
    ('{"format": "teraio-plan/3", "signature": "x", "op_names": {"0": ["a", "b"]}, "made_bytes": {"0": [0, -8]}, '
     '"ranks": {"0": []}}', "rank 0: negative made_bytes"),
    ("{not json", "not valid JSON"),
])
def test_bad_plans_get_clear_errors(tmp_path: Path, doc: str, problem: str) -> None:
    path = tmp_path / "plan.json"
    path.write_text(doc)
    with pytest.raises(PlanFormatError, match=re.escape(problem)):
        load_plan(path)


def test_missing_plan_file(tmp_path: Path) -> None:
    with pytest.raises(PlanFormatError, match="no such plan file"):
        load_plan(tmp_path / "nope.json")
