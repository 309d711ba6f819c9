"""One rank of a job in fake mode: a fake process group, pipeline stages and FSDP2 shards of a
built-in model, the peers of sends and receives, collectives timed over the device's link,
and a fake rank against the same rank of a real job (2 processes, gloo)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.testing._internal.distributed.fake_pg import FakeStore

from profiles import Profile, active_bytes, memory_curve, merge_ranks, read_profile
from tests.conftest import ROOT, run_teraio
from tests.torch_patch.builtin_job_script import JOB_TRAIN, TINY
from torch_patch import ProfileComplete, Tracer, mark_iteration
from torch_patch.builtin_train import JobConfig, TrainConfig, train
from torch_patch.costmodel import RooflineCostModel
from torch_patch.devices import get_device
from torch_patch.fake import FakeTracer
from torch_patch.models import CONFIGS, Decoder, DecoderConfig

H100 = get_device("h100")
SCRIPT = ROOT / "tests" / "torch_patch" / "builtin_job_script.py"
SEND, RECV = "c10d.send.default", "c10d.recv_.default"
# c10d ops per rank and steady iteration of 4 micro-batches on 2 ranks, as measured with
# gloo (docs/distributed-notes.md, "Pipelining")
P2P_PER_RANK = {"1f1b": 4, "interleaved-1f1b": 12, "zbv": 8}


def fake_rank(job: JobConfig, cfg: TrainConfig = JOB_TRAIN, model_config: DecoderConfig = TINY,
              iters: int = 2) -> Profile:
    tracer = FakeTracer(RooflineCostModel(H100), iters=iters)
    with pytest.raises(ProfileComplete), tracer:
        train(cfg, steps=6, model_config=model_config, job=job)
    assert not dist.is_initialized()  # the fake group is gone with the job
    return tracer.profile({})


def sizes_of(p: Profile, rank: int, op_name: str) -> list[int]:
    """The bytes of the storages each ``op_name`` op of ``rank`` accesses, in op order; a
    storage both read and written (an all-gather's input is a slice of its output) once."""
    k, a = p.kernels_of(rank), p.accesses_of(rank)
    size = p.tensors_of(rank).set_index("tensor_id")["size_bytes"]
    ops = k.index[k["op_name"] == op_name]
    return [int(size[a.loc[a["op_index"] == o, "tensor_id"].unique()].sum()) for o in ops]


def stage_param_bytes(job: JobConfig, rank: int) -> int:
    """4 bytes a parameter of the stages ``rank`` holds, from modules built plainly (real)."""
    n = job.num_stages
    modules = [Decoder(TINY, JOB_TRAIN.seq, job.stage_layers(s, TINY.num_layers), s == 0, s == n - 1)
               for s in job.stages_of(rank)]
    return 4 * sum(p.numel() for m in modules for p in m.parameters())


def test_peers_of_sends_and_receives_are_ranks_of_the_job() -> None:
    """kernels.peer is the job's rank of the other end, also through a subgroup."""
    dist.init_process_group("fake", store=FakeStore(), rank=2, world_size=4)
    try:
        pair = dist.new_group([1, 2])
        tracer = Tracer(iters=1)
        with pytest.raises(ProfileComplete), tracer:
            t = torch.zeros(4)
            for _ in range(3):
                dist.send(t, 3)
                dist.recv(t, group=pair, group_src=0)  # rank 0 of [1, 2]: the job's rank 1
                t.add_(1)
                mark_iteration()
    finally:
        dist.destroy_process_group()
    p = tracer.profile({})
    assert p.meta["ranks"] == [2] and p.meta["world_size"] == 4
    k = p.kernels_of(2)
    assert k.loc[k["op_name"] == SEND, "peer"].tolist() == [3]
    assert k.loc[k["op_name"] == RECV, "peer"].tolist() == [1]
    assert (k.loc[~k["op_name"].isin([SEND, RECV]), "peer"] == -1).all()


@pytest.mark.parametrize("schedule", list(P2P_PER_RANK))
def test_fake_pipeline_ranks_send_to_each_other_and_hold_their_stages(schedule: str) -> None:
    ranks = [fake_rank(JobConfig(parallelism="pipeline", world_size=2, rank=r, schedule=schedule))
             for r in (0, 1)]
    job = merge_ranks(ranks)
    assert job.ranks == [0, 1] and job.meta["world_size"] == 2
    assert set(job.meta["signatures"]) == {"0", "1"}
    hidden = JOB_TRAIN.micro_batch * JOB_TRAIN.seq * TINY.hidden * 4  # one micro-batch's state
    for r, other in ((0, 1), (1, 0)):
        k = job.kernels_of(r)
        p2p = k[k["op_name"].isin([SEND, RECV])]
        assert (p2p["peer"] == other).all() and (k.loc[~k.index.isin(p2p.index), "peer"] == -1).all()
        assert (p2p["op_name"] == SEND).sum() == (p2p["op_name"] == RECV).sum() == P2P_PER_RANK[schedule]
        # activations forward and their gradients back: every message is one hidden state
        assert set(sizes_of(job, r, SEND)) == set(sizes_of(job, r, RECV)) == {hidden}
        # the embeddings on the first stage, the norm and the head on the last
        cfg = JobConfig(parallelism="pipeline", world_size=2, rank=r, schedule=schedule)
        stages = cfg.stages_of(r)
        t = job.tensors_of(r)
        # two stages on a rank are two root modules: root0.*, root1.*
        names = {n.split(".", 1)[1] if n.startswith("root") else n for n in t.loc[t["kind"] == "param", "name"]}
        assert ("tok_embeddings.weight" in names) == (0 in stages)
        assert ("output.weight" in names) == ("norm.weight" in names) == (cfg.num_stages - 1 in stages)
        assert t.loc[t["kind"] == "param", "size_bytes"].sum() == stage_param_bytes(cfg, r)
        assert job.meta["iterations_identical"]
    if schedule == "1f1b":  # the first stage sends first; the last receives first
        assert job.kernels_of(0).query("peer >= 0")["op_name"].iloc[0] == SEND
        assert job.kernels_of(1).query("peer >= 0")["op_name"].iloc[0] == RECV


def test_fsdp_rank_holds_its_shard_and_its_collectives_take_the_link() -> None:
    p = fake_rank(JobConfig(parallelism="fsdp", world_size=2, rank=1))
    t = p.tensors_of(1)
    whole = 4 * sum(q.numel() for q in Decoder(TINY, JOB_TRAIN.seq).parameters())
    # every tensor of TINY splits evenly in two: the shards are half the model
    assert t.loc[t["kind"] == "param", "size_bytes"].sum() == whole // 2
    k = p.kernels_of(1)
    gathers = k[k["op_name"] == "c10d._allgather_base_.default"]
    scatters = k[k["op_name"] == "c10d._reduce_scatter_base_.default"]
    # 5 units (4 blocks, the root); 2 micro-batches a rank: gathered in each forward and
    # backward (the root stays gathered after its forward), scattered after each backward
    assert len(gathers) == 2 * (5 + 4) and len(scatters) == 2 * 5
    out = sizes_of(p, 1, "c10d._allgather_base_.default")  # the input is a slice of the output
    link = H100.link_bw_bytes_per_s
    expected = [b * (2 - 1) / 2 / link * 1e6 + 4.0 for b in out]  # (n - 1) / n of the output
    np.testing.assert_allclose(gathers["duration_us"].to_numpy(), expected)


def test_collectives_are_timed_over_the_link() -> None:
    cm = RooflineCostModel(H100, launch_us=0.0)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        calls: list[float] = []

        class Timing(Tracer):
            def run_op(self, index, func, args, kwargs, inputs):  # type: ignore[no-untyped-def]
                if func.namespace == "c10d":  # not the zeros between them
                    calls.append(cm.op_us(func, args, kwargs, [t for _, t, _ in inputs], None))
                return func(*args, **kwargs)

        with Timing(iters=1):
            x = torch.zeros(2**18)  # 1 MiB
            dist.all_reduce(x)
            dist.send(x, 1)
            out = torch.zeros(4 * 2**18)
            dist.all_gather_into_tensor(out, x)
        calls.append(-1.0)  # then the functional collectives (DTensor's), timed alike
        group = dist.group.WORLD
        tracer = FakeTracer(cm, iters=1)
        with pytest.raises(ProfileComplete), tracer:
            x = torch.zeros(2**18)
            mark_iteration()
            funcol.all_reduce(x, "sum", group).add_(1)
            funcol.all_gather_tensor(x, 0, group).add_(1)
            funcol.reduce_scatter_tensor(x, "sum", 0, group).add_(1)
            mark_iteration()
    finally:
        dist.destroy_process_group()
    mib = 2**20 / H100.link_bw_bytes_per_s * 1e6
    assert calls == pytest.approx([2 * 3 / 4 * mib, mib, 3 / 4 * 4 * mib, -1.0])
    k = tracer.profile({}).kernels_of()
    k = k[k["op_name"].str.startswith("_c10d_functional.")]
    wrap = "_c10d_functional._wrap_tensor_autograd.default"  # NOTE [ Fake functional collectives ]
    assert k["op_name"].tolist() == ["_c10d_functional.all_reduce.default", wrap,
                                     "_c10d_functional.all_gather_into_tensor.default", wrap,
                                     "_c10d_functional.reduce_scatter_tensor.default", wrap]
    assert k["duration_us"].tolist() == pytest.approx([2 * 3 / 4 * mib, 0, 3 / 4 * 4 * mib, 0, 3 / 4 * mib, 0])


def test_job_config_says_what_cannot_run() -> None:
    pipe = JobConfig(parallelism="pipeline", world_size=2, rank=0)
    cfg = TrainConfig(model="llama3-8b", batch=4, micro_batch=1, seq=8)
    with pytest.raises(ValueError, match="ties its input and output embeddings"):
        pipe.check(TrainConfig(model="granite-8b-code-base", batch=4, micro_batch=1, seq=8),
                   CONFIGS["granite-8b-code-base"])
    with pytest.raises(ValueError, match="encoder-decoder"):
        pipe.check(TrainConfig(model="t5-11b", batch=4, micro_batch=1, seq=8), CONFIGS["t5-11b"])
    with pytest.raises(ValueError, match="fewer than the 4 stages of zbv"):
        JobConfig(parallelism="pipeline", world_size=2, rank=0, schedule="zbv").check(
            TrainConfig(model="llama3-8b", batch=2, micro_batch=1, seq=8), TINY)
    with pytest.raises(ValueError, match="1 blocks, fewer than the 2 stages"):
        pipe.check(cfg, DecoderConfig(vocab_size=8, hidden=8, num_layers=1, num_heads=2,
                                      num_kv_heads=2, ffn_hidden=8))
    with pytest.raises(ValueError, match="between 3 FSDP ranks"):
        JobConfig(parallelism="fsdp", world_size=3, rank=0).check(cfg, TINY)
    with pytest.raises(ValueError, match="not a rank of a job of 2"):
        JobConfig(parallelism="fsdp", world_size=2, rank=2)
    with pytest.raises(ValueError, match="for one process"):
        pipe.check(TrainConfig(model="llama3-8b", batch=1, micro_batch=1, seq=8,
                               optimizer="adamw-in-backward"), TINY)


def without_gloo_waits(names: list[str]) -> list[str]:
    """``names`` less what gloo runs in a reduce-scatter's wait: it reduces with an all-reduce
    and copies the shard out there, so the mode sees ``split`` and ``copy_`` after the op
    (docs/distributed-notes.md, a). A fake group (and NCCL) does not."""
    out: list[str] = []
    i = 0
    while i < len(names):
        out.append(names[i])
        wait = names[i + 1:i + 3] == ["aten.split.Tensor", "aten.copy_.default"]
        i += 3 if names[i] == "c10d._reduce_scatter_base_.default" and wait else 1
    return out


@pytest.mark.parametrize("parallelism", ["pipeline", "fsdp"])
def test_fake_ranks_issue_the_ops_of_a_real_job(parallelism: str, tmp_path: Path) -> None:
    """The same tiny job run for real (torchrun, 2 processes, gloo) and rank by rank in fake
    mode: the same ops in every steady iteration, touching the same bytes, and the same
    memory, but for what the fake group's works do not hold (see the assertions)."""
    out = tmp_path / "real"
    r = run_teraio("profile", "--nproc", "2", SCRIPT, "--out", out, "--", parallelism, "1f1b")
    assert r.returncode == 0, r.stderr[-3000:]
    real = read_profile(out)
    hidden = JOB_TRAIN.micro_batch * JOB_TRAIN.seq * TINY.hidden * 4
    for rank in (0, 1):
        fake = fake_rank(JobConfig(parallelism=parallelism, world_size=2, rank=rank))
        rk, fk = real.kernels_of(rank), fake.kernels_of(rank)
        if parallelism == "pipeline":
            for col in ("op_name", "phase", "module", "peer"):
                assert rk[col].tolist() == fk[col].tolist(), col
            np.testing.assert_array_equal(active_bytes(real, rank), active_bytes(fake, rank))
            # A real backend's send holds its tensor until the schedule waits for it: the
            # first micro-batch's activation outlives its backward there (on the first stage)
            diff = memory_curve(real, rank) - memory_curve(fake, rank)
            assert diff.min() >= 0 and diff.max() <= hidden + 8  # + gloo's own 4-byte scalars
        else:
            assert without_gloo_waits(rk["op_name"].tolist()) == fk["op_name"].tolist()
            assert len(rk) - len(fk) == 2 * (fk["op_name"] == "c10d._reduce_scatter_base_.default").sum()
            kinds = ["param", "grad", "optimizer_state"]
            rt, ft = real.tensors_of(rank), fake.tensors_of(rank)
            pd.testing.assert_series_equal(rt[rt["kind"].isin(kinds)].groupby("kind")["size_bytes"].sum(),
                                           ft[ft["kind"].isin(kinds)].groupby("kind")["size_bytes"].sum())


class _FromTorchTensor(torch.autograd.Function):
    """How torch 2.11's ``all_gather_tensor_autograd`` wraps its result: in an autograd function
    (gone from the torch installed here, which wraps it with an op that has its own autograd)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        return funcol._maybe_wrap_tensor(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


@pytest.mark.parametrize("case", ["no grad", "grad", "autograd gather", "autograd gather, torch 2.11"])
def test_a_fake_functional_collective_records_a_real_runs_ops(case: str, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Fake functional collectives ] in torch_patch.fake: fake mode waits for a functional
    collective at once, where a real run wraps its result; the wait is recorded as the wrapping,
    also where the result needs gradients (returned through autograd, it was a view: an
    ``aten.view`` op a real run does not have), and where an autograd function wraps it, as
    torch 2.11's does (an H200's torch: the same extra view)."""
    if case.endswith("2.11"):
        monkeypatch.setattr(funcol, "_FromTorchTensor", _FromTorchTensor, raising=False)

    def train(group: dist.ProcessGroup) -> None:
        w = torch.nn.Parameter(torch.ones(64, 64))
        for _ in range(3):
            x = torch.ones(64, 64) @ w
            if case == "no grad":
                x = x.detach()
            if case == "autograd gather":
                y = funcol.all_gather_tensor_autograd(x, 0, group)
            elif case.endswith("2.11"):
                gathered = torch.ops._c10d_functional_autograd.all_gather_into_tensor(x, 1, group.group_name)
                y = funcol._FromTorchTensor.apply(gathered)
            else:
                y = funcol.all_reduce(x, "sum", group)
            loss = (y * 2).sum()
            if case != "no grad":
                loss.backward()
            mark_iteration()

    names = []
    for tracer in (Tracer(iters=1), FakeTracer(RooflineCostModel(H100), iters=1)):
        fake = isinstance(tracer, FakeTracer)
        store = FakeStore() if fake else dist.FileStore(str(tmp_path / "store"), 1)
        dist.init_process_group("fake" if fake else "gloo", store=store, rank=0, world_size=1)
        try:
            with pytest.raises(ProfileComplete), tracer:
                train(dist.group.WORLD)
        finally:
            dist.destroy_process_group()
        names.append(tracer.profile({}).kernels_of()["op_name"].tolist())
    assert "_c10d_functional._wrap_tensor_autograd.default" in names[0]
    assert names[1] == names[0]
