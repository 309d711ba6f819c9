"""A model wrapped in torch.compile, or compiled in place with model.compile() (--in-place); pass
--eager to train the same model without it."""

import argparse

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=6)
p.add_argument("--eager", action="store_true")
p.add_argument("--in-place", action="store_true")
p.add_argument("--save")
args = p.parse_args()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 10))
step_model = model
if args.in_place and not args.eager:
    model.compile()
elif not args.eager:
    step_model = torch.compile(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(1)
for step in range(args.steps):
    x, y = torch.randn(64, 128, generator=g), torch.randint(0, 10, (64,), generator=g)
    loss = nn.functional.cross_entropy(step_model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item()!r}", flush=True)
if args.save:
    torch.save(model.state_dict(), args.save)
