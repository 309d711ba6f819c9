"""The tracer on real PyTorch training steps: identity, memory curve, iteration boundaries."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch

from planner.problem import first_problem
from profiles import memory_curve, read_profile, write_profile
from tests.conftest import ROOT, run_teraio
from torch_patch import ProfileComplete, Tracer, mark_iteration
from torch_patch.identity import CARRIED_FLAG

HERE = Path(__file__).parent


def trace(step, iters: int = 2, warmup: int = 1, steps: int = 6) -> pd.DataFrame:  # type: ignore[no-untyped-def]
    tracer = Tracer(warmup=warmup, iters=iters)
    with pytest.raises(ProfileComplete), tracer:
        for _ in range(steps):
            step()
    return tracer


def test_example_iterations_are_identical(gpt_profile: Path) -> None:
    p = read_profile(gpt_profile)
    assert p.iterations == [1, 2, 3]
    assert p.meta["iterations_identical"] is True
    k, a = p.kernels, p.accesses
    first = k[k.iteration == 1]["op_name"].tolist()
    cols = ["op_index", "tensor_id", "access"]
    acc1 = a[a.iteration == 1][cols].reset_index(drop=True)
    for it in (2, 3):
        assert k[k.iteration == it]["op_name"].tolist() == first
        pd.testing.assert_frame_equal(a[a.iteration == it][cols].reset_index(drop=True), acc1)
    kinds = set(p.tensors["kind"])
    assert {"param", "grad", "optimizer_state", "activation"} <= kinds
    params = p.tensors[p.tensors.kind == "param"]
    assert params["persistent"].all() and (params["alloc_op"] == -1).all()
    assert params["name"].str.startswith(("tok.", "pos.", "blocks.", "ln.", "head.")).all()
    state = p.tensors[p.tensors.kind == "optimizer_state"]["name"]
    assert state.str.endswith((".exp_avg", ".exp_avg_sq", ".step")).all()
    assert set(p.kernels["phase"]) >= {"forward", "backward", "optimizer"}
    assert p.kernels["module"].dropna().str.startswith("blocks.").any()


def test_the_first_iteration_is_recorded_apart(gpt_profile: Path) -> None:
    """Iteration 0 from the script's first op: the model is made in it, nothing wraps, and
    the transient storages it hands on are mapped to their steady ids."""
    p = read_profile(gpt_profile)
    first = p.first
    assert first is not None and first.iterations == [0]
    assert len(first.kernels) > len(p.kernels_of())  # the set-up, the optimizer's state
    assert first.signature != p.signature
    params = first.tensors[first.tensors.kind == "param"]
    assert len(params) == len(params_of(p)) and (params["alloc_op"] >= 0).all()
    assert (params["free_op"] == -1).all() and not params["persistent"].any()
    state = first.tensors[first.tensors.kind == "optimizer_state"]
    assert len(state) == len(p.tensors[p.tensors.kind == "optimizer_state"])
    assert (state["alloc_op"] > params["alloc_op"].max()).all()  # made by the first step
    problem = first_problem(p)
    assert problem is not None and not (problem.reads_back & (problem.end_op >= problem.num_ops)).any()
    assert (~problem.reads_back & (problem.end_op == problem.num_ops)).sum() >= len(params)
    carried = {int(k): v for k, v in first.meta["carried_into_next"]["0"].items()}
    assert carried, "the example hands its last batch and loss to the next iteration"
    steady = p.tensors.set_index("tensor_id")
    for steady_id, now in carried.items():
        assert now & CARRIED_FLAG
        made = first.tensors.set_index("tensor_id").loc[now & ~CARRIED_FLAG]
        assert made["free_op"] == -1 and made["size_bytes"] == steady.loc[steady_id, "size_bytes"]


def test_the_carried_map_does_not_depend_on_warmup() -> None:
    """Iteration 1 maps what iteration 0 hands on to its steady ids, recorded or not."""
    maps = []
    for warmup in (1, 2):
        torch.manual_seed(0)
        tracer = Tracer(warmup=warmup, iters=1)
        with pytest.raises(ProfileComplete), tracer:
            model = torch.nn.Linear(8, 8)  # made in iteration 0: its op indices differ
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(5):
                loss = model(torch.randn(4, 8)).square().sum()  # alive across the boundary
                loss.backward()
                opt.step()
        first = tracer.profile({}).first
        assert first is not None
        maps.append(first.meta["carried_into_next"]["0"])
    assert maps[0] and maps[0] == maps[1]


def test_parameter_bytes_match_the_model(gpt_profile: Path) -> None:
    p = read_profile(gpt_profile)
    # --layers 2 --hidden 64 --vocab 128 --seq 32, float32
    h, v, s, layers = 64, 128, 32, 2
    per_layer = 2 * 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (4 * h * h + 4 * h) + (4 * h * h + h)
    num_params = v * h + s * h + layers * per_layer + 2 * h + v * h
    params = p.tensors[p.tensors.kind == "param"]["size_bytes"].sum()
    assert params == 4 * num_params
    state = p.tensors[p.tensors.kind == "optimizer_state"]["size_bytes"].sum()
    assert state == 8 * num_params + 4 * len(params_of(p))


def params_of(p):  # type: ignore[no-untyped-def]
    return p.tensors[p.tensors.kind == "param"]


def test_mlp_memory_curve_is_exact(tmp_path: Path) -> None:
    r = run_teraio("profile", HERE / "mlp_script.py", "--out", tmp_path / "p")
    assert r.returncode == 0, r.stderr
    p = read_profile(tmp_path / "p")
    ops = p.kernels_of()["op_name"].tolist()
    assert ops[:6] == ["aten.randn.default", "aten.mm.default", "aten.relu.default",
                       "aten.detach.default", "aten.mm.default", "aten.sum.default"]
    # float32 sizes from B, D, H = 4, 8, 16: w1 512, w2 64, x 128, h 256, a 256, y 16, loss 4.
    # Lifetimes by hand, [first op alive, first op not alive):
    lifetimes = [
        (512, 0, 20), (64, 0, 20),      # w1, w2
        (512, 0, 6), (64, 0, 6),        # last iteration's grads, until zero_grad (before op 6)
        (128, 0, 18), (256, 1, 18), (256, 2, 18), (16, 4, 18), (4, 5, 18),  # x h a y loss
        (4, 6, 18),                     # the backward seed, ones_like(loss)
        (64, 9, 20),                    # grad of w2 = a^T @ grad_y
        (256, 11, 15),                  # grad of a = grad_y @ w2^T
        (256, 14, 17),                  # grad of h = threshold_backward
        (512, 16, 20),                  # grad of w1 = x^T @ grad_h
    ]
    expected = [sum(s for s, a, f in lifetimes if a <= i < f) for i in range(20)]
    assert len(ops) == 20
    assert memory_curve(p).tolist() == expected


def test_gradient_accumulation_is_one_iteration() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step() -> None:
        opt.zero_grad()
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
        opt.step()

    tracer = trace(step)
    kernels = tracer.done[0][1][0]
    assert (kernels["op_name"] == "aten.addmm.default").sum() == 3


def test_several_optimizers_end_the_iteration_at_the_last() -> None:
    tracer = Tracer(warmup=1, iters=2)
    with pytest.raises(ProfileComplete), tracer:  # optimizers made inside, as in a script
        a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
        opt_b = torch.optim.Adam(b.parameters(), lr=0.1)
        for _ in range(5):
            b(a(torch.randn(2, 4))).sum().backward()
            opt_a.step()
            opt_b.step()
    first, second = tracer.done[0][1][0], tracer.done[1][1][0]
    assert first["op_name"].tolist() == second["op_name"].tolist()
    assert first["phase"].iloc[-1] == "optimizer"
    assert (first["op_name"] == "aten.addmm.default").sum() == 2
    assert (first["op_name"] == "aten.lerp_.Scalar").sum() >= 1  # Adam ran inside it


def test_mark_iteration_without_optimizer() -> None:
    w = torch.randn(4, 4, requires_grad=True)

    def step() -> None:
        (w @ torch.randn(4, 2)).sum().backward()
        with torch.no_grad():
            w.sub_(0.1 * w.grad)
        w.grad = None
        mark_iteration()

    tracer = trace(step)
    assert len(tracer.done) == 2
    assert tracer.done[0][1][0]["op_name"].tolist() == tracer.done[1][1][0]["op_name"].tolist()


def test_example_script_runs_unchanged() -> None:
    assert (ROOT / "examples" / "train_gpt.py").is_file()


def test_storages_born_outside_the_traced_ops_have_rows_and_stable_ids(tmp_path: Path) -> None:
    """A batch made on another thread, one from ``torch.from_numpy`` and one through DLPack:
    each has a row (an input, the same id every step), the profile reads back, and the two
    whose memory numpy owns are marked as not resizable."""
    import threading

    import numpy as np

    def batches(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        made: dict[str, torch.Tensor] = {}
        worker = threading.Thread(target=lambda: made.update(t=torch.full((16, 8), float(step))))
        worker.start()
        worker.join()
        return (made["t"], torch.from_numpy(np.full((16, 8), step, np.float32)),
                torch.from_dlpack(np.full((16, 8), -step, np.float32)))

    tracer = Tracer(warmup=1, iters=2)
    with pytest.raises(ProfileComplete), tracer:
        model = torch.nn.Linear(8, 8)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(5):
            threaded, from_numpy, from_dlpack = batches(step)
            loss = sum(model(x).sum() for x in (threaded, from_numpy, from_dlpack))
            loss.backward()
            opt.step()
            opt.zero_grad()
    p = read_profile(write_profile(tracer.profile({}), tmp_path / "p"))
    assert p.iterations == [1, 2] and not p.meta["skipped_iterations"]
    inputs = p.tensors[(p.tensors["kind"] == "input") & (p.tensors["size_bytes"] == 16 * 8 * 4)
                       & (p.tensors["alloc_op"] >= 0)]  # made this step (the last step's may live on)
    assert len(inputs) == 3
    assert sorted(inputs["resizable"]) == [False, False, True]


def test_a_storage_kept_for_good_gets_a_long_lived_id_that_nothing_else_takes() -> None:
    """A storage made in iteration 0 and kept (a pipeline's receive buffer, DDP's buckets) and
    one made anew each step by the same op and kept for a step: the first, alive a whole
    iteration, becomes long-lived; the second keeps the carried flag; no two share an id (they
    did: the runtime then counted one twice every step)."""
    from profiles.ids import LONG_BASE, produced_id
    from torch_patch.opstream import OpStream

    w = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([w], lr=0.1)
    ids = []
    with OpStream() as stream:
        kept = torch.zeros(1000)  # op 0 of iteration 0
        for _ in range(4):
            made = torch.zeros(10)  # op 0 of every later iteration
            (w * 2).sum().backward()
            opt.step()
            ids.append((stream.ids.get(kept.untyped_storage()), stream.ids.get(made.untyped_storage())))
    del kept, made
    assert ids[0][0] == produced_id(0, 0) | CARRIED_FLAG
    for long, flagged in ids[1:]:
        assert long is not None and LONG_BASE <= long < CARRIED_FLAG
        assert flagged == produced_id(0, 0) | CARRIED_FLAG
    assert len({long for long, _ in ids[1:]}) == 1  # it keeps its long id


def test_an_ops_scratch_is_recorded_on_cuda() -> None:
    """NOTE [ Scratch ]: on an H200, ``_softmax_backward_data`` allocates a buffer the size of its
    output inside itself; the profile records it, and no op records less than nothing."""
    if not torch.cuda.is_available():
        reason = "no CUDA device: the tracer measures scratch on CUDA only (CPU profiles record 0)"
        print(reason)
        pytest.skip(reason)
    x = torch.randn(8, 256, 256, device="cuda", requires_grad=True)
    opt = torch.optim.SGD([x], lr=0.1)

    def step() -> None:
        x.softmax(-1).square().sum().backward()
        opt.step()
        opt.zero_grad()

    tracer = trace(step)
    k = tracer.profile({}).kernels
    assert (k["scratch_bytes"] >= 0).all()
    backward = k[k["op_name"] == "aten._softmax_backward_data.default"]
    assert len(backward) == 2 and (backward["scratch_bytes"] == x.numel() * 4).all(), backward


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_clock_is_the_scripts_device(device: str) -> None:
    """NOTE [ Clock ]: on a machine with a GPU, a script that trains on the CPU is timed by the
    host's clock and makes a `cpu` profile; one that moves its model to the GPU in iteration 0 is
    timed by CUDA's events from then on, its first iteration on one time line."""
    if device == "cuda" and not torch.cuda.is_available():
        reason = "no CUDA device: a script on one is timed by CUDA's events"
        print(reason)
        pytest.skip(reason)
    w = torch.zeros(512, 512, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    state = {"w": w}

    def step() -> None:
        if state["w"].device.type != device:  # in iteration 0, as a script moves its model
            state["w"] = state["w"].detach().to(device).requires_grad_()
            opt.param_groups[0]["params"] = [state["w"]]
        x = torch.randn(256, 512, device=device)
        (x @ state["w"]).square().sum().backward()
        opt.step()
        opt.zero_grad()

    p = trace(step).profile({})
    assert p.meta["device_type"] == device
    k = p.kernels
    assert (k["duration_us"] >= 0).all(), k[k["duration_us"] < 0]
    if device == "cpu":  # a matmul of 256x512x512 on the CPU, not CUDA's ~0 for a host op
        mm = k[k["op_name"] == "aten.mm.default"]
        assert len(mm) and (mm["duration_us"] > 1).all(), mm
    first = p.first.kernels if p.first is not None else None
    assert first is not None
    ends = first["start_us"] + first["duration_us"]
    assert (first["start_us"].diff().dropna() >= 0).all() and ends.max() < 60e6, first


def test_reads_outside_ops_inside_torch_func_transforms() -> None:
    """``tolist()`` inside ``torch.func.jacrev`` and ``vjp`` (MAML-style code): the tensor is a
    functorch wrapper with no storage of its own; teraio's watch on reads outside ops (NOTE
    [ DLPack exports ]) looks through it, as PyTorch alone runs it."""
    def f(t: torch.Tensor) -> torch.Tensor:
        return t * len(t.tolist())

    x = torch.randn(3)
    with Tracer():
        jac = torch.func.jacrev(f)(x)
        out, _ = torch.func.vjp(f, x)
    assert torch.equal(jac, torch.func.jacrev(f)(x)) and torch.equal(out, f(x))


def test_a_storage_carried_over_the_boundary_and_freed_at_other_ops_keeps_its_making() -> None:
    """A result made late in each step and dropped early in the next, at another op in every
    other step (MAML's fast weights, freed where the next task starts): its row wraps the
    boundary from its earliest making to its latest free, and its making counts as an
    allocation. Counted alive throughout (as it was), its op made nothing for the runtime to
    make room for, and a run at the smallest budget went 14-18% over it in 2 of 6 runs."""
    from profiles import made_bytes

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 64)
    state = {"step": 0, "carried": None}

    def step() -> None:
        if state["step"] % 2 == 0:
            state["carried"] = None  # dropped before the forward pass
        loss = model(x).square().mean()
        if state["step"] % 2 == 1:
            state["carried"] = None  # dropped after it
        loss.backward()
        state["carried"] = model.weight.detach() * 2  # made late, bound over the boundary
        opt.step()
        opt.zero_grad()
        state["step"] += 1

    prof = trace(step, iters=2, warmup=1).profile({})
    kernels = prof.kernels_of(0, prof.iterations[0])
    mul = int(kernels.index[kernels["op_name"] == "aten.mul.Tensor"][-1])
    size = 64 * 64 * 4
    rows = prof.tensors_of(0)
    row = rows[(rows["alloc_op"] == mul) & (rows["size_bytes"] == size)]
    assert len(row) == 1, rows[rows["size_bytes"] == size]
    assert 0 <= int(row["free_op"].iloc[0]) <= mul and bool(row["persistent"].iloc[0])  # wraps
    assert made_bytes(prof, 0, prof.iterations[0])[mul] >= size


def test_what_iteration_0_hands_on_is_mapped_though_later_iterations_carry_more() -> None:
    """A script that makes a tensor after each step from its first on (a queue's index, used at
    the next step's start) carries one storage more from iteration 1 on than from iteration 0:
    iteration 0's carried storages are still paired with their steady ids, by size and order
    (none was, and the steady plan left them all in memory through iteration 1)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state: dict[str, torch.Tensor | None] = {"index": None, "logits": None}

    def step() -> None:
        if state["index"] is not None:
            model.bias.data.index_add_(0, state["index"], torch.ones(8))
        logits = model(torch.randn(32, 64))  # carried: bound until the next step's forward
        state["logits"] = None
        state["logits"] = logits
        logits.square().mean().backward()
        opt.step()
        opt.zero_grad()
        state["index"] = torch.arange(8)  # made after the step, so from iteration 1 on

    tracer = trace(step, iters=2, warmup=1)
    sizes = tracer.profile({}).tensors_of(0).set_index("tensor_id")["size_bytes"]
    assert 32 * 64 * 4 in {int(sizes.get(steady, 0)) for steady in tracer.first_carried}, tracer.first_carried


def test_storages_on_the_meta_device_hold_no_memory() -> None:
    """A module skeleton on the meta device (``torch.func.functional_call`` runs it with real
    weights) has sizes and no memory: its parameters' rows are empty, the real weights' are not
    (they counted, and the profiled peak was 153,640 bytes too high for the compat script)."""
    from torch.func import functional_call

    torch.manual_seed(0)
    net = torch.nn.Linear(64, 512)
    params = {k: v.detach().clone().requires_grad_(True) for k, v in net.named_parameters()}
    skeleton = net.to("meta")
    opt = torch.optim.SGD(list(params.values()), lr=0.1)

    def step() -> None:
        functional_call(skeleton, params, (torch.randn(8, 64),)).square().mean().backward()
        opt.step()
        opt.zero_grad()

    tracer = Tracer(warmup=1, iters=2)
    with pytest.raises(ProfileComplete), tracer:
        for _ in range(6):
            step()
    rows = tracer.profile({}).tensors_of(0).set_index("name")["size_bytes"]
    assert rows["weight"] == 0 and rows["bias"] == 0, rows
    assert rows["opt0.group0.param0"] == 64 * 512 * 4

@pytest.mark.parametrize("iters", [2, 1])
def test_a_tensor_made_before_the_loop_is_one_storage_in_every_kept_iteration(iters: int) -> None:
    """A data set made before the first step and indexed every step is carried into iteration 1
    under a flagged id and long-lived from iteration 2 on (NOTE [ Kept for good ]): a default
    profile (iterations 1 and 2) has one row of it, not two (its peak held it twice), and
    iteration 0's plan hands it on under the steady id. With ``--iters 1`` too (the profile
    ended before iteration 1's boundary named it, and a run then knew it in iterations 1 and 2
    only: planned out, it stayed in from iteration 3 on)."""
    from profiles import memory_curve

    torch.manual_seed(0)
    table = torch.randn(256 * 1024)  # 1 MiB, never named by a model or an optimizer
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"step": 0}

    def step() -> None:
        x = table[state["step"] * 512:(state["step"] + 1) * 512].view(8, 64)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        state["step"] += 1

    tracer = trace(step, iters=iters, warmup=1)
    prof = tracer.profile({})
    rows = prof.tensors_of(0)
    big = rows[rows["size_bytes"] == table.untyped_storage().nbytes()]
    assert len(big) == 1, big
    steady = int(big["tensor_id"].iloc[0])
    assert steady in tracer.first_carried and tracer.first_carried[steady] & CARRIED_FLAG
    assert memory_curve(prof, 0, prof.iterations[0]).max() < 2 * table.untyped_storage().nbytes()


def test_a_tensor_made_in_the_step_before_the_first_kept_one_is_one_storage() -> None:
    """A cache made in step 1 and kept for good (as DDP rebuilds its buckets in step 1): step 1
    is set aside, unlike the rest, so the profile keeps iterations 2 and 3; the cache has a
    flagged id in 2 and its long id from 3 on. One row of it, under the long id, as in every
    iteration from 3 on, and the profile maps that id to the flagged one for iteration 2
    (``kept_for_good``; before, two rows, the peak holding it twice)."""
    from profiles import memory_curve
    from profiles.ids import LONG_BASE

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state: dict[str, Any] = {"step": 0, "cache": None}

    def step() -> None:
        if state["step"] == 1:
            state["cache"] = torch.randn(512 * 1024)  # 2 MiB
        x = torch.randn(8, 64)
        if state["cache"] is not None:
            x = x + state["cache"][:64]
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        state["step"] += 1

    tracer = trace(step, iters=2, warmup=1, steps=8)
    prof = tracer.profile({})
    assert prof.iterations == [2, 3]
    nbytes = state["cache"].untyped_storage().nbytes()
    rows = prof.tensors_of(0)
    big = rows[rows["size_bytes"] == nbytes]
    assert len(big) == 1, big
    steady = int(big["tensor_id"].iloc[0])
    assert LONG_BASE <= steady < CARRIED_FLAG
    kept = prof.meta["kept_for_good"]["0"]
    assert prof.first is not None and "kept_for_good" not in prof.first.meta  # iteration 2's
    assert list(kept) == ["2"] and kept["2"][str(steady)] & CARRIED_FLAG
    assert memory_curve(prof, 0, 2).max() < 2 * nbytes


def test_a_larger_shape_that_never_comes_again_is_waited_for_a_few_iterations_only() -> None:
    """A larger first recorded batch is a shape of the same ops with more bytes; the profile
    waits for it to recur (NOTE [ The larger shape ]) for at most ``max_skipped`` iterations
    beyond those it keeps, then keeps the complete shape, naming only the larger one set aside
    (a review found it waiting to the script's end, and listing the kept shape's later
    iterations as set aside)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"step": 0}

    def step() -> None:
        x = torch.randn(256 if state["step"] == 1 else 16, 64)
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
        state["step"] += 1

    tracer = trace(step, steps=40)
    assert state["step"] <= 2 + 2 + tracer.max_skipped  # warm-up, the larger, the kept, the waited
    assert [it for it, _ in tracer.done] == [2, 3]
    assert [s["iteration"] for s in tracer.skipped] == [1] and tracer.skipped[0]["sizes_only"]


def test_the_tensors_a_data_set_holds_are_found_through_its_wrappers() -> None:
    """What a DataLoader's workers will read (NOTE [ Data loading is not counted ]): the tensors
    of a TensorDataset inside a Subset inside a ConcatDataset, and a tensor attribute listed
    after a long list of token ids."""
    from torch.utils.data import ConcatDataset, Subset, TensorDataset

    from torch_patch.opstream import _held_by

    a, b, c = torch.ones(4, 2), torch.zeros(4), torch.ones(3)
    nested = ConcatDataset([Subset(TensorDataset(a, b), [0, 1]), TensorDataset(c)])
    assert {id(t) for t in _held_by(nested)} == {id(a), id(b), id(c)}

    class Tokens:
        def __init__(self) -> None:
            self.ids = list(range(2_000_000))
            self.table = c

    assert [id(t) for t in _held_by(Tokens())] == [id(c)]


@pytest.mark.parametrize("where", ["after the forward pass", "after the batch is made"])
def test_gradients_freed_late_in_a_step_are_one_storage_that_wraps(where: str) -> None:
    """NOTE [ Gradients re-made ]: with zero_grad (set_to_none) later in the step than its first op,
    each gradient is one row whose lifetime wraps, out from the step until zero_grad, so the
    smallest budget is that of zero_grad right after the step. Two rows (last step's gradient
    alive from the start with no period to leave in) held every gradient in memory: 8.2 MiB
    against 2.0 for a model of 8 MiB of weights."""
    from planner.problem import problem_from_profile, resident_need_bytes

    def smallest(late: bool) -> int:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step() -> None:
            x = torch.randn(8, 256)
            if late and where == "after the batch is made":
                opt.zero_grad()
            loss = model(x).square().mean()
            if late and where == "after the forward pass":
                opt.zero_grad()
            loss.backward()
            opt.step()
            if not late:
                opt.zero_grad()

        prof = trace(step).profile({})
        grads = prof.tensors_of(0)[lambda t: t["kind"] == "grad"]
        assert len(grads) == 8 and grads["name"].is_unique, grads
        if late:
            assert ((0 <= grads["free_op"]) & (grads["free_op"] <= grads["alloc_op"])).all(), grads  # wraps
        return int(resident_need_bytes(problem_from_profile(prof)).max())

    assert smallest(late=True) == smallest(late=False)


def test_a_loss_carried_from_iteration_0_keeps_its_size_where_iteration_1_makes_another_at_its_index() -> None:
    """Manual mixed precision (a sweep's): bf16 weights copied back from fp32 masters after each
    step. Iteration 0's op indices include the set-up, so its loss, still bound at the boundary,
    has the index of a 1 KiB bf16 copy iteration 1 makes and keeps: paired by position, the loss
    took the copy's size, iteration 1 was set aside as of other sizes and 7 were recorded."""
    import copy

    from torch import nn

    def train() -> None:
        torch.manual_seed(0)
        m32 = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
        m16 = copy.deepcopy(m32).to(torch.bfloat16)
        master = [q.detach().clone().float() for q in m32.parameters()]
        opt = torch.optim.Adam(master, lr=1e-3)
        gen = torch.Generator().manual_seed(1)
        for _ in range(8):
            x, y = torch.randn(256, 128, generator=gen).bfloat16(), torch.randint(0, 10, (256,), generator=gen)
            loss = nn.functional.cross_entropy(m16(x).float(), y)
            m16.zero_grad(set_to_none=True)
            (loss * 128.0).backward()
            for mp, q in zip(master, m16.parameters(), strict=True):
                mp.grad = q.grad.float() / 128.0
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                for mp, q in zip(master, m16.parameters(), strict=True):
                    q.copy_(mp)
            loss.item()

    tracer = Tracer(warmup=1, iters=2)
    with pytest.raises(ProfileComplete), tracer:
        train()
    meta = tracer.profile({}).meta
    assert meta["iterations"] == [1, 2] and not meta["skipped_iterations"], meta["skipped_iterations"]


def test_a_storage_another_library_frees_in_place_is_not_movable_in_iteration_0_either() -> None:
    """NOTE [ Storages others resize ] in torch_patch.opstream: a buffer made by an op in the first
    step and then freed and refilled in place by another library each step (FSDP2's unsharded
    parameter with reshard_after_forward=False, a sweep's) is not movable in iteration 0's rows
    either: its free released its id before it was marked, and iteration 0's plan moved it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state: dict[str, torch.Tensor] = {}

    def step() -> None:
        if "full" in state:
            state["full"].untyped_storage().resize_(4000 * 4)
            state["full"].fill_(1.0)
        else:
            state["full"] = torch.ones(4000)
        loss = model(torch.randn(8, 64)).sum() + state["full"].sum()
        loss.backward()
        state["full"].untyped_storage().resize_(0)  # after the backward, as FSDP2 reshards
        opt.step()
        opt.zero_grad()

    tracer = trace(step, iters=2, warmup=1)
    prof = tracer.profile({})
    assert prof.first is not None
    for tensors in (prof.first.tensors, prof.tensors):
        full = tensors[tensors["size_bytes"] == 4000 * 4]
        assert len(full) and not full["resizable"].any(), full
