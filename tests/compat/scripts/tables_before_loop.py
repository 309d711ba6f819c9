"""Tensors made before the loop and kept by the script, not by a module or an optimizer: a
rotary table held as a plain attribute (as reference Llama code does) and the data set itself,
indexed by the training step."""

import argparse

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=6)
p.add_argument("--save")
args = p.parse_args()
torch.manual_seed(0)


class Model(nn.Module):
    def __init__(self, seq: int = 64, dim: int = 256) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, 10)
        angles = torch.outer(torch.arange(seq, dtype=torch.float32), torch.rand(dim // 2))
        self.rotary = torch.polar(torch.ones_like(angles), angles)  # a plain attribute, not a buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = torch.view_as_real(torch.view_as_complex(h.unflatten(-1, (-1, 2))) * self.rotary).flatten(-2)
        return self.out(torch.relu(h).mean(1))


data = torch.randn(96, 64, 256)  # 6 MiB, the whole data set
labels = torch.randint(0, 10, (96,))
model = Model()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(args.steps):
    idx = torch.arange(step * 16, step * 16 + 16) % len(data)
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(data[idx]), labels[idx])
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item()!r}", flush=True)
if args.save:
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, args.save)
