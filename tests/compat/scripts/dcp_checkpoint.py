"""A training loop that saves the model's and optimizer's state with torch.distributed.checkpoint
(DCP, as FSDP2 jobs do) after step 3, in one process with no process group."""

import argparse

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=6)
p.add_argument("--save")
p.add_argument("--checkpoint-dir", default="dcp-checkpoints")
args = p.parse_args()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(1)
for step in range(args.steps):
    x, y = torch.randn(64, 256, generator=g), torch.randint(0, 10, (64,), generator=g)
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item()!r}", flush=True)
    if step == 3:
        dcp.save({"model": model.state_dict(), "opt": opt.state_dict()},
                 checkpoint_id=f"{args.checkpoint_dir}/step-{step}")
if args.save:
    torch.save(model.state_dict(), args.save)
