"""Long-lived DLPack aliases of the weights, read every step: numpy arrays (``np.from_dlpack``)
whose sums are logged and saved, or torch tensors (``torch.from_dlpack``, a storage object of
their own over the same memory) in a penalty on the first layer."""

import argparse

import numpy as np
import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=6)
p.add_argument("--via", default="numpy", choices=["numpy", "torch"])
p.add_argument("--save")
args = p.parse_args()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
from_dlpack = np.from_dlpack if args.via == "numpy" else torch.from_dlpack
aliases = [from_dlpack(prm.detach()) for prm in model.parameters()]
g = torch.Generator().manual_seed(1)
sums = []
for step in range(args.steps):
    x, y = torch.randn(64, 64, generator=g), torch.randint(0, 10, (64,), generator=g)
    sums.append([float(np.sum(np.asarray(a), dtype=np.float64)) for a in aliases])
    loss = nn.functional.cross_entropy(model(x), y)
    if args.via == "torch":
        loss = loss + 1e-3 * (model[0].weight * aliases[0]).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item()!r}", flush=True)
if args.save:
    torch.save({"model": model.state_dict(), "sums": torch.tensor(sums, dtype=torch.float64)}, args.save)
