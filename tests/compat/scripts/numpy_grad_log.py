"""A log line each step reads a gradient through ``.numpy()`` between backward and the step
(PyTorch then keeps that storage from being resized)."""

import argparse

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=6)
p.add_argument("--save")
args = p.parse_args()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(1)
for step in range(args.steps):
    x, y = torch.randn(64, 128, generator=g), torch.randint(0, 10, (64,), generator=g)
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    largest = float(abs(model[2].weight.grad.numpy()).max())
    opt.step()
    print(f"step {step} loss {loss.item()!r} largest gradient {largest!r}", flush=True)
if args.save:
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, args.save)
