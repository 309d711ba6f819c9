"""A layer replaced by a fresh one at step 3, with a new optimizer; the script keeps the old
layer (unnamed now: no model or optimizer holds it) until step 5."""
import argparse

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=8)
p.add_argument("--save")
args = p.parse_args()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
kept = []
g = torch.Generator().manual_seed(1)
for step in range(args.steps):
    if step == 3:
        kept.append(model[2])
        model[2] = nn.Linear(512, 512)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    if step == 5:
        kept.clear()
    x, y = torch.randn(64, 128, generator=g), torch.randint(0, 10, (64,), generator=g)
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item()!r}", flush=True)
if args.save:
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, args.save)
