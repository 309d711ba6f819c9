"""Fake-mode profiling: same profile as a real run, roofline timing, built-in models."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from profiles import Profile, live_intervals, memory_curve
from tests.conftest import EXAMPLE, SMALL_GPT
from torch_patch import ProfileComplete, Tracer, mark_iteration, run_script
from torch_patch.builtin_train import TrainConfig, train
from torch_patch.costmodel import RooflineCostModel
from torch_patch.devices import DEVICES, get_device
from torch_patch.fake import FakeTracer
from torch_patch.models import CONFIGS, DecoderConfig, EncoderDecoderConfig, build_model, num_parameters

H100 = get_device("h100")
PARAMETER_NEW = torch.nn.Parameter.__new__
TINY_DECODER = DecoderConfig(vocab_size=96, hidden=32, num_layers=2, num_heads=4, num_kv_heads=2,
                             ffn_hidden=48)
TINY_T5 = EncoderDecoderConfig(vocab_size=64, d_model=16, d_ff=32, d_kv=8, num_heads=2,
                               num_layers=2, num_decoder_layers=2)


def profile_example(tracer: Tracer) -> Profile:
    torch.manual_seed(0)
    with pytest.raises(ProfileComplete), tracer:
        run_script(EXAMPLE, [*SMALL_GPT, "--steps", "6", "--device", "cpu"])
    return tracer.profile({})


def profile_builtin(cfg: TrainConfig, model_config: object = None) -> Profile:
    tracer = FakeTracer(RooflineCostModel(H100, tf32=cfg.tf32))
    with pytest.raises(ProfileComplete), tracer:
        train(cfg, steps=5, model_config=model_config)  # type: ignore[arg-type]
    return tracer.profile({})


def test_fake_and_real_profiles_of_one_model_agree(capsys: pytest.CaptureFixture[str]) -> None:
    real = profile_example(Tracer(iters=2))
    fake = profile_example(FakeTracer(RooflineCostModel(H100), iters=2))
    assert real.meta["mode"] == "real" and fake.meta["mode"] == "fake"
    assert real.kernels["op_name"].tolist() == fake.kernels["op_name"].tolist()
    assert real.kernels["phase"].tolist() == fake.kernels["phase"].tolist()
    cols = ["tensor_id", "size_bytes", "kind", "dtype", "name", "persistent", "alloc_op", "free_op"]
    pd.testing.assert_frame_equal(real.tensors[cols], fake.tensors[cols])
    pd.testing.assert_frame_equal(real.accesses, fake.accesses)
    assert fake.signature == real.signature
    assert fake.meta["iterations_identical"]
    # iteration 0, which makes the model: the same ops, so that a plan made from a fake
    # profile can be followed by a real run from its first op (NOTE [ Fake parameters ])
    assert real.first is not None and fake.first is not None
    assert real.first.kernels["op_name"].tolist() == fake.first.kernels["op_name"].tolist()
    assert real.first.meta["carried_into_next"] == fake.first.meta["carried_into_next"]
    assert torch.nn.Parameter.__new__ is PARAMETER_NEW  # put back on exit
    # .item() in the script's log line gives the placeholder, and the script went on
    assert "loss 1.0" in capsys.readouterr().out


def test_fake_timing_is_the_roofline_and_back_to_back() -> None:
    fake = profile_example(FakeTracer(RooflineCostModel(H100, launch_us=3.0)))
    k = fake.kernels_of()
    np.testing.assert_allclose(k["start_us"].iloc[1:].to_numpy(),
                               (k["start_us"] + k["duration_us"]).iloc[:-1].to_numpy())
    assert k["start_us"].iloc[0] == 0
    views = k["op_name"].isin(["aten.view.default", "aten.t.default", "aten.detach.default"])
    assert (k.loc[views, "duration_us"] == 0).all()
    assert (k.loc[~views & k["op_name"].str.contains("mm"), "duration_us"] >= 3.0).all()
    cm = fake.meta["cost_model"]
    assert cm["device"] == H100.name and cm["launch_us"] == 3.0 and cm["kind"] == "roofline"
    assert fake.meta["device_memory_bytes"] == H100.memory_bytes


def test_cost_model_of_one_matmul_and_one_add() -> None:
    cm = RooflineCostModel(H100, launch_us=0.0)
    mm, add = torch.ops.aten.mm.default, torch.ops.aten.add.Tensor
    with FakeTracer(cm).fake_mode:
        a = torch.empty(4096, 4096)
        b = torch.empty(4096, 4096, dtype=torch.bfloat16)
        out = mm(a, a)
        # compute-bound: 2 n^3 FLOPs at the fp32 CUDA-core peak
        assert cm.op_us(mm, (a, a), {}, [a, a], out) == pytest.approx(2 * 4096**3 / 67e12 * 1e6)
        tf32 = RooflineCostModel(H100, launch_us=0.0, tf32=True)
        assert tf32.op_us(mm, (a, a), {}, [a, a], out) == pytest.approx(2 * 4096**3 / 494.5e12 * 1e6)
        bb = mm(b, b)
        assert cm.op_us(mm, (b, b), {}, [b, b], bb) == pytest.approx(2 * 4096**3 / 989.5e12 * 1e6)
        # memory-bound: read two, write one
        s = add(a, a)
        assert cm.op_us(add, (a, a), {}, [a, a], s) == pytest.approx(3 * 4096**2 * 4 / 3.35e12 * 1e6)
        # a broadcast (stride-0) input reads its storage once
        row = torch.empty(1, 4096).expand(4096, 4096)
        s = add(a, row)
        assert cm.op_us(add, (a, row), {}, [a, row], s) == pytest.approx(
            (2 * 4096**2 + 4096) * 4 / 3.35e12 * 1e6)
        assert cm.op_us(torch.ops.aten.view.default, (a, [-1]), {}, [a], a.view(-1)) == 0.0


def test_device_table_and_lookup() -> None:
    assert set(DEVICES) == {"a100", "h100", "h200"}
    for dev in DEVICES.values():
        assert set(dev.peak_flops_per_s) == {"fp32", "tf32", "bf16", "fp16"}
        assert dev.peak_flops_per_s["fp32"] < dev.peak_flops_per_s["tf32"] < dev.peak_flops_per_s["bf16"]
    assert get_device("H100-SXM") is DEVICES["h100"]
    assert get_device("NVIDIA H200") is DEVICES["h200"]
    with pytest.raises(ValueError, match="known: a100, h100, h200"):
        get_device("v100")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_builtin_configs_build_fake_with_their_parameter_count(name: str) -> None:
    tracer = FakeTracer(RooflineCostModel(H100))
    with tracer.fake_mode:
        model = build_model(CONFIGS[name], max_seq=16)
    assert sum(p.numel() for p in model.parameters()) == num_parameters(CONFIGS[name])
    assert CONFIGS[name].source


def state_bytes_at_optimizer(p: Profile) -> pd.Series:
    """Bytes by kind alive at the first optimizer op: params, grads and optimizer state."""
    k = p.kernels_of()
    first = int(k.index[k["phase"] == "optimizer"][0])
    t = p.tensors_of()
    row, begin, end = live_intervals(t, len(k))
    alive = t.iloc[np.unique(row[(begin <= first) & (first < end)])]
    return alive.groupby("kind")["size_bytes"].sum()


@pytest.mark.parametrize("model_config", [TINY_DECODER, TINY_T5], ids=["decoder", "t5"])
def test_builtin_training_state_is_16_bytes_a_parameter(model_config: object) -> None:
    cfg = TrainConfig(model="llama3-8b", batch=2, micro_batch=1, seq=8)
    p = profile_builtin(cfg, model_config)
    n = num_parameters(model_config)  # type: ignore[arg-type]
    by_kind = state_bytes_at_optimizer(p)
    assert by_kind["param"] == 4 * n and by_kind["grad"] == 4 * n
    num_tensors = int((p.tensors["kind"] == "param").sum())
    assert by_kind["optimizer_state"] == 8 * n + 4 * num_tensors  # exp_avg, exp_avg_sq, step
    assert {"activation", "optimizer_state"} <= set(p.tensors["kind"])
    assert set(p.kernels["phase"]) >= {"forward", "backward", "optimizer"}


def test_gradient_accumulation_runs_every_micro_batch() -> None:
    one = profile_builtin(TrainConfig(model="llama3-8b", batch=1, micro_batch=1, seq=8), TINY_DECODER)
    four = profile_builtin(TrainConfig(model="llama3-8b", batch=8, micro_batch=2, seq=8), TINY_DECODER)
    k1, k4 = one.kernels_of(), four.kernels_of()
    embed1 = (k1["op_name"] == "aten.embedding.default").sum()
    assert (k4["op_name"] == "aten.embedding.default").sum() == 4 * embed1
    opt1, opt4 = (k1["phase"] == "optimizer").sum(), (k4["phase"] == "optimizer").sum()
    assert opt1 == opt4  # one optimizer step per iteration
    assert four.meta["iterations_identical"]


def test_bf16_precision_halves_parameter_bytes() -> None:
    p = profile_builtin(TrainConfig(model="llama3-8b", batch=1, micro_batch=1, seq=8,
                                    precision="bf16"), TINY_DECODER)
    params = p.tensors[p.tensors["kind"] == "param"]
    assert set(params["dtype"]) == {"bfloat16"}
    assert params["size_bytes"].sum() == 2 * num_parameters(TINY_DECODER)


def test_llama3_8b_state_matches_the_analytic_count() -> None:
    """The real shapes, a short sequence: fp32 AdamW keeps 4 + 4 + 8 bytes a parameter."""
    p = profile_builtin(TrainConfig(model="llama3-8b", batch=1, micro_batch=1, seq=16))
    n = num_parameters(CONFIGS["llama3-8b"])
    assert 8.0e9 < n < 8.1e9
    by_kind = state_bytes_at_optimizer(p)
    total = by_kind["param"] + by_kind["grad"] + by_kind["optimizer_state"]
    assert abs(total / (16 * n) - 1) < 0.01


def test_train_config_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="not a multiple"):
        TrainConfig(model="llama3-8b", batch=3, micro_batch=2, seq=8)
    with pytest.raises(ValueError, match="known: llama3-8b"):
        TrainConfig(model="gpt5", batch=1, micro_batch=1, seq=8)
    with pytest.raises(ValueError, match="known: fp32"):
        TrainConfig(model="llama3-8b", batch=1, micro_batch=1, seq=8, precision="fp8")


def test_module_to_works_on_fake_models() -> None:
    with FakeTracer(RooflineCostModel(H100)).fake_mode:
        m = torch.nn.Linear(4, 4)
        m.to(torch.float64)  # swap_tensors: see NOTE [ Fake outputs without memo ]
        assert m.weight.dtype == torch.float64


def test_a_tensor_the_script_puts_on_meta_is_no_memory_in_fake_mode_either() -> None:
    """NOTE [ The script's meta tensors ] in torch_patch.fake: a script's own 1 MiB meta tensor,
    kept through the loop, counts as nothing, as in a real profile; the fake model's tensors
    (meta storages too) count. Before, the fake profile's peak had the 1 MiB in it."""
    def loop() -> None:
        model = torch.nn.Linear(64, 64)
        placeholder = torch.ones(1 << 18).to("meta")  # 1 MiB of float32, no memory
        for _ in range(4):
            model(torch.ones(8, 64)).sum().backward()
            mark_iteration()
        del placeholder

    peaks = {}
    for tracer in (Tracer(iters=2), FakeTracer(RooflineCostModel(H100), iters=2)):
        with pytest.raises(ProfileComplete), tracer:
            loop()
        peaks[type(tracer).__name__] = int(memory_curve(tracer.profile({})).max())
    assert 0 < peaks["FakeTracer"] == peaks["Tracer"] < 1 << 18, peaks


def test_optimizer_in_backward_frees_each_gradient_after_its_step() -> None:
    cfg = TrainConfig(model="llama3-8b", batch=1, micro_batch=1, seq=8, optimizer="adamw-in-backward")
    p = profile_builtin(cfg, TINY_DECODER)
    k = p.kernels_of()
    assert p.meta["iterations_identical"]
    # optimizer steps interleave with backward ops instead of following them
    phases = k["phase"].tolist()
    first_opt = phases.index("optimizer")
    assert "backward" in phases[first_opt:]
    t = p.tensors_of()
    row, begin, end = live_intervals(t, len(k))
    last = len(k) - 1
    alive = t.iloc[np.unique(row[(begin <= last) & (last < end)])]
    grads = alive[alive["kind"].isin(["grad", "temporary"])]["size_bytes"].sum()
    assert grads < 4 * num_parameters(TINY_DECODER) / 2  # not a whole set of gradients
    with pytest.raises(ValueError, match="cannot accumulate"):
        TrainConfig(model="llama3-8b", batch=2, micro_batch=1, seq=8, optimizer="adamw-in-backward")
