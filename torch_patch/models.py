"""The built-in models of ``teraio profile --fake --model NAME``: this project's own code.

Two architectures, written plainly in PyTorch so that fake mode sees the ops a
real training step issues:

* ``Decoder``: a Llama-style decoder (RMSNorm, rotary position embeddings,
  grouped-query attention through ``scaled_dot_product_attention`` with the
  key/value heads repeated as TorchTitan's Llama does, SwiGLU feed-forward);
* ``EncoderDecoder``: a T5-style encoder-decoder (RMS layer norm without
  bias, relative position buckets shared across the layers of a stack,
  unscaled attention, ReLU feed-forward, tied and rescaled output embedding).

Dropout is left out (it changes no tensor sizes and TorchTitan trains Llama
without it). ``CONFIGS`` holds the published shapes, each with its source.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CONFIGS", "Decoder", "DecoderConfig", "EncoderDecoder", "EncoderDecoderConfig",
           "build_model", "num_parameters"]


@dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    """Shapes of a Llama-style decoder."""

    vocab_size: int
    hidden: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    """Key/value heads (grouped-query attention); ``num_heads`` for plain multi-head."""
    ffn_hidden: int
    """Inner width of the SwiGLU feed-forward."""
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    """Whether the output projection reuses the token embedding."""
    attention_bias: bool = False
    mlp_bias: bool = False
    source: str = ""


@dataclass(frozen=True, kw_only=True)
class EncoderDecoderConfig:
    """Shapes of a T5-style encoder-decoder."""

    vocab_size: int
    d_model: int
    d_ff: int
    d_kv: int
    """Width of one attention head (``num_heads * d_kv`` need not equal ``d_model``)."""
    num_heads: int
    num_layers: int
    """Encoder layers."""
    num_decoder_layers: int
    num_buckets: int = 32
    max_distance: int = 128
    norm_eps: float = 1e-6
    source: str = ""


CONFIGS: dict[str, DecoderConfig | EncoderDecoderConfig] = {
    "llama3-8b": DecoderConfig(
        vocab_size=128_256, hidden=4096, num_layers=32, num_heads=32, num_kv_heads=8,
        ffn_hidden=14_336, rope_theta=500_000.0,
        source="huggingface.co/meta-llama/Meta-Llama-3-8B config.json; Llama 3 paper "
               "(arXiv:2407.21783) Table 3",
    ),
    "llama3-70b": DecoderConfig(
        vocab_size=128_256, hidden=8192, num_layers=80, num_heads=64, num_kv_heads=8,
        ffn_hidden=28_672, rope_theta=500_000.0,
        source="huggingface.co/meta-llama/Meta-Llama-3-70B config.json; Llama 3 paper Table 3",
    ),
    "granite-8b-code-base": DecoderConfig(
        vocab_size=49_152, hidden=4096, num_layers=36, num_heads=32, num_kv_heads=8,
        ffn_hidden=14_336, rope_theta=10_000.0, tie_embeddings=True, attention_bias=True,
        mlp_bias=True,
        source="huggingface.co/ibm-granite/granite-8b-code-base config.json (LlamaForCausalLM, "
               "attention_bias, mlp_bias, tie_word_embeddings)",
    ),
    "t5-11b": EncoderDecoderConfig(
        vocab_size=32_128, d_model=1024, d_ff=65_536, d_kv=128, num_heads=128, num_layers=24,
        num_decoder_layers=24,
        source="huggingface.co/google-t5/t5-11b config.json; T5 paper (arXiv:1910.10683) "
               "Section 3.7",
    ),
}


# ---- Llama-style decoder ---------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.hidden // cfg.num_heads
        kv = self.num_kv_heads * self.head_dim
        self.wq = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.attention_bias)
        self.wk = nn.Linear(cfg.hidden, kv, bias=cfg.attention_bias)
        self.wv = nn.Linear(cfg.hidden, kv, bias=cfg.attention_bias)
        self.wo = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.attention_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # (b, t, heads, head_dim)
        q = self.wq(x).view(b, t, self.num_heads, self.head_dim)
        k = self.wk(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.wv(x).view(b, t, self.num_kv_heads, self.head_dim)
        q = q * cos + _rotate_half(q) * sin  # cos, sin: (t, 1, head_dim)
        k = k * cos + _rotate_half(k) * sin
        rep = self.num_heads // self.num_kv_heads
        if rep > 1:  # repeat the key/value heads (a copy), as TorchTitan's repeat_kv
            k = k[:, :, :, None, :].expand(b, t, self.num_kv_heads, rep, self.head_dim)
            v = v[:, :, :, None, :].expand(b, t, self.num_kv_heads, rep, self.head_dim)
            k = k.reshape(b, t, self.num_heads, self.head_dim)
            v = v.reshape(b, t, self.num_heads, self.head_dim)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, inner: int, bias: bool) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, inner, bias=bias)
        self.w2 = nn.Linear(inner, dim, bias=bias)
        self.w3 = nn.Linear(dim, inner, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class DecoderBlock(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.feed_forward = SwiGLU(cfg.hidden, cfg.ffn_hidden, cfg.mlp_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Decoder(nn.Module):
    """Llama-style decoder; ``forward(tokens (b, t) int64) -> logits (b, t, vocab)``.

    With ``layers``, ``first`` and ``last`` it is one stage of a pipeline, as TorchTitan cuts
    Llama: blocks ``layers`` (keyed by their index in the whole model, so parameter names
    are the whole model's: ``layers.40.attention.wq.weight``), the token embeddings when
    ``first`` (else the input is a hidden state (b, t, hidden)), the final norm and the
    output projection when ``last`` (else the output is the hidden state). Every stage keeps
    the rotary tables its blocks read."""

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, cfg: DecoderConfig, max_seq: int, layers: range | None = None,
                 first: bool = True, last: bool = True) -> None:
        super().__init__()
        if cfg.tie_embeddings and not (first and last):
            raise ValueError("a decoder with tied embeddings cannot be cut into pipeline stages: "
                             "its first and last stage would share one weight")
        layers = range(cfg.num_layers) if layers is None else layers
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden) if first else None
        self.layers = nn.ModuleDict({str(i): DecoderBlock(cfg) for i in layers})
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps) if last else None
        self.output = None if cfg.tie_embeddings or not last else \
            nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        head_dim = cfg.hidden // cfg.num_heads
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.outer(torch.arange(max_seq).float(), inv_freq).repeat(1, 2)
        # (max_seq, 1, head_dim): broadcast over the heads
        self.register_buffer("rope_cos", angles.cos()[:, None, :], persistent=False)
        self.register_buffer("rope_sin", angles.sin()[:, None, :], persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)
        cos, sin = self.rope_cos[:t].to(x.dtype), self.rope_sin[:t].to(x.dtype)
        for layer in self.layers.values():
            x = layer(x, cos, sin)
        if self.norm is None:
            return x
        x = self.norm(x)
        if self.output is None:
            assert self.tok_embeddings is not None  # tied: a whole model (checked in __init__)
            return F.linear(x, self.tok_embeddings.weight)
        return self.output(x)


# ---- T5-style encoder-decoder -------------------------------------------------------------


def _relative_buckets(q_len: int, k_len: int, bidirectional: bool, num_buckets: int,
                      max_distance: int, device: torch.device) -> torch.Tensor:
    """(q_len, k_len) int64: T5's log-spaced relative position buckets."""
    rel = torch.arange(k_len, device=device)[None, :] - torch.arange(q_len, device=device)[:, None]
    buckets = torch.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (rel > 0).long() * num_buckets
        rel = rel.abs()
    else:
        rel = -torch.clamp(rel, max=0)
    exact = num_buckets // 2
    large = exact + (torch.log(rel.float().clamp(min=1) / exact)
                     / math.log(max_distance / exact) * (num_buckets - exact)).long()
    large = torch.clamp(large, max=num_buckets - 1)
    return buckets + torch.where(rel < exact, rel, large)


class T5Attention(nn.Module):
    def __init__(self, cfg: EncoderDecoderConfig, has_bias: bool, bidirectional: bool) -> None:
        super().__init__()
        self.cfg, self.bidirectional = cfg, bidirectional
        inner = cfg.num_heads * cfg.d_kv
        self.q = nn.Linear(cfg.d_model, inner, bias=False)
        self.k = nn.Linear(cfg.d_model, inner, bias=False)
        self.v = nn.Linear(cfg.d_model, inner, bias=False)
        self.o = nn.Linear(inner, cfg.d_model, bias=False)
        self.relative_attention_bias = nn.Embedding(cfg.num_buckets, cfg.num_heads) if has_bias else None

    def position_bias(self, q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
        """(1, heads, q_len, k_len) additive bias (with the causal mask for a decoder)."""
        assert self.relative_attention_bias is not None
        buckets = _relative_buckets(q_len, k_len, self.bidirectional, self.cfg.num_buckets,
                                    self.cfg.max_distance, device)
        bias = self.relative_attention_bias(buckets).permute(2, 0, 1)[None]
        if not self.bidirectional:
            causal = torch.ones(q_len, k_len, dtype=torch.bool, device=device).triu(1)
            bias = bias.masked_fill(causal, float("-inf"))
        return bias

    def forward(self, x: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        b, t, _ = x.shape
        s = kv.shape[1]
        h, d = self.cfg.num_heads, self.cfg.d_kv
        q = self.q(x).view(b, t, h, d).transpose(1, 2)
        k = self.k(kv).view(b, s, h, d).transpose(1, 2)
        v = self.v(kv).view(b, s, h, d).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)  # T5: no 1/sqrt(d)
        return self.o(y.transpose(1, 2).reshape(b, t, h * d))


class T5FeedForward(nn.Module):
    def __init__(self, cfg: EncoderDecoderConfig) -> None:
        super().__init__()
        self.wi = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.wo = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(F.relu(self.wi(x)))


class T5Block(nn.Module):
    def __init__(self, cfg: EncoderDecoderConfig, first: bool, decoder: bool) -> None:
        super().__init__()
        self.self_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attention = T5Attention(cfg, has_bias=first, bidirectional=not decoder)
        self.cross_norm = RMSNorm(cfg.d_model, cfg.norm_eps) if decoder else None
        self.cross_attention = T5Attention(cfg, has_bias=False, bidirectional=True) if decoder else None
        self.ff_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.feed_forward = T5FeedForward(cfg)

    def forward(self, x: torch.Tensor, bias: torch.Tensor,
                memory: torch.Tensor | None = None) -> torch.Tensor:
        h = self.self_norm(x)
        x = x + self.self_attention(h, h, bias)
        if self.cross_attention is not None and self.cross_norm is not None and memory is not None:
            x = x + self.cross_attention(self.cross_norm(x), memory, None)
        return x + self.feed_forward(self.ff_norm(x))


def _first_attention(blocks: nn.ModuleList) -> T5Attention:
    """The self-attention of a stack's first block, which owns the relative position bias."""
    attention = blocks[0].self_attention
    assert isinstance(attention, T5Attention)
    return attention


class EncoderDecoder(nn.Module):
    """T5-style; ``forward(inputs (b, s), targets_in (b, t)) -> logits (b, t, vocab)``."""

    def __init__(self, cfg: EncoderDecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.shared = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.encoder = nn.ModuleList(T5Block(cfg, i == 0, False) for i in range(cfg.num_layers))
        self.encoder_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.decoder = nn.ModuleList(T5Block(cfg, i == 0, True) for i in range(cfg.num_decoder_layers))
        self.decoder_norm = RMSNorm(cfg.d_model, cfg.norm_eps)

    def forward(self, inputs: torch.Tensor, targets_in: torch.Tensor) -> torch.Tensor:
        x = self.shared(inputs)
        bias = _first_attention(self.encoder).position_bias(
            inputs.shape[1], inputs.shape[1], x.device).to(x.dtype)
        for block in self.encoder:
            x = block(x, bias)
        memory = self.encoder_norm(x)
        y = self.shared(targets_in)
        bias = _first_attention(self.decoder).position_bias(
            targets_in.shape[1], targets_in.shape[1], y.device).to(y.dtype)
        for block in self.decoder:
            y = block(y, bias, memory)
        y = self.decoder_norm(y) * self.cfg.d_model ** -0.5  # tied embedding, rescaled
        return F.linear(y, self.shared.weight)


def build_model(cfg: DecoderConfig | EncoderDecoderConfig, max_seq: int) -> nn.Module:
    if isinstance(cfg, DecoderConfig):
        return Decoder(cfg, max_seq)
    return EncoderDecoder(cfg)


def num_parameters(cfg: DecoderConfig | EncoderDecoderConfig) -> int:
    """The parameter count of a config, from its shapes alone (for checks)."""
    if isinstance(cfg, DecoderConfig):
        h, kv = cfg.hidden, cfg.num_kv_heads * (cfg.hidden // cfg.num_heads)
        attn = 2 * h * h + 2 * h * kv + (2 * h + 2 * kv if cfg.attention_bias else 0)
        mlp = 3 * h * cfg.ffn_hidden + (2 * cfg.ffn_hidden + h if cfg.mlp_bias else 0)
        layer = attn + mlp + 2 * h
        emb = cfg.vocab_size * h * (1 if cfg.tie_embeddings else 2)
        return cfg.num_layers * layer + emb + h
    d, inner = cfg.d_model, cfg.num_heads * cfg.d_kv
    attn = 4 * d * inner
    ff = 2 * d * cfg.d_ff
    enc = cfg.num_layers * (attn + ff + 2 * d)
    dec = cfg.num_decoder_layers * (2 * attn + ff + 3 * d)
    bias = 2 * cfg.num_buckets * cfg.num_heads
    return cfg.vocab_size * d + enc + dec + 2 * d + bias
