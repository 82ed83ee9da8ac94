"""LSTMs unrolled one time step at a time in Python, as DTR's prototype runs them (cuDNN off):
every step's gates are separate tensors a rematerializer can free, on any device."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class UnrolledLSTM(nn.Module):
    """One LSTM layer with ``nn.LSTM``'s parameters and gate order (i, f, g, o), stepped in a
    Python loop; ``reverse`` runs it from the last step to the first."""

    def __init__(self, input_size: int, hidden_size: int, reverse: bool = False) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.reverse = reverse
        self.weight_ih = nn.Parameter(torch.empty(4 * hidden_size, input_size))
        self.weight_hh = nn.Parameter(torch.empty(4 * hidden_size, hidden_size))
        self.bias_ih = nn.Parameter(torch.empty(4 * hidden_size))
        self.bias_hh = nn.Parameter(torch.empty(4 * hidden_size))
        bound = 1 / math.sqrt(hidden_size)
        for p in self.parameters():
            nn.init.uniform_(p, -bound, bound)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The hidden state after each step of ``x`` (batch, time, features), in time order."""
        batch, steps = x.shape[0], x.shape[1]
        projected = F.linear(x, self.weight_ih, self.bias_ih)  # the input part, all steps at once
        h = torch.zeros(batch, self.hidden_size)
        c = torch.zeros(batch, self.hidden_size)
        hidden = []
        order = range(steps - 1, -1, -1) if self.reverse else range(steps)
        for t in order:
            gates = projected[:, t] + F.linear(h, self.weight_hh, self.bias_hh)
            i, f, g, o = gates.chunk(4, 1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            hidden.append(h)
        return hidden[::-1] if self.reverse else hidden


class BiLSTMClassifier(nn.Module):
    """Bidirectional LSTM over a sequence of feature vectors; a linear layer classifies the
    concatenated final states of the two directions (Coop's BiLSTM: input 100, hidden 256)."""

    def __init__(self, input_size: int = 100, hidden_size: int = 256, classes: int = 2) -> None:
        super().__init__()
        self.forward_lstm = UnrolledLSTM(input_size, hidden_size)
        self.backward_lstm = UnrolledLSTM(input_size, hidden_size, reverse=True)
        self.classifier = nn.Linear(2 * hidden_size, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        last = torch.cat([self.forward_lstm(x)[-1], self.backward_lstm(x)[0]], 1)
        return self.classifier(last)


class LSTMLanguageModel(nn.Module):
    """Word-level language model: embedding, one unrolled LSTM layer, and a linear decoder
    scoring the next token at every position."""

    def __init__(self, vocab: int, embedding: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embedding)
        self.lstm = UnrolledLSTM(embedding, hidden)
        self.decoder = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token logits (batch, time, vocab) for ``tokens`` (batch, time)."""
        return self.decoder(torch.stack(self.lstm(self.embed(tokens)), 1))
