"""Linear probing: a frozen backbone (not in the optimizer) run through a slice model[:-1], a new
nn.Sequential every step; only the last layer trains."""

import argparse

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=6)
p.add_argument("--save")
args = p.parse_args()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(128, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
model[:-1].requires_grad_(False)
opt = torch.optim.Adam(model[-1].parameters(), lr=1e-3)
g = torch.Generator().manual_seed(1)
for step in range(args.steps):
    x, y = torch.randn(64, 128, generator=g), torch.randint(0, 10, (64,), generator=g)
    opt.zero_grad()
    with torch.no_grad():
        h = model[:-1](x)
    loss = nn.functional.cross_entropy(model[-1](h), y)
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item()!r}", flush=True)
if args.save:
    torch.save(model.state_dict(), args.save)
