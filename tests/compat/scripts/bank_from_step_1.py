"""A bank of features made at the second step and kept (as DDP rebuilds its gradient buckets at
its second step): read by every step's loss from then on and refreshed in place, a slice a step.
``--last-batch N``: every third step (2, 5, ...) has N rows, as the last batch of an epoch of 150
rows in batches of 64 (with N = 22), or of each rank's share under a DistributedSampler."""

import argparse

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=7)
p.add_argument("--save")
p.add_argument("--last-batch", type=int, default=64)
args = p.parse_args()
torch.manual_seed(0)
body = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 256))
head = nn.Linear(256, 10)
opt = torch.optim.AdamW([*body.parameters(), *head.parameters()], lr=1e-3)
g = torch.Generator().manual_seed(1)
bank = None
for step in range(args.steps):
    n = args.last_batch if step % 3 == 2 else 64
    x, y = torch.randn(n, 128, generator=g), torch.randint(0, 10, (n,), generator=g)
    if step == 1:
        bank = torch.randn(4096, 256, generator=g)  # 4 MiB
    opt.zero_grad()
    feats = body(x)
    loss = nn.functional.cross_entropy(head(feats), y)
    if bank is not None:
        loss = loss + 1e-3 * (feats @ bank.T).logsumexp(1).mean()
    loss.backward()
    opt.step()
    if bank is not None:
        with torch.no_grad():
            bank[step % 64 * 64:step % 64 * 64 + n] = feats.detach()
    print(f"step {step} loss {loss.item()!r}", flush=True)
if args.save:
    torch.save({"body": body.state_dict(), "head": head.state_dict(), "bank": bank}, args.save)
