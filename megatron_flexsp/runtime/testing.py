"""A tiny transformer for runtime tests and benchmarks (not a training model).

One pre-norm layer (Ulysses attention + MLP) over learned token and position embeddings, so that a
distributed step with any plan can be compared with one process on the whole batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_flexsp.runtime.layout import GroupLayout, local_positions, padded_length
from megatron_flexsp.runtime.ulysses import ulysses_attention

IGNORE = -100


class ToyTransformer(torch.nn.Module):
    def __init__(self, *, vocab: int = 64, hidden: int = 32, heads: int = 4, max_len: int = 512,
                 seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.heads, self.max_len = heads, max_len
        self.tok = torch.nn.Embedding(vocab, hidden)
        self.pos = torch.nn.Embedding(max_len, hidden)
        self.ln1, self.ln2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(),
                                       torch.nn.Linear(4 * hidden, hidden))
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, tokens_t: torch.Tensor, positions_t: torch.Tensor, *, group, layout: GroupLayout,
                backend: str = "sdpa") -> torch.Tensor:
        """Logits ``[t, vocab]`` of this rank's shard of the group's packed sequences."""
        x = self.tok(tokens_t) + self.pos(positions_t.clamp(max=self.max_len - 1))
        t, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).reshape(t, 3, self.heads, h // self.heads).unbind(1)
        a = ulysses_attention(q, k, v, group=group, layout=layout, backend=backend)
        x = x + self.proj(a.reshape(t, h))
        x = x + self.mlp(self.ln2(x))
        return self.head(x)


def shifted_labels(tokens: torch.Tensor) -> torch.Tensor:
    """Next-token labels of one whole document (last position ignored)."""
    labels = torch.full_like(tokens, IGNORE)
    labels[:-1] = tokens[1:]
    return labels


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of per-token cross entropies over labelled tokens (padding and last tokens ignored)."""
    return F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")


__all__ = ["ToyTransformer", "shifted_labels", "local_positions", "token_loss_sum", "padded_length"]
