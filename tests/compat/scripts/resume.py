"""Resuming the usual way: the model's and the optimizer's state loaded with torch.load from
a checkpoint that an earlier run saved (``--resume``), the loaded model checked on a held-out
batch, the random states restored (``Generator.set_state`` reads its tensor with no op), then
training on."""

import argparse
import os

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=6)
p.add_argument("--resume", help="a checkpoint to start from, if it exists")
p.add_argument("--save")
args = p.parse_args()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(1)
if args.resume and os.path.exists(args.resume):
    checkpoint = torch.load(args.resume)
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["opt"])  # keeps the loaded moments as they are
    print(f"resumed state sum {int(checkpoint['gen'].sum())}", flush=True)  # read by an op, then
    with torch.no_grad():
        held_out = torch.randn(512, 128, generator=torch.Generator().manual_seed(9))
        print(f"resumed eval {model(held_out).square().mean().item()!r}", flush=True)
    g.set_state(checkpoint["gen"])
    torch.set_rng_state(checkpoint["rng"])
    del checkpoint
for step in range(args.steps):
    x, y = torch.randn(64, 128, generator=g), torch.randint(0, 10, (64,), generator=g)
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item()!r}", flush=True)
if args.save:
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "gen": g.get_state(),
                "rng": torch.get_rng_state()}, args.save)
