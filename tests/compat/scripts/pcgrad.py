"""Multi-task PCGrad: each task's gradient by torch.autograd.grad, projected off the others where
they conflict (a branch the data decides), summed into .grad; last step's lists live on into the
next step until it makes its own."""

import argparse

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=8)
p.add_argument("--save")
args = p.parse_args()
torch.manual_seed(0)
trunk = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU())
heads = nn.ModuleList([nn.Linear(512, 10), nn.Linear(512, 1), nn.Linear(512, 5)])
params = list(trunk.parameters()) + list(heads.parameters())
opt = torch.optim.Adam(params, lr=1e-3)
g = torch.Generator().manual_seed(1)
for step in range(args.steps):
    x = torch.randn(64, 256, generator=g)
    y0, y1 = torch.randint(0, 10, (64,), generator=g), torch.randn(64, 1, generator=g)
    y2 = torch.randint(0, 5, (64,), generator=g)
    h = trunk(x)
    losses = [nn.functional.cross_entropy(heads[0](h), y0), nn.functional.mse_loss(heads[1](h), y1),
              nn.functional.cross_entropy(heads[2](h), y2)]
    grads = []
    for i, loss in enumerate(losses):
        gs = torch.autograd.grad(loss, params, retain_graph=i < len(losses) - 1, allow_unused=True)
        grads.append(torch.cat([(gg if gg is not None else torch.zeros_like(q)).flatten()
                                for gg, q in zip(gs, params, strict=True)]))
    proj = [gr.clone() for gr in grads]
    for i in range(3):
        for j in range(3):
            if i != j:
                d = proj[i] @ grads[j]
                if d < 0:
                    proj[i] -= d / (grads[j] @ grads[j]) * grads[j]
    total, off = torch.stack(proj).sum(0), 0
    for q in params:
        n = q.numel()
        q.grad = total[off:off + n].view_as(q).clone()
        off += n
    opt.step()
    opt.zero_grad()
    print(f"step {step} loss {sum(loss.item() for loss in losses)!r}", flush=True)
if args.save:
    torch.save({"params": params, "opt": opt.state_dict()}, args.save)
