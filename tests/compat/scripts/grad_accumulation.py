"""Gradient accumulation over micro-batches, gradient clipping and an LR schedule."""

import argparse

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=6)
p.add_argument("--accumulate", type=int, default=3)
p.add_argument("--save")
args = p.parse_args()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 64))
opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=args.steps)
g = torch.Generator().manual_seed(1)
for step in range(args.steps):
    total = 0.0
    for _ in range(args.accumulate):
        x = torch.randn(32, 64, generator=g)
        loss = nn.functional.mse_loss(model(x), x.flip(1)) / args.accumulate
        loss.backward()
        total += loss.item()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    print(f"step {step} loss {total!r} norm {norm.item()!r}", flush=True)
if args.save:
    torch.save(model.state_dict(), args.save)
