"""Sparse tensors: an embedding with sparse gradients trained by SparseAdam (a fixed number of
distinct ids per step, so every step's sizes are alike), beside a dense model under Adam, and a
sparse COO memory that the loss reads and that decays in place after each step."""

import argparse

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=6)
p.add_argument("--save")
args = p.parse_args()
torch.manual_seed(0)
emb = nn.Embedding(2000, 128, sparse=True)
dense = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 128), nn.ReLU(), nn.Linear(128, 10))
opt_sparse = torch.optim.SparseAdam(emb.parameters(), lr=1e-2)
opt_dense = torch.optim.Adam(dense.parameters(), lr=1e-3)
rows = torch.randperm(4096)[:512].sort().values
memory = torch.sparse_coo_tensor(rows.unsqueeze(0), torch.randn(512, 128), (4096, 128)).coalesce()
values = memory._values()  # a dense handle on the memory's bytes
g = torch.Generator().manual_seed(1)
for step in range(args.steps):
    ids = torch.randperm(2000, generator=g)[:1024].view(64, 16)
    y = torch.randint(0, 10, (64,), generator=g)
    h = emb(ids).mean(1) + values.mean(0) + torch.sparse.sum(memory, 0).to_dense() / 512
    loss = nn.functional.cross_entropy(dense(h), y)
    opt_sparse.zero_grad()
    opt_dense.zero_grad()
    loss.backward()
    opt_sparse.step()
    opt_dense.step()
    memory.mul_(0.9)
    print(f"step {step} loss {loss.item()!r}", flush=True)
if args.save:
    torch.save({"emb": emb.state_dict(), "dense": dense.state_dict(), "memory": memory,
                "opt_sparse": opt_sparse.state_dict(), "opt_dense": opt_dense.state_dict()}, args.save)
