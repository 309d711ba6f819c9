"""Averages of the weights: AveragedModel with get_ema_multi_avg_fn (its first update copies), and a
manual lerp_ EMA beside it, both evaluated every 3 steps."""

import argparse
import copy

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=6)
p.add_argument("--save")
p.add_argument("--eval-every", type=int, default=3)
args = p.parse_args()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999))
ema2 = copy.deepcopy(model).requires_grad_(False)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(1)
xv, yv = torch.randn(256, 128, generator=g), torch.randint(0, 10, (256,), generator=g)
for step in range(args.steps):
    x, y = torch.randn(64, 128, generator=g), torch.randint(0, 10, (64,), generator=g)
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    ema.update_parameters(model)
    with torch.no_grad():
        for ep, mp in zip(ema2.parameters(), model.parameters(), strict=True):
            ep.lerp_(mp, 0.001)
    print(f"step {step} loss {loss.item()!r}", flush=True)
    if (step + 1) % args.eval_every == 0:
        ema.eval()
        with torch.no_grad():
            vl = nn.functional.cross_entropy(ema(xv), yv).item()
            vl2 = nn.functional.cross_entropy(ema2(xv), yv).item()
        print(f"eval {step} {vl!r} {vl2!r}", flush=True)
if args.save:
    torch.save({"model": model.state_dict(), "ema": ema.state_dict(), "ema2": ema2.state_dict(),
                "opt": opt.state_dict()}, args.save)
