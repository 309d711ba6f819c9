"""The optimizer's moments handed after step 4 to a logger process through a torch.multiprocessing
queue (spawned), which sums them; and the model put in shared memory after step 5 (for an
evaluation worker or Hogwild-style training), then trained on."""

import argparse

import torch
import torch.multiprocessing as mp
from torch import nn


def logger(tensors: "mp.Queue[torch.Tensor | None]", out: "mp.Queue[str]") -> None:
    while (t := tensors.get()) is not None:
        out.put(repr(float(t.double().sum())))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--save")
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    tensors, sums = ctx.Queue(), ctx.Queue()
    worker = ctx.Process(target=logger, args=(tensors, sums))
    worker.start()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        x, y = torch.randn(64, 128, generator=g), torch.randint(0, 10, (64,), generator=g)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item()!r}", flush=True)
        if step == 4:
            moments = [opt.state[q]["exp_avg"] for q in model.parameters()]
            for m in moments:
                tensors.put(m)
            print("logged", [sums.get(timeout=120) for _ in moments], flush=True)
        if step == 5:
            model.share_memory()
            print(f"shared {all(q.is_shared() for q in model.parameters())}", flush=True)
    tensors.put(None)
    worker.join()
    if args.save:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, args.save)
