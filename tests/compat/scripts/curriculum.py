"""A curriculum: a small language model trained on sequences of 16 tokens until step --grow-at,
then of 64, so every later step's activations are 4x the profiled ones'."""

import argparse

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=8)
p.add_argument("--grow-at", type=int, default=4)
p.add_argument("--save")
args = p.parse_args()
torch.manual_seed(0)
model = nn.Sequential(nn.Embedding(100, 128), nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128), nn.GELU(),
                      nn.Linear(128, 100))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(1)
for step in range(args.steps):
    tokens = torch.randint(0, 100, (16, 65 if step >= args.grow_at else 17), generator=g)
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item()!r}", flush=True)
if args.save:
    torch.save(model.state_dict(), args.save)
