"""The example GPT of ``train_gpt.py`` trained data-parallel with DistributedDataParallel.

Run it under torchrun, which sets the rendezvous environment; on a CPU the
process group is gloo, on CUDA nccl with one device per local rank:

    torchrun --nproc-per-node 2 examples/train_gpt_ddp.py --layers 2 --hidden 64 --steps 5

``--batch`` is the global batch: every rank draws the same seeded batch each
step (``train_gpt.batch``, so a 1-process run sees the data of ``train_gpt.py``)
and trains on its own contiguous slice of ``--batch / world size`` rows. Rank 0
prints ``step N loss X``, X being the mean over the ranks (a sum all-reduce
divided by the world size) at full precision. ``--save PATH`` writes the final
parameters from rank 0 (DDP keeps them equal on every rank) as the plain
``GPT`` state dict. Nothing here knows about teraio.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from train_gpt import GPT, batch


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model, data and optimizer options of ``train_gpt.py``, with its defaults."""
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="global batch (rows per step, all ranks)")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)


def init_distributed() -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes in the environment (RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR, MASTER_PORT): (rank, world size, this rank's device)."""
    if "RANK" not in os.environ:
        raise SystemExit("run this under torchrun, e.g. torchrun --nproc-per-node 2 " + __file__)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def step_timer(on: bool) -> Callable[[float], str]:
    """With ``on``, a function of a step's start time that gives `` time_ms T`` to append to the
    step's line (``--timing``); without, one that gives nothing."""
    if not on:
        return lambda t0: ""
    return lambda t0: f" time_ms {(time.perf_counter() - t0) * 1e3:.3f}"


def local_rows(tokens: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's contiguous slice of a global batch whose size ``world`` divides."""
    rows = tokens.shape[0] // world
    return tokens[rank * rows:(rank + 1) * rows]


def global_mean(loss: torch.Tensor, world: int) -> float:
    """The mean of every rank's ``loss`` (a sum all-reduce: gloo has no average)."""
    total = loss.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return (total / world).item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0,
                   help="DDP gradient bucket size in MiB (DDP's default 25); smaller gives more "
                        "all-reduces per step")
    p.add_argument("--comm-hook", choices=["none", "fp16"], default="none",
                   help="a DDP communication hook: fp16 compresses each bucket to half precision "
                        "for its all-reduce (torch's fp16_compress_hook)")
    p.add_argument("--timing", action="store_true",
                   help="also print each step's wall time on the printing rank (time_ms, for bench/jobs.py)")
    p.add_argument("--save", help="rank 0 writes the final parameters here (torch.save of the GPT "
                                  "state dict)")
    args = p.parse_args()
    if args.hidden % args.heads:
        p.error("--hidden must be a multiple of --heads")
    rank, world, device = init_distributed()
    try:
        if args.batch % world:
            p.error(f"--batch {args.batch} must be a multiple of the world size {world}")
        torch.manual_seed(args.seed)
        gen = torch.Generator().manual_seed(args.seed)
        model = GPT(args.vocab, args.seq, args.layers, args.hidden, args.heads).to(device)
        ddp = DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
        if args.comm_hook == "fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
        took = step_timer(args.timing)
        for step in range(args.steps):
            t0 = time.perf_counter()
            tokens = local_rows(batch(gen, args.vocab, args.batch, args.seq, "cpu"), rank, world)
            tokens = tokens.to(device)
            logits = ddp(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            mean = global_mean(loss, world)
            if rank == 0:
                print(f"step {step} loss {mean!r}{took(t0)}", flush=True)
        if args.save and rank == 0:
            torch.save(model.state_dict(), args.save)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
