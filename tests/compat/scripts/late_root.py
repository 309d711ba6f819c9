"""An averaged copy of the model, updated after every step and first evaluated (called) after
step ``--eval-after``: a second root module that appears after the profiled iterations."""

import argparse
import copy

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=9)
p.add_argument("--eval-after", type=int, default=5)
p.add_argument("--save")
args = p.parse_args()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
averaged = copy.deepcopy(model)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(1)
for step in range(args.steps):
    x, y = torch.randn(64, 128, generator=g), torch.randint(0, 10, (64,), generator=g)
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    with torch.no_grad():
        for a, m in zip(averaged.parameters(), model.parameters(), strict=True):
            a.lerp_(m, 0.1)
        if step == args.eval_after:
            print(f"averaged eval {averaged(x).square().mean().item()!r}", flush=True)
    print(f"step {step} loss {loss.item()!r}", flush=True)
if args.save:
    torch.save({**model.state_dict(), **{f"averaged.{k}": v for k, v in averaged.state_dict().items()}}, args.save)
