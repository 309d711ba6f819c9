"""Mixed precision with a loss scaler: fp16 autocast and torch.amp.GradScaler, its gradients
unscaled and clipped; a scale that starts high and grows every other step, so that the scaler
skips a step now and then (an overflow), as it does early in fp16 training."""
import argparse

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=8)
p.add_argument("--dtype", default="float16")
p.add_argument("--log-scale", type=float, default=20)
p.add_argument("--growth-interval", type=int, default=2)
p.add_argument("--save")
args = p.parse_args()
dt = getattr(torch, args.dtype)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** args.log_scale, growth_interval=args.growth_interval)
g = torch.Generator().manual_seed(1)
for step in range(args.steps):
    x, y = torch.randn(64, 128, generator=g), torch.randint(0, 10, (64,), generator=g)
    with torch.autocast("cpu", dtype=dt):
        loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    print(f"step {step} loss {loss.item()!r} scale {scaler.get_scale()!r} norm {norm.item()!r}", flush=True)
if args.save:
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict()}, args.save)
