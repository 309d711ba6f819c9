"""A transformers model (GPT-2, Llama, T5 or BERT; configs built in code) in a plain training loop."""

import argparse

import torch
from transformers import (
    BertConfig,
    BertForMaskedLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)


def build(arch: str) -> torch.nn.Module:
    if arch == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2,
                                          bos_token_id=0, eos_token_id=0))
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=64, bos_token_id=0, eos_token_id=0))
    if arch == "t5":
        return T5ForConditionalGeneration(T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                                   num_heads=4, decoder_start_token_id=0, pad_token_id=0,
                                                   eos_token_id=1))
    if arch == "bert":
        return BertForMaskedLM(BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                          intermediate_size=128, max_position_embeddings=64))
    raise SystemExit(f"unknown --arch {arch}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="gpt2")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save")
    args = p.parse_args()
    torch.manual_seed(0)
    model = build(args.arch)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        ids = torch.randint(2, 256, (8, 32), generator=g)
        if args.arch == "t5":
            out = model(input_ids=ids, labels=ids.flip(1))
        elif args.arch == "bert":
            masked = ids.masked_fill(torch.rand(ids.shape, generator=g) < 0.15, 1)
            out = model(input_ids=masked, labels=ids)
        else:
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step} loss {out.loss.item()!r}", flush=True)
    if args.save:
        torch.save(model.state_dict(), args.save)


if __name__ == "__main__":
    main()
