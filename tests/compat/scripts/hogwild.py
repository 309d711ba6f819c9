"""Hogwild: a share_memory() model trained by 2 processes (torch.multiprocessing, fork) at once,
then evaluated by the parent. Each worker's steps are its own; the updates interleave, so
workers take turns (two semaphores) to stay deterministic. The parent then trains
--steps more steps of its own on the shared model."""

import argparse

import torch
import torch.multiprocessing as mp
from torch import nn


def alternate(rank, model, sems, steps):
    torch.set_num_threads(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(10 + rank)
    for step in range(steps):
        x, y = torch.randn(64, 128, generator=g), torch.randint(0, 10, (64,), generator=g)
        sems[rank].acquire()
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        print(f"worker {rank} step {step} loss {loss.item()!r}", flush=True)
        sems[1 - rank].release()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save")
    args = p.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    model.share_memory()
    ctx = mp.get_context("fork")
    sems = [ctx.Semaphore(1), ctx.Semaphore(0)]
    procs = [ctx.Process(target=alternate, args=(r, model, sems, args.steps // 2)) for r in range(2)]
    for pr in procs:
        pr.start()
    for pr in procs:
        pr.join()
        assert pr.exitcode == 0, pr.exitcode
    # the parent's own fine-tuning steps on the shared model (these are what teraio sees)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(99)
    for step in range(args.steps):
        x, y = torch.randn(64, 128, generator=g), torch.randint(0, 10, (64,), generator=g)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item()!r}", flush=True)
    if args.save:
        torch.save(model.state_dict(), args.save)
