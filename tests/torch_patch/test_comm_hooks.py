"""NOTE [ Communication hooks ] in torch_patch.opstream: a hook's own ops are counted, its
future's callbacks' are not, wherever and whenever those run."""

# no `from __future__ import annotations`: DDP checks a hook's annotations are the classes themselves
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from torch_patch.opstream import OpStream


class Counting(OpStream):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[int] = []

    def end_iteration(self) -> None:
        self.ops.append(self.op_index)


def fp16_done_first(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's fp16 compression, with the collective done before the callback is added, as it
    sometimes is under load: the callback runs at once, on the training thread."""
    buffer = bucket.buffer()
    fut = dist.all_reduce(buffer.to(torch.float16), async_op=True).get_future()
    fut.wait()
    return fut.then(lambda f: buffer.copy_(f.value()[0]))


def fp16_done_elsewhere(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The same ops, with the callback run on another thread, as the backend's thread runs it."""
    buffer = bucket.buffer()
    fut = dist.all_reduce(buffer.to(torch.float16), async_op=True).get_future()
    fut.wait()
    pending: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
    out = pending.then(lambda f: buffer.copy_(f.value()[0]))
    threading.Thread(target=pending.set_result, args=(fut.value(),)).start()
    return out


def no_ops(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def ops_per_iteration(hook: Any) -> list[int]:
    with Counting() as stream:  # entered first, as `teraio profile` and `teraio run` are
        torch.manual_seed(0)
        model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)))
        model.register_comm_hook(None, hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(4, 8)
        for _ in range(3):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    return stream.ops


def test_a_hooks_callback_that_runs_at_once_on_the_training_thread_is_not_counted(tmp_path: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        counted = ops_per_iteration(fp16_done_elsewhere)
        assert ops_per_iteration(fp16_done_first) == counted
        assert counted > ops_per_iteration(no_ops)  # the hook's own ops are counted
    finally:
        dist.destroy_process_group()
