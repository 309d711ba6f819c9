"""The example GPT of ``train_gpt.py`` trained fully sharded with FSDP2 (``fully_shard``).

Run it under torchrun (gloo on a CPU, nccl on CUDA):

    torchrun --nproc-per-node 2 examples/train_gpt_fsdp.py --layers 2 --hidden 64 --steps 5

Each transformer block is one FSDP unit (``fully_shard(block)``), and the root
(embeddings, final norm, head) another; every parameter is sharded on dim 0
across the ranks, and each unit all-gathers its parameters before its forward
and backward and reduce-scatters its gradients after its backward. Data and
output as in ``train_gpt_ddp.py``: ``--batch`` is the global batch, each rank
trains on its own slice, rank 0 prints the mean loss at full precision.

``--save PATH``: every rank takes part in gathering the full (unsharded)
parameters, and rank 0 writes them as the plain ``GPT`` state dict, the same
keys and shapes ``train_gpt.py --save`` writes. Nothing here knows about teraio.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from train_gpt import GPT, batch
from train_gpt_ddp import add_model_args, global_mean, init_distributed, local_rows, step_timer


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer unsharded (an all-gather per DTensor, on every rank)."""
    return {k: v.full_tensor() if isinstance(v, DTensor) else v
            for k, v in model.state_dict().items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--no-reshard-after-forward", dest="reshard", action="store_false",
                   help="keep each block's unsharded parameters from its forward to its backward "
                        "(ZeRO-2-like) instead of freeing them after the forward and gathering "
                        "them again")
    p.add_argument("--timing", action="store_true",
                   help="also print each step's wall time on the printing rank (time_ms, for bench/jobs.py)")
    p.add_argument("--save", help="rank 0 writes the full final parameters here (torch.save of the "
                                  "GPT state dict)")
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
        mesh = init_device_mesh(device.type, (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=args.reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=args.reshard)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        took = step_timer(args.timing)
        for step in range(args.steps):
            t0 = time.perf_counter()
            tokens = local_rows(batch(gen, args.vocab, args.batch, args.seq, "cpu"), rank, world)
            tokens = tokens.to(device)
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            mean = global_mean(loss, world)
            if rank == 0:
                print(f"step {step} loss {mean!r}{took(t0)}", flush=True)
        if args.save:
            state = full_state_dict(model)
            if rank == 0:
                torch.save({k: v.cpu() for k, v in state.items()}, args.save)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
