"""Fine-tuning that unfreezes a backbone layer at step 3 and gives it a param group of its own:
the first steps differ from the rest, so the script is profiled past them (``--warmup``)."""

import argparse

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=8)
p.add_argument("--save")
args = p.parse_args()
torch.manual_seed(0)
backbone = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU())
head = nn.Linear(512, 10)
backbone.requires_grad_(False)
opt = torch.optim.Adam(head.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(1)
for step in range(args.steps):
    if step == 3:
        backbone[2].requires_grad_(True)
        opt.add_param_group({"params": list(backbone[2].parameters()), "lr": 1e-4})
    x, y = torch.randn(64, 128, generator=g), torch.randint(0, 10, (64,), generator=g)
    loss = nn.functional.cross_entropy(head(backbone(x)), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item()!r}", flush=True)
if args.save:
    torch.save({"backbone": backbone.state_dict(), "head": head.state_dict(), "opt": opt.state_dict()}, args.save)
