"""The base encoder-decoder Transformer (Vaswani et al. 2017) on ``torch.nn.Transformer``:
shared token embeddings tied to the output projection, sinusoidal positions."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def sinusoids(length: int, width: int) -> torch.Tensor:
    """The (length, width) sinusoidal position encodings of the paper (sin on even columns)."""
    position = torch.arange(length).unsqueeze(1)
    rate = torch.exp(torch.arange(0, width, 2) * (-math.log(10000.0) / width))
    table = torch.zeros(length, width)
    table[:, 0::2] = torch.sin(position * rate)
    table[:, 1::2] = torch.cos(position * rate)
    return table


class EncoderStack(nn.Module):
    """``nn.TransformerEncoder`` with its layers built one by one: it deep-copies one layer, and
    a deep copy of a fake tensor lands in a new ``FakeTensorMode``, which then refuses to mix."""

    def __init__(self, count: int, d_model: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, heads, ffn, dropout=0.1, batch_first=True)
            for _ in range(count))
        self.norm = nn.LayerNorm(d_model)

    def forward(self, src: torch.Tensor, mask: torch.Tensor | None = None,
                src_key_padding_mask: torch.Tensor | None = None,
                is_causal: bool | None = None) -> torch.Tensor:
        for layer in self.layers:
            src = layer(src, mask, src_key_padding_mask, is_causal=bool(is_causal))
        return self.norm(src)


class DecoderStack(nn.Module):
    """``nn.TransformerDecoder`` with its layers built one by one (see ``EncoderStack``)."""

    def __init__(self, count: int, d_model: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.TransformerDecoderLayer(d_model, heads, ffn, dropout=0.1, batch_first=True)
            for _ in range(count))
        self.norm = nn.LayerNorm(d_model)

    def forward(self, tgt: torch.Tensor, memory: torch.Tensor,
                tgt_mask: torch.Tensor | None = None, memory_mask: torch.Tensor | None = None,
                tgt_key_padding_mask: torch.Tensor | None = None,
                memory_key_padding_mask: torch.Tensor | None = None,
                tgt_is_causal: bool | None = None, memory_is_causal: bool = False) -> torch.Tensor:
        for layer in self.layers:
            tgt = layer(tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask,
                        memory_key_padding_mask, tgt_is_causal=bool(tgt_is_causal),
                        memory_is_causal=memory_is_causal)
        return self.norm(tgt)


class TransformerSeq2Seq(nn.Module):
    """Transformer base (d_model 512, 8 heads, 6+6 layers, FFN 2048, dropout 0.1) scoring every
    target position over a shared vocabulary; the decoder is causally masked."""

    def __init__(self, vocab: int = 32000, d_model: int = 512, heads: int = 8, layers: int = 6,
                 ffn: int = 2048, max_len: int = 512) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.core = nn.Transformer(
            d_model, heads, dim_feedforward=ffn, batch_first=True,
            custom_encoder=EncoderStack(layers, d_model, heads, ffn),
            custom_decoder=DecoderStack(layers, d_model, heads, ffn))
        self.dropout = nn.Dropout(0.1)
        self.register_buffer("positions", sinusoids(max_len, d_model), persistent=False)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Scaled token embeddings plus positions, with dropout (the paper's input layer)."""
        x = self.embed(tokens) * math.sqrt(self.embed.embedding_dim)
        return self.dropout(x + self.positions[: tokens.shape[1]])

    def forward(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Logits (batch, target length, vocab) for token ids ``source`` and ``target``."""
        length = target.shape[1]
        causal = torch.triu(torch.full((length, length), float("-inf")), diagonal=1)
        hidden = self.core(self._embed(source), self._embed(target), tgt_mask=causal,
                           tgt_is_causal=True)
        return F.linear(hidden, self.embed.weight)
