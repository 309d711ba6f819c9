"""A regression model fed numpy arrays through torch.from_numpy (storages that cannot be resized)."""

import argparse

import numpy as np
import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=6)
p.add_argument("--save")
args = p.parse_args()

torch.manual_seed(0)
rng = np.random.default_rng(0)
w_true = rng.standard_normal((128, 1)).astype(np.float32)
model = nn.Sequential(nn.Linear(128, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(args.steps):
    xb = rng.standard_normal((64, 128)).astype(np.float32)
    yb = xb @ w_true
    x, y = torch.from_numpy(xb), torch.from_numpy(yb)
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item()!r}", flush=True)
if args.save:
    torch.save(model.state_dict(), args.save)
