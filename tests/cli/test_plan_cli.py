"""`teraio plan` and `teraio roofline` as a user runs them (real subprocesses), and units."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from planner import load_plan, problem_from_profile
from planner.problem import first_problem, resident_need_bytes
from profiles import write_profile
from profiles.synthetic import synthetic_profile
from teraio.units import parse_bandwidth, parse_size
from tests.conftest import run_teraio


@pytest.fixture(scope="module")
def synth(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli")
    write_profile(synthetic_profile(4, 6, 3, seed=2), root / "profiles" / "p1")
    return root


def test_plan_writes_plan_and_prints_summary(synth: Path) -> None:
    out = synth / "plan.json"
    trace = synth / "plan.trace.json"
    r = run_teraio("plan", synth / "profiles" / "p1", "--gpu-mem", "1.5G", "--ssd-bw", "16",
                   "--out", out, "--trace", trace)
    assert r.returncode == 0, r.stderr
    for word in ("peak", "capacity", "ideal", "stalls", "to SSD", "bandwidth", "activation_offload"):
        assert word in r.stdout
    plan = load_plan(out)
    assert plan.summary["peak_after_bytes"] <= 1.5 * 2**30
    assert plan.parameters["gpu_mem_bytes"] == int(1.5 * 2**30)
    # NOTE [ Where the time goes ]: a line per phase, as in the summary
    phases = [ph["phase"] for ph in plan.summary["phases"]]
    assert phases and all(f"{name} (" in r.stdout for name in phases) and "phases      " in r.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("ph") == "X" for e in events) and any(e.get("ph") == "b" for e in events)


def test_plan_defaults_to_newest_profile_and_plan_json(synth: Path) -> None:
    r = run_teraio("plan", "--gpu-mem", "1536M", "--ssd-read-bw", "32", "--ssd-write-bw", "8",
                   "--host-mem", "1G", "--no-compare", "--json", cwd=synth)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)["summary"]
    assert summary["peak_after_bytes"] <= 1536 * 2**20
    plan = load_plan(synth / "plan.json")
    assert plan.parameters["ssd_read_bw_bytes_per_s"] == 32e9
    assert plan.parameters["ssd_write_bw_bytes_per_s"] == 8e9


@pytest.mark.parametrize(("args", "message"), [
    (["--gpu-mem", "80Q"], "--gpu-mem: bad size '80Q'"),
    (["--gpu-mem", "80G", "--ssd-bw", "fast"], "--ssd-bw: bad bandwidth 'fast'"),
    (["--gpu-mem", "80G", "--ssd-bw", "-1"], "--ssd-bw: bad bandwidth '-1'"),
    (["--gpu-mem", "80G", "--host-mem", "lots"], "--host-mem: bad size 'lots'"),
    (["--gpu-mem", "1M"], "needs"),
])
def test_plan_bad_input_is_one_line_and_exit_2(synth: Path, args: list[str], message: str) -> None:
    r = run_teraio("plan", synth / "profiles" / "p1", "--out", synth / "x.json", *args)
    assert r.returncode == 2
    assert message in r.stderr
    assert "Traceback" not in r.stderr


def test_capacity_error_names_the_op_and_bytes(synth: Path) -> None:
    r = run_teraio("plan", synth / "profiles" / "p1", "--gpu-mem", "1M", "--out", synth / "x.json")
    assert r.returncode == 2
    line = r.stderr.strip().splitlines()[-1]
    assert "op " in line and "bytes" in line and "capacity 1,048,576 bytes" in line
    assert "rank 0" not in line  # one process: no rank to name (a sweep's scripts read "rank 0: op 65 ...")


def test_the_first_iteration_is_planned_and_held_to_the_least_it_fits_in(tmp_path: Path) -> None:
    """A profile with iteration 0 gets a plan for it; where iteration 0 needs more than the
    budget, it is planned for what it needs, with a warning."""
    steady, first = synthetic_profile(4, 6, 3, seed=2), synthetic_profile(4, 6, 3, seed=2, activation_bytes=96 << 20)
    whole = dataclasses.replace(steady, first=first)
    write_profile(whole, tmp_path / "p")
    need = int(resident_need_bytes(problem_from_profile(steady)).max())
    first_need = int(resident_need_bytes(first_problem(whole)).max())  # type: ignore[arg-type]
    assert first_need > need
    r = run_teraio("plan", tmp_path / "p", "--gpu-mem", str(need), "--out", tmp_path / "plan.json")
    assert r.returncode == 0, r.stderr
    assert "iteration 0 (the script's set-up, and the optimizer making its state) needs" in r.stderr
    assert "iteration 0 " in r.stdout
    plan = load_plan(tmp_path / "plan.json")
    assert plan.first is not None and plan.first.parameters["gpu_mem_bytes"] == first_need
    assert plan.first.summary["fits"] and plan.first.migrations[0]
    r = run_teraio("plan", tmp_path / "p", "--gpu-mem", str(first_need), "--out", tmp_path / "plan2.json")
    assert r.returncode == 0 and "needs" not in r.stderr
    assert load_plan(tmp_path / "plan2.json").first.parameters["gpu_mem_bytes"] == first_need


def test_plan_without_a_profile_says_how_to_make_one(tmp_path: Path) -> None:
    r = run_teraio("plan", "--gpu-mem", "80G", cwd=tmp_path)
    assert r.returncode == 2 and "teraio profile" in r.stderr


def test_help_states_units() -> None:
    r = run_teraio("plan", "--help")
    assert r.returncode == 0
    assert "powers of 1024" in r.stdout and "GB/s" in r.stdout


def test_roofline_table(synth: Path) -> None:
    r = run_teraio("roofline", synth / "profiles" / "p1", "--gpu-mem", "1.5G", "--bw", "4,64", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [row["bw_gb_per_s"] for row in rows] == [4, 64]
    assert all(row["ideal"] == 1.0 for row in rows)
    assert rows[1]["planner"] >= rows[0]["planner"] > 0


def test_roofline_plot(synth: Path) -> None:
    pytest.importorskip("matplotlib")
    png = synth / "roof.png"
    r = run_teraio("roofline", synth / "profiles" / "p1", "--gpu-mem", "1.5G", "--bw", "8,32", "--plot", png)
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_roofline_bad_bandwidth_list(synth: Path) -> None:
    r = run_teraio("roofline", synth / "profiles" / "p1", "--gpu-mem", "1G", "--bw", "4,x")
    assert r.returncode == 2 and "--bw: bad bandwidth 'x'" in r.stderr


@pytest.mark.parametrize(("text", "value"), [
    ("80G", 80 << 30), ("1.5T", int(1.5 * (1 << 40))), ("4096", 4096), ("512M", 512 << 20), ("2KiB", 2048),
])
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "80Q", "-1G", "G", "1e3", "nan"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="bad size"):
        parse_size(text)


def test_parse_size_zero_only_when_allowed() -> None:
    assert parse_size("0", allow_zero=True) == 0
    with pytest.raises(ValueError, match="must be positive"):
        parse_size("0")


def test_parse_bandwidth() -> None:
    assert parse_bandwidth("16") == 16e9
    assert parse_bandwidth("12.5GB/s") == 12.5e9
    for bad in ("0", "-3", "x", "inf", "nan"):
        with pytest.raises(ValueError, match="bad bandwidth"):
            parse_bandwidth(bad)


def test_plan_reports_ssd_wear_and_bandwidth_needed(synth: Path) -> None:
    r = run_teraio("plan", synth / "profiles" / "p1", "--gpu-mem", "1.5G", "--ssd-bw", "16", "--json",
                   "--bw-needed", "--ssd-endurance-pbw", "7", "--no-compare", "--out", synth / "wear.json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)["summary"]
    assert s["ssd_bytes_per_iteration"] == s["bytes_to_ssd"] > 0
    assert s["ssd_life_years"] == pytest.approx(7e15 / (s["ssd_bytes_per_day"] * 365))
    need = s["bw_needed_gb_per_s"]
    assert set(need) == {"0.90", "0.95"} and need["0.90"] <= need["0.95"]


def test_plan_refuses_a_nonpositive_endurance(synth: Path) -> None:
    r = run_teraio("plan", synth / "profiles" / "p1", "--gpu-mem", "1.5G", "--ssd-endurance-pbw", "0",
                   "--out", synth / "never.json")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--ssd-endurance-pbw" in r.stderr
    assert not (synth / "never.json").exists()


def test_copies_on_the_compute_are_zero_off_the_cpu_and_charged_when_given(synth: Path) -> None:
    """A profile not taken on the CPU predicts without them; given figures are charged."""
    r = run_teraio("plan", synth / "profiles" / "p1", "--gpu-mem", "1.5G", "--ssd-bw", "16", "--json",
                   "--no-compare", "--out", synth / "gpu.json")
    assert r.returncode == 0, r.stderr
    assert "measuring" not in r.stderr
    gpu = load_plan(synth / "gpu.json")
    assert gpu.parameters["copy_cost_s_per_byte"] == gpu.parameters["op_overhead_s"] == 0
    assert gpu.summary["copy_charge_us"] == gpu.summary["op_overhead_us"] == gpu.summary["refault_us"] == 0
    r = run_teraio("plan", synth / "profiles" / "p1", "--gpu-mem", "1.5G", "--ssd-bw", "16", "--no-compare",
                   "--copy-cost", "1.5", "--op-overhead", "20", "--refault-cost", "0.5", "--out", synth / "cpu.json")
    assert r.returncode == 0, r.stderr
    assert "of which copies and transfers on the compute" in r.stdout
    cpu = load_plan(synth / "cpu.json")
    assert cpu.parameters["copy_cost_s_per_byte"] == pytest.approx(1.5e-9)
    assert cpu.parameters["op_overhead_s"] == pytest.approx(20e-6)
    assert cpu.parameters["refault_s_per_byte"] == pytest.approx(0.5e-9)
    assert cpu.summary["copy_charge_us"] > 0
    assert cpu.summary["op_overhead_us"] == pytest.approx(20 * cpu.summary["num_ops"])
    assert cpu.summary["predicted_iteration_us"] > gpu.summary["predicted_iteration_us"]


@pytest.mark.parametrize("option", ["--copy-cost", "--op-overhead", "--refault-cost", "--transfer-cost",
                                    "--transfer-latency"])
def test_bad_compute_costs_are_one_line_and_exit_2(synth: Path, option: str) -> None:
    for bad in ("fast", "-1", "inf", "nan", "1e308"):  # 1e308 overflowed the simulation to NaN
        r = run_teraio("plan", synth / "profiles" / "p1", "--gpu-mem", "1.5G", option, bad, "--out", synth / "x.json")
        assert r.returncode == 2 and f"{option}: bad value" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("option", ["--ssd-duplex", "--host-duplex"])
def test_a_duplex_is_a_share_and_is_planned_for(synth: Path, option: str) -> None:
    """NOTE [ Duplex ] in planner.simulate: more than 0, at most 1; a plan records it and, where
    both directions move at once, predicts a slower iteration than with independent directions."""
    for bad in ("0", "-0.5", "1.5", "nan"):
        r = run_teraio("plan", synth / "profiles" / "p1", "--gpu-mem", "1.5G", option, bad, "--out", synth / "x.json")
        assert r.returncode == 2 and f"{option}: bad value" in r.stderr and "Traceback" not in r.stderr
    args = [synth / "profiles" / "p1", "--gpu-mem", "1.5G", "--ssd-bw", "2", "--host-mem", "1G", "--host-bw", "2",
            "--no-compare"]
    plans = {}
    for duplex in ("1", "0.25"):
        out = synth / f"duplex-{duplex}.json"
        r = run_teraio("plan", *args, option, duplex, "--out", out)
        assert r.returncode == 0, r.stderr
        plans[duplex] = load_plan(out)
    key = option.removeprefix("--").replace("-", "_")
    assert plans["1"].parameters[key] == 1 and plans["0.25"].parameters[key] == 0.25
    assert plans["0.25"].summary["predicted_iteration_us"] > plans["1"].summary["predicted_iteration_us"]


def test_a_cpu_profile_measures_the_costs_here_once(tmp_path: Path) -> None:
    """`auto` on a profile taken on the CPU runs the calibration (runtime.calibrate) on this
    machine once; the next plan reads its figures from the cache. Planning in a shell that a
    job's launcher left RANK set in measures all the same."""
    prof = synthetic_profile(4, 6, 3, seed=2)
    write_profile(dataclasses.replace(prof, meta={**prof.meta, "device_type": "cpu"}), tmp_path / "p")
    cache = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "RANK": "1", "WORLD_SIZE": "2"}
    plans = []
    for i in range(2):
        bw = ["--ssd-bw", "16"] if i == 0 else []  # then auto: the posix backend's measured rates
        r = run_teraio("plan", tmp_path / "p", "--gpu-mem", "1.5G", *bw, "--no-compare",
                       "--op-overhead", "20", "--out", tmp_path / f"plan{i}.json", env=cache)
        assert r.returncode == 0, r.stderr
        plans.append(load_plan(tmp_path / f"plan{i}.json").parameters)
        measuring = "measuring what moving tensors costs the compute" in r.stderr
        assert measuring == (i == 0), r.stderr
        assert ("measured on this machine now" if i == 0 else "delete it to measure again") in r.stderr
    assert (tmp_path / "cache" / "teraio" / "cpu-costs.json").exists()
    for params in plans:
        assert params["op_overhead_s"] == pytest.approx(20e-6)  # given, not measured
        assert params["copy_cost_s_per_byte"] >= 0 and params["refault_s_per_byte"] >= 0
        assert params["transfer_cost_s"] > 0  # hundreds of us here: never lost in the noise
        assert params["transfer_latency_s"] > 0
        assert 0 < params["ssd_duplex"] <= 1
    assert plans[0]["copy_cost_s_per_byte"] == plans[1]["copy_cost_s_per_byte"]
    assert plans[0]["ssd_read_bw_bytes_per_s"] == 16e9
    measured = next(iter(json.loads((tmp_path / "cache" / "teraio" / "cpu-costs.json").read_text()).values()))
    for way in ("read", "write"):  # as printed, 4 digits
        assert plans[1][f"ssd_{way}_bw_bytes_per_s"] == pytest.approx(
            measured["costs"][f"posix_{way}_bw_bytes_per_s"], rel=1e-3)


def test_a_cuda_profile_counts_each_transfer_where_a_gpu_measures_it(tmp_path: Path) -> None:
    """NOTE [ Small transfers on a GPU ] in teraio/cmd_plan.py: `--transfer-cost auto` on a CUDA
    profile measures the runtime's work per transfer on this machine's GPU; without one it is 0,
    and the plan says why (the other CPU figures stay 0 either way). A fake profile's is 0."""
    import torch

    prof = synthetic_profile(4, 6, 3, seed=2)
    write_profile(dataclasses.replace(prof, meta={**prof.meta, "device_type": "cuda"}), tmp_path / "p")
    r = run_teraio("plan", tmp_path / "p", "--gpu-mem", "1.5G", "--ssd-bw", "16", "--no-compare",
                   "--out", tmp_path / "plan.json", env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr
    params = load_plan(tmp_path / "plan.json").parameters
    assert params["copy_cost_s_per_byte"] == params["op_overhead_s"] == params["transfer_latency_s"] == 0
    if torch.cuda.is_available():
        assert "us per transfer, the runtime's own work for each on this GPU" in r.stderr, r.stderr
        assert params["transfer_cost_s"] > 0
    else:
        print("no CUDA here: the GPU's measurement is not made (the message without one is checked)")
        assert "0 us per transfer: no GPU here to measure" in r.stderr, r.stderr
        assert params["transfer_cost_s"] == 0
    # a fake profile models another GPU than this machine's: 0, and nothing said
    write_profile(dataclasses.replace(prof, meta={**prof.meta, "device_type": "cuda", "mode": "fake"}),
                  tmp_path / "fake")
    r = run_teraio("plan", tmp_path / "fake", "--gpu-mem", "1.5G", "--ssd-bw", "16", "--no-compare",
                   "--out", tmp_path / "fake.json", env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr
    assert "--transfer-cost auto" not in r.stderr, r.stderr
    assert load_plan(tmp_path / "fake.json").parameters["transfer_cost_s"] == 0


def test_scratch_is_shown_planned_for_and_in_the_share_of_the_peak(tmp_path: Path) -> None:
    """NOTE [ Scratch ] in torch_patch.tracer, through the CLI: a profile whose op allocates inside
    itself (as a GPU profile records) shows it in `teraio inspect`, `--gpu-mem 50%` takes half of the
    peak with it, and the plan leaves room for it and says so."""
    p = synthetic_profile(4, 6, 3, seed=2)
    plain = problem_from_profile(p)
    k = int(plain.memory_bytes.argmax())
    scratch = [0] * len(p.kernels)
    scratch[k] = 1 << 30
    write_profile(dataclasses.replace(p, kernels=p.kernels.assign(scratch_bytes=scratch)), tmp_path / "p")
    r = run_teraio("inspect", tmp_path / "p")
    assert r.returncode == 0, r.stderr
    assert f"up to 1,024.0 MiB allocated inside one op (op {k}); with it, the peak with nothing moved" in r.stdout
    r = run_teraio("plan", tmp_path / "p", "--gpu-mem", "50%", "--ssd-bw", "16", "--no-compare",
                   "--out", tmp_path / "plan.json")
    assert r.returncode == 0, r.stderr
    assert "ops' scratch counted, up to 1.00 GiB" in r.stdout
    plan = load_plan(tmp_path / "plan.json")
    peak = int(plain.memory_bytes.max()) + (1 << 30)
    assert plan.parameters["gpu_mem_bytes"] == peak // 2
    s = plan.summary
    assert s["max_scratch_bytes"] == 1 << 30 and s["peak_after_bytes"] <= peak // 2
    assert s["peak_tracked_after_bytes"] <= s["peak_after_bytes"]
    assert plan.made_bytes[0][k] >= 1 << 30  # the runtime makes room for it (NOTE [ Room ])


@pytest.mark.parametrize("world_size", [1, 2])
def test_iterations_set_aside_are_named_with_their_likely_cause(world_size: int,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """`teraio plan` warns of iterations the profile set aside, which run on demand: DDP's bucket
    rebuild is named only for a job, and iterations set aside after the first kept one (a barrier
    every other step, from a sweep) are named too, since each such step of the run will do the same."""
    from teraio.cmd_plan import _warn_early_on_demand

    meta = {"world_size": world_size, "skipped_iterations": [
        {"iteration": i, "reason": f"op 5 is aten.mul.Tensor, not aten.add.Tensor (step {i})", "rank": 0}
        for i in (1, 3)]}
    _warn_early_on_demand(meta, {0: 2}, peak=400, budget=100)
    said = capsys.readouterr().err
    assert "warning: iteration 1 differed from the profiled ones (op 5" in said
    assert ("DDP's second step" in said) == (world_size > 1)
    assert "so did iteration 3 after the first kept one" in said and "--hold-on-demand" in said
    _warn_early_on_demand(meta, {0: 2}, peak=104, budget=100)  # within 5% of the budget: nothing to say
    assert capsys.readouterr().err == ""
    # set aside after the first kept one only (a sweep's branch every other step, profiled from 2):
    # said as well, without DDP's rebuild (it went 2.09x unsaid)
    _warn_early_on_demand({**meta, "skipped_iterations": meta["skipped_iterations"][1:]}, {0: 2}, peak=400,
                          budget=100)
    said = capsys.readouterr().err
    assert "warning: iteration 3 differed from the profiled ones (op 5" in said, said
    assert "DDP" not in said and "the run's steps like them will too" in said and "--hold-on-demand" in said
