"""A two-layer MLP whose every tensor size is known by hand (used by test_tracer)."""

import torch

B, D, H = 4, 8, 16  # batch, input width, hidden width; float32 = 4 bytes
torch.manual_seed(0)
w1 = torch.nn.Parameter(torch.randn(D, H))
w2 = torch.nn.Parameter(torch.randn(H, 1))
opt = torch.optim.SGD([w1, w2], lr=0.1)
for _ in range(4):
    x = torch.randn(B, D)
    h = torch.mm(x, w1)
    a = torch.relu(h)
    y = torch.mm(a, w2)
    loss = y.sum()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    del x, h, a, y, loss
    opt.step()
