"""The first block frozen with requires_grad_(False) at step 3; its gradients stay until the
next zero_grad sets them to None, and its parameters stay in the optimizer."""

import argparse

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=8)
p.add_argument("--save")
args = p.parse_args()
torch.manual_seed(0)
block1 = nn.Sequential(nn.Linear(128, 512), nn.ReLU())
block2 = nn.Sequential(nn.Linear(512, 512), nn.ReLU())
head = nn.Linear(512, 10)
opt = torch.optim.AdamW([*block1.parameters(), *block2.parameters(), *head.parameters()], lr=1e-3)
g = torch.Generator().manual_seed(1)
for step in range(args.steps):
    if step == 3:
        block1.requires_grad_(False)
    x, y = torch.randn(64, 128, generator=g), torch.randint(0, 10, (64,), generator=g)
    loss = nn.functional.cross_entropy(head(block2(block1(x))), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item()!r}", flush=True)
if args.save:
    torch.save({"model": [block1.state_dict(), block2.state_dict(), head.state_dict()], "opt": opt.state_dict()},
               args.save)
