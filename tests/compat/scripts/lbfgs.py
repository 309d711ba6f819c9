"""L-BFGS with a closure: its history (lists of the last steps' directions, rolled each step)
is optimizer state no state-dict key names one by one."""

import argparse

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=9)
p.add_argument("--save")
args = p.parse_args()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(128, 512), nn.Tanh(), nn.Linear(512, 256), nn.Tanh(), nn.Linear(256, 10))
opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3, history_size=4)
g = torch.Generator().manual_seed(1)
for step in range(args.steps):
    x, y = torch.randn(64, 128, generator=g), torch.randint(0, 10, (64,), generator=g)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)  # noqa: B023 (called within the step)
        loss.backward()
        return loss

    loss = opt.step(closure)
    print(f"step {step} loss {loss.item()!r}", flush=True)
if args.save:
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, args.save)
