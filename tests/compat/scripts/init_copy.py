"""A copy of the initial weights, made before the loop and untouched in it (read at the end, to
say how far training moved the weights), ``--copies`` of them; ``--no-copy`` leaves it out; ``--renew-at N`` makes it
anew at step N, as a copy of the best weights so far is when the validation loss improves, by
``--make clone`` of each tensor or ``--make deepcopy`` of the state dict."""
import argparse
import copy

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=6)
p.add_argument("--no-copy", action="store_true")
p.add_argument("--copies", type=int, default=1)
p.add_argument("--renew-at", type=int, default=-1)
p.add_argument("--make", choices=["clone", "deepcopy"], default="clone")
p.add_argument("--save")
args = p.parse_args()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def copies() -> dict[str, torch.Tensor]:
    if args.make == "deepcopy":
        return {f"{k}.{i}": v for i in range(args.copies) for k, v in copy.deepcopy(model.state_dict()).items()}
    return {f"{k}.{i}": v.detach().clone() for k, v in model.state_dict().items() for i in range(args.copies)}


init = {} if args.no_copy else copies()
opt = torch.optim.SGD(model.parameters(), lr=0.05)
g = torch.Generator().manual_seed(1)
for step in range(args.steps):
    if step == args.renew_at and init:
        init = copies()
    x, y = torch.randn(64, 128, generator=g), torch.randint(0, 10, (64,), generator=g)
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item()!r}", flush=True)
if init:
    moved = sum((v - init[f"{k}.0"]).norm() ** 2 for k, v in model.state_dict().items()) ** 0.5
    print(f"distance from init {moved.item()!r}")
if args.save:
    torch.save({"model": model.state_dict(), "init": init}, args.save)
