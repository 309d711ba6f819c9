"""Two trainings in one script, one after the other: the first model's state_dict is kept (views
of its weights) and the model and its optimizer dropped before the second model trains."""

import argparse

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=5, help="steps per training")
p.add_argument("--save")
args = p.parse_args()


def train(run: int) -> nn.Module:
    torch.manual_seed(run)
    model = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(100 + run)
    for step in range(args.steps):
        x, y = torch.randn(64, 128, generator=g), torch.randint(0, 10, (64,), generator=g)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        print(f"step {run * args.steps + step} loss {loss.item()!r}", flush=True)
    return model


first = train(0).state_dict()
second = train(1).state_dict()
if args.save:
    torch.save({"first": first, "second": second}, args.save)
