"""torch.func.functional_call on a module skeleton kept on the meta device, with the real
weights in a dict that the optimizer steps."""

import argparse

import torch
from torch import nn
from torch.func import functional_call

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=6)
p.add_argument("--save")
args = p.parse_args()
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 10))
params = {k: v.detach().clone().requires_grad_(True) for k, v in net.named_parameters()}
skeleton = net.to("meta")
opt = torch.optim.Adam(list(params.values()), lr=1e-3)
g = torch.Generator().manual_seed(1)
for step in range(args.steps):
    x, y = torch.randn(64, 64, generator=g), torch.randint(0, 10, (64,), generator=g)
    loss = nn.functional.cross_entropy(functional_call(skeleton, params, (x,)), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item()!r}", flush=True)
if args.save:
    torch.save({"params": params, "opt": opt.state_dict()}, args.save)
