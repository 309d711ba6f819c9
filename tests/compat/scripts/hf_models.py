"""transformers models (GPT-2, Llama, T5, BERT; configs built in code) in a plain training loop.

``--arch gpt2,llama,t5,bert`` trains them side by side, a step of each per step (one
profile and one run for all four: importing transformers takes 5 s a process here)."""

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


def loss(arch: str, model: torch.nn.Module, g: torch.Generator) -> torch.Tensor:
    ids = torch.randint(2, 256, (8, 32), generator=g)
    if arch == "t5":
        return model(input_ids=ids, labels=ids.flip(1)).loss
    if arch == "bert":
        masked = ids.masked_fill(torch.rand(ids.shape, generator=g) < 0.15, 1)
        return model(input_ids=masked, labels=ids).loss
    return model(input_ids=ids, labels=ids).loss


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="gpt2", help="one or more of gpt2, llama, t5, bert, comma-separated")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save")
    args = p.parse_args()
    torch.manual_seed(0)
    archs = args.arch.split(",")
    models = {arch: build(arch).train() for arch in archs}
    opts = {arch: torch.optim.AdamW(m.parameters(), lr=1e-3) for arch, m in models.items()}
    g = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        losses = []
        for arch, model in models.items():
            out = loss(arch, model, g)
            out.backward()
            opts[arch].step()
            opts[arch].zero_grad()
            losses.append(repr(out.item()))
        print(f"step {step} loss {' '.join(losses)}", flush=True)
    if args.save:
        torch.save({f"{arch}.{k}": v for arch, m in models.items() for k, v in m.state_dict().items()}, args.save)


if __name__ == "__main__":
    main()
