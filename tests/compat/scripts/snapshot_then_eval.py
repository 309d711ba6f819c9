"""A deep copy of the model's and the optimizer's state made at one step and kept (a snapshot to
roll back to), and an evaluation a few steps later."""
import argparse
import copy

import torch
import torch.nn.functional as F
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=10)
p.add_argument("--snapshot-at", type=int, default=3)
p.add_argument("--eval-at", type=int, nargs="*", default=[5])
p.add_argument("--what", default="both", choices=["both", "opt", "model"])
p.add_argument("--rollback-at", type=int, default=-1)
p.add_argument("--save")
args = p.parse_args()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 256))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(1)
val = torch.randn(32, 256, generator=torch.Generator().manual_seed(2))
snap = None
for step in range(args.steps):
    x = torch.randn(64, 256, generator=g)
    loss = F.mse_loss(model(x), x.flip(1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    msg = f"step {step} loss {loss.item()!r}"
    if step == args.snapshot_at:
        if args.what == "both":
            snap = (copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict()))
        elif args.what == "opt":
            snap = (copy.deepcopy(opt.state_dict()), None)
        else:
            snap = (None, copy.deepcopy(model.state_dict()))
    if step == args.rollback_at:
        opt.load_state_dict(snap[0])
        model.load_state_dict(snap[1])
    if step in args.eval_at:
        with torch.no_grad():
            msg += f" val {F.mse_loss(model(val), val.flip(1)).item()!r}"
    print(msg, flush=True)
if args.save:
    torch.save(model.state_dict(), args.save)
