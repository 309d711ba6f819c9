"""An encoder and a head with an optimizer each, both stepping every iteration."""

import argparse

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=6)
p.add_argument("--save")
args = p.parse_args()
torch.manual_seed(0)
encoder = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU())
head = nn.Linear(256, 10)
opt_encoder = torch.optim.AdamW(encoder.parameters(), lr=1e-3)
opt_head = torch.optim.SGD(head.parameters(), lr=0.05, momentum=0.9)
g = torch.Generator().manual_seed(1)
for step in range(args.steps):
    x, y = torch.randn(64, 128, generator=g), torch.randint(0, 10, (64,), generator=g)
    loss = nn.functional.cross_entropy(head(encoder(x)), y)
    opt_encoder.zero_grad()
    opt_head.zero_grad()
    loss.backward()
    opt_encoder.step()
    opt_head.step()
    print(f"step {step} loss {loss.item()!r}", flush=True)
if args.save:
    torch.save({"encoder": encoder.state_dict(), "head": head.state_dict()}, args.save)
