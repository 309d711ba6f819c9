"""The usual small data set: whole tensors made before the loop, a TensorDataset and a
DataLoader with no workers that indexes them at every step, shuffled."""

import argparse

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=6)
p.add_argument("--rows", type=int, default=8192)
p.add_argument("--save")
args = p.parse_args()
torch.manual_seed(0)
X, Y = torch.randn(args.rows, 256), torch.randint(0, 10, (args.rows,))
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=64, shuffle=True,
                                     generator=torch.Generator().manual_seed(1))
model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
batches = iter(loader)
for step in range(args.steps):
    x, y = next(batches)
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item()!r}", flush=True)
if args.save:
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, args.save)
