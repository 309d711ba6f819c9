"""k-fold training: a fresh model and optimizer for each fold, the last fold's dropped as the
names are bound again (``--folds``, ``--steps`` per fold); with ``--criterion``, the loss is
one ``nn.CrossEntropyLoss`` module for every fold, called as a root of its own (``weighted``:
with class weights, a buffer of that module)."""

import argparse

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--folds", type=int, default=2)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--criterion", choices=["function", "module", "weighted"], default="function")
p.add_argument("--save")
args = p.parse_args()
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
criterion = {"function": nn.functional.cross_entropy, "module": nn.CrossEntropyLoss(),
             "weighted": nn.CrossEntropyLoss(weight=torch.linspace(0.5, 1.5, 10))}[args.criterion]
for fold in range(args.folds):
    model = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        x, y = torch.randn(64, 128, generator=g), torch.randint(0, 10, (64,), generator=g)
        opt.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        opt.step()
        print(f"step {fold * args.steps + step} loss {loss.item()!r}", flush=True)
if args.save:
    torch.save(model.state_dict(), args.save)
