"""Independent single-process references for the runtime tests, written without the runtime.

Nothing here imports ``megatron_flexsp``: attention is plain softmax per document in float64 (query
head ``h`` reads key/value head ``h // (heads / kv_heads)``, the grouping GQA models are trained
with), positions come from ``arange`` per document, and the toy transformer's forward is spelled out
with ``torch.nn.functional`` on its parameter tensors. A bug in a shared helper cannot cancel out.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

IGNORE = -100


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
                     ) -> torch.Tensor:
    """One document: q ``[L, n, H]``, k/v ``[L, n_kv, H]`` -> ``[L, n, H]`` (float64 inside)."""
    L, n, H = q.shape
    n_kv = k.shape[1]
    scale = 1.0 / math.sqrt(H) if scale is None else scale
    out = torch.empty(L, n, H, dtype=torch.float64)
    future = torch.ones(L, L, dtype=torch.bool).triu(1)
    for h in range(n):
        g = h // (n // n_kv)  # the key/value head of query head h
        s = (q[:, h].double() @ k[:, g].double().T) * scale
        out[:, h] = torch.softmax(s.masked_fill(future, -math.inf), dim=-1) @ v[:, g].double()
    return out.to(q.dtype)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Documents of ``lengths`` packed one after another; each attends only to itself."""
    outs, at = [], 0
    for L in lengths:
        outs.append(causal_attention(q[at:at + L], k[at:at + L], v[at:at + L]))
        at += L
    return torch.cat(outs)


def shard_rows(length: int, d: int, r: int) -> list[int]:
    """Positions of a document of ``length`` tokens that rank ``r`` of a group of ``d`` holds:
    the padded document (a multiple of 2d) is cut into 2d chunks, the rank holds chunks r and 2d-1-r."""
    padded = -(-length // (2 * d)) * 2 * d
    c = padded // (2 * d)
    return list(range(r * c, (r + 1) * c)) + list(range((2 * d - 1 - r) * c, (2 * d - r) * c))


def toy_token_losses(model, docs: list[torch.Tensor]) -> dict[tuple[int, int], torch.Tensor]:
    """Per-token next-token losses ``{(document, position): loss}`` of ``model`` (a
    ``ToyTransformer``'s parameters, its forward not used), each document alone."""
    heads = model.heads
    out = {}
    for s, tokens in enumerate(docs):
        L = len(tokens)
        x = F.embedding(tokens, model.tok.weight) + F.embedding(torch.arange(L), model.pos.weight)
        h = x.shape[1]
        y = F.layer_norm(x, (h,), model.ln1.weight, model.ln1.bias)
        q, k, v = F.linear(y, model.qkv.weight, model.qkv.bias).reshape(L, 3, heads, h // heads).unbind(1)
        a = causal_attention(q, k, v).reshape(L, h)
        x = x + F.linear(a, model.proj.weight, model.proj.bias)
        y = F.layer_norm(x, (h,), model.ln2.weight, model.ln2.bias)
        up, down = model.mlp[0], model.mlp[2]
        x = x + F.linear(F.gelu(F.linear(y, up.weight, up.bias)), down.weight, down.bias)
        logits = F.linear(x, model.head.weight, model.head.bias)
        losses = F.cross_entropy(logits[:-1], tokens[1:], reduction="none")
        for pos in range(L - 1):
            out[s, pos] = losses[pos]
    return out
