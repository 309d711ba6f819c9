"""A language model fed batches padded to their longest sequence (dynamic padding): every
step's tensors have another length."""

import argparse

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=10)
p.add_argument("--save")
args = p.parse_args()
torch.manual_seed(0)
model = nn.Sequential(nn.Embedding(100, 64), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 100))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(1)
for step in range(args.steps):
    length = 8 + 3 * step  # the longest sequence of this batch
    ids = torch.randint(0, 100, (4, length), generator=g)
    loss = nn.functional.cross_entropy(model(ids[:, :-1]).reshape(-1, 100), ids[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item()!r}", flush=True)
if args.save:
    torch.save(model.state_dict(), args.save)
