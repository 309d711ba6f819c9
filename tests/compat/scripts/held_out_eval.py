"""A held-out set made before the loop (4 MiB of plain tensors), evaluated under no_grad after
step --eval-after; every iteration after the evaluation follows the plan."""
import argparse

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=8)
p.add_argument("--eval-after", type=int, default=3)
p.add_argument("--save")
args = p.parse_args()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(128, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(1)
held_out = torch.randn(8192, 128, generator=g), torch.randint(0, 10, (8192,), generator=g)
for step in range(args.steps):
    x, y = torch.randn(64, 128, generator=g), torch.randint(0, 10, (64,), generator=g)
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item()!r}", flush=True)
    if step == args.eval_after:
        with torch.no_grad():
            acc = sum((model(held_out[0][i:i + 1024]).argmax(1) == held_out[1][i:i + 1024]).sum().item()
                      for i in range(0, 8192, 1024))
        print(f"eval {step} acc {acc}", flush=True)
if args.save:
    torch.save(model.state_dict(), args.save)
