"""`teraio profile --fake` and the characterization views of `teraio inspect`, as a user runs them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli.test_profile_cli import one_line_error
from tests.conftest import EXAMPLE, SMALL_GPT, run_teraio


@pytest.fixture(scope="module")
def llama_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama3-8B's real shapes with a tiny sequence: two micro-batches per iteration."""
    out = tmp_path_factory.mktemp("fake") / "llama"
    r = run_teraio("profile", "--fake", "--gpu", "h100", "--model", "llama3-8b", "--batch", "2",
                   "--micro-batch", "1", "--seq", "16", "--out", out)
    assert r.returncode == 0, r.stderr
    assert "predicted" in r.stderr and r.stdout.strip() == str(out)
    return out


def test_builtin_model_profile_records_mode_and_cost_model(llama_profile: Path) -> None:
    meta = json.loads((llama_profile / "meta.json").read_text())
    assert meta["mode"] == "fake" and meta["device_name"] == "NVIDIA H100 80GB HBM3"
    assert meta["device_memory_bytes"] == 81559 * 2**20
    assert meta["cost_model"]["kind"] == "roofline"
    assert meta["cost_model"]["peak_flops_per_s"]["fp32"] == 67e12
    assert meta["builtin_model"] == {
        "model": "llama3-8b", "batch": 2, "micro_batch": 1, "seq": 16, "precision": "fp32",
        "optimizer": "adamw", "lr": 1e-4, "num_micro_batches": 2}
    assert meta["iterations"] == [1] and meta["script"] is None


def test_inspect_shows_the_three_figures(llama_profile: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    r = run_teraio("inspect", llama_profile, "--plot", tmp_path / "figs", "--bw", "16,1000")
    assert r.returncode == 0, r.stderr
    for words in ("Figure 1", "of the device's", "Figure 2", "tensors of 10 MB-1 GB",
                  "Figure 3", "planner within 5% of ideal"):
        assert words in r.stdout
    assert sorted(f.name for f in (tmp_path / "figs").iterdir()) == [
        "fig1_active_bytes.png", "fig2_inactive_periods.png", "fig3_roofline.png"]
    j = run_teraio("inspect", llama_profile, "--json", "--roofline", "--bw", "16,1000")
    s = json.loads(j.stdout)
    assert 0 < s["active_of_capacity_mean"] <= s["active_of_capacity_max"] < 1
    assert s["live_of_capacity_max"] > 1  # 8B parameters and AdamW state: 128 GB
    assert [row["bw_gb_per_s"] for row in s["roofline"]] == [16, 1000]
    assert all(0 <= row["planner"] <= 1 for row in s["roofline"])
    assert s["share_10MB_1GB_tensors_idle_over_10ms"] is not None


def test_real_profile_without_capacity_skips_figure_3(gpt_profile: Path) -> None:
    r = run_teraio("inspect", gpt_profile, "--roofline")
    assert r.returncode == 0, r.stderr
    if json.loads((gpt_profile / "meta.json").read_text()).get("device_memory_bytes"):
        assert "Figure 3" in r.stdout  # a CUDA profile knows its device's capacity
    else:
        assert "Figure 3 skipped" in r.stderr and "pass --gpu-mem" in r.stderr
    r = run_teraio("inspect", gpt_profile, "--roofline", "--gpu-mem", "64M", "--bw", "8")
    assert r.returncode == 0, r.stderr
    assert "Figure 3" in r.stdout and "of the device's 64.0 MiB" in r.stdout


def test_user_script_in_fake_mode(tmp_path: Path) -> None:
    out = tmp_path / "p"
    r = run_teraio("profile", "--fake", "--gpu", "a100", EXAMPLE, "--out", out, "--", *SMALL_GPT,
                   "--steps", "4")
    assert r.returncode == 0, r.stderr
    assert "step 0 loss 1.0" in r.stdout  # .item() is a placeholder in fake mode
    meta = json.loads((out / "meta.json").read_text())
    assert meta["mode"] == "fake" and meta["device_name"] == "NVIDIA A100-SXM4-80GB"
    assert meta["iterations"] == [1]


def test_fake_script_that_needs_values_fails_with_a_hint(tmp_path: Path) -> None:
    script = tmp_path / "nz.py"
    script.write_text("import torch\nx = torch.randn(8)\nprint(x[x > 0].shape)\n")
    r = run_teraio("profile", "--fake", "--gpu", "h100", script, "--out", tmp_path / "p")
    assert r.returncode == 1
    assert "in fake mode" in one_line_error(r.stderr)


@pytest.mark.parametrize(("args", "message"), [
    (["--fake", "--gpu", "v100", "--model", "llama3-8b"], "--gpu: unknown GPU 'v100'; known: a100, h100, h200"),
    (["--fake", "--gpu", "h100", "--model", "gpt5"], "unknown model 'gpt5'; known: llama3-8b, llama3-70b"),
    (["--fake", "--model", "llama3-8b"], "--fake needs --gpu NAME, one of a100, h100, h200"),
    (["--model", "llama3-8b"], "--model needs --fake"),
    (["--gpu", "h100", str(EXAMPLE)], "--gpu needs --fake"),
    ([str(EXAMPLE), "--batch", "4"], "--batch apply to --model only"),
    (["--fake", "--gpu", "h100"], "give a training SCRIPT, or --fake --model NAME"),
    (["--fake", "--gpu", "h100", "--model", "llama3-8b", str(EXAMPLE)], "not both"),
    (["--fake", "--gpu", "h100", "--model", "llama3-8b", "--batch", "3", "--micro-batch", "2"],
     "batch 3 is not a multiple of micro-batch 2"),
    (["--fake", "--gpu", "h100", "--model", "llama3-8b", "--precision", "fp8"], "known: fp32, tf32, bf16"),
])
def test_bad_fake_options_are_one_line_errors(args: list[str], message: str, tmp_path: Path) -> None:
    r = run_teraio("profile", *args, "--out", tmp_path / "p")
    assert r.returncode == 2, r.stderr
    assert message in one_line_error(r.stderr)
    assert not (tmp_path / "p").exists()


def test_help_names_every_device_and_model() -> None:
    from torch_patch.devices import DEVICES
    from torch_patch.models import CONFIGS

    r = run_teraio("profile", "--help")
    text = " ".join(r.stdout.replace("│", " ").split())
    for name in [*DEVICES, *CONFIGS]:
        assert name in text


LLAMA_TINY_SEQ = ["--fake", "--gpu", "h100", "--model", "llama3-8b", "--seq", "16"]


@pytest.mark.parametrize(("args", "message"), [
    ([*LLAMA_TINY_SEQ, "--pipeline", "2", "--rank", "2", "--batch", "2"],
     "--pipeline: rank 2 is not a rank of a job of 2 (0 to 1)"),
    ([*LLAMA_TINY_SEQ, "--fsdp", "2", "--rank", "5", "--batch", "2"], "rank 5 is not a rank of a job of 2"),
    ([*LLAMA_TINY_SEQ, "--schedule", "1f1b"], "--schedule applies to --pipeline N only"),
    ([*LLAMA_TINY_SEQ, "--fsdp", "2", "--schedule", "zbv", "--batch", "2"], "--schedule applies to --pipeline N only"),
    ([*LLAMA_TINY_SEQ, "--pipeline", "2", "--schedule", "gpipe"],
     "--schedule: unknown schedule 'gpipe'; known: 1f1b, interleaved-1f1b, zbv"),
    ([*LLAMA_TINY_SEQ, "--rank", "0"], "--rank needs a job: --pipeline N or --fsdp N"),
    ([*LLAMA_TINY_SEQ, "--pipeline", "2", "--fsdp", "2"], "give --pipeline N or --fsdp N, not both"),
    ([*LLAMA_TINY_SEQ, "--pipeline", "2"], "1 micro-batches (batch / micro-batch) are fewer than the 2 stages"),
    ([*LLAMA_TINY_SEQ, "--fsdp", "2", "--batch", "3"], "batch 3 cannot be split evenly"),
    (["--fake", "--gpu", "h100", "--model", "t5-11b", "--pipeline", "2", "--batch", "2"], "encoder-decoder"),
    ([*LLAMA_TINY_SEQ, "--ddp", "2"], "--ddp: DDP cannot run in fake mode"),
    ([*LLAMA_TINY_SEQ, "--pipeline", "2", "--nproc", "2", "--batch", "2"], "--nproc starts real processes"),
    ([str(EXAMPLE), "--pipeline", "2"], "--pipeline apply to --fake --model"),
])
def test_bad_job_options_are_one_line_errors(args: list[str], message: str, tmp_path: Path) -> None:
    r = run_teraio("profile", *args, "--out", tmp_path / "p")
    assert r.returncode == 2, r.stderr
    assert message in one_line_error(r.stderr)
    assert not (tmp_path / "p").exists()


def test_job_help_states_units_and_defaults() -> None:
    r = run_teraio("profile", "--help")
    text = " ".join(r.stdout.replace("│", " ").split())
    for phrase in ["ranks (GPUs)", "Default: 1f1b", "Default: no job", "profile this rank only (0 to N - 1)",
                   "at least as many as the stages"]:
        assert phrase in text, phrase


def test_fake_pipeline_job_is_one_profile_of_every_rank(tmp_path: Path) -> None:
    """Both ranks of a 2-stage 1F1B job of Llama3-8B's real shapes (tiny sequence), each played
    in a process of its own, in one profile that `teraio plan` predicts the job from."""
    out = tmp_path / "job"
    r = run_teraio("profile", *LLAMA_TINY_SEQ, "--pipeline", "2", "--batch", "2", "--out", out)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(out)
    assert "rank 1 of 2: iteration 1 (recorded)" in r.stderr
    assert not list(tmp_path.glob(".*"))  # the ranks' parts are swept
    meta = json.loads((out / "meta.json").read_text())
    assert meta["ranks"] == [0, 1] and meta["world_size"] == 2
    job = meta["builtin_model"]["job"]
    assert job == {"parallelism": "pipeline", "world_size": 2, "schedule": "1f1b", "num_stages": 2,
                   "stages_of_rank": [[0], [1]], "stage_layers": [[0, 16], [16, 32]]}
    assert meta["builtin_model"]["num_micro_batches"] == 2
    plan = run_teraio("plan", out, "--gpu-mem", "80G", "--ssd-bw", "16", "--out", tmp_path / "plan")
    assert plan.returncode == 0, plan.stderr
    assert "per iteration predicted for all ranks together" in plan.stdout
