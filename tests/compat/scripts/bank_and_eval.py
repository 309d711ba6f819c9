"""A feature bank made before the loop (a plain tensor no model or optimizer names), written in
place once per step and otherwise idle, and an evaluation before step --eval-at."""
import argparse

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=8)
p.add_argument("--eval-at", type=int, default=4)
p.add_argument("--save")
args = p.parse_args()
torch.manual_seed(0)
bank = torch.zeros(8192, 256)  # 8 MiB, named by nothing
model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
g = torch.Generator().manual_seed(1)
for step in range(args.steps):
    if step == args.eval_at:
        with torch.no_grad():
            print("eval", model(torch.ones(4, 256)).sum().item(), flush=True)
    x, y = torch.randn(256, 256, generator=g), torch.randint(0, 10, (256,), generator=g)
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    with torch.no_grad():
        bank[step % 32 * 256:(step % 32 + 1) * 256] = x
    opt.step()
    print(f"step {step} loss {loss.item()!r}", flush=True)
if args.save:
    torch.save({"model": model.state_dict(), "bank": bank}, args.save)
