"""An LSTM or GRU language model over padded batches, packed with pack_padded_sequence (the same
lengths every step, or other ones with --vary) and unpacked with pad_packed_sequence."""

import argparse

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=6)
p.add_argument("--save")
p.add_argument("--cell", choices=["lstm", "gru"], default="lstm")
p.add_argument("--vary", action="store_true", help="other lengths every step")
args = p.parse_args()
torch.manual_seed(0)
V, E, H, T, B = 500, 64, 128, 24, 16


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, E, padding_idx=0)
        self.rnn = (nn.LSTM if args.cell == "lstm" else nn.GRU)(E, H, num_layers=2, batch_first=True)
        self.out = nn.Linear(H, V)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = pack_padded_sequence(self.emb(x), lengths, batch_first=True, enforce_sorted=False)
        y, _ = pad_packed_sequence(self.rnn(packed)[0], batch_first=True, total_length=x.shape[1])
        return self.out(y)


model = LM()
opt = torch.optim.Adam(model.parameters(), lr=2e-3)
g = torch.Generator().manual_seed(1)
lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
lengths[0] = T
for step in range(args.steps):
    if args.vary:
        lengths = torch.randint(4, T + 1, (B,), generator=g)
    x = torch.randint(1, V, (B, T + 1), generator=g) * (torch.arange(T + 1)[None, :] < lengths[:, None] + 1)
    logits = model(x[:, :-1], lengths)
    loss = nn.functional.cross_entropy(logits.reshape(-1, V), x[:, 1:].reshape(-1), ignore_index=0)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item()!r}", flush=True)
if args.save:
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, args.save)
