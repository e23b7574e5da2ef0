"""Packed variable-length causal attention (documents never attend to each other).

One explicit switch, ``backend``: ``"reference"`` (plain softmax, float64 accumulation), ``"sdpa"``
(torch scaled_dot_product_attention per document), ``"sdpa-mask"`` (one call with a block-diagonal
causal mask), ``"flash"`` (flash-attn varlen, GPU) and ``"te"`` (Transformer Engine, GPU). A missing
package raises ``RuntimeError`` naming it. Inputs ``q_TnH`` and ``k_TkH``/``v_TkH`` (GQA: fewer K/V
heads, repeated to the query heads) and ``cu_seqlens`` (int64, document boundaries).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

BACKENDS = ("reference", "sdpa", "sdpa-mask", "flash", "te")


def _expand_kv(k: torch.Tensor, n_q: int) -> torch.Tensor:
    n_kv = k.shape[1]
    if n_q % n_kv:
        raise ValueError(f"{n_q} query heads are not a multiple of {n_kv} key/value heads")
    return k if n_kv == n_q else k.repeat_interleave(n_q // n_kv, dim=1)


def _reference(q, k, v, cu, scale):
    out = torch.empty_like(q)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (x[a:b].transpose(0, 1).double() for x in (q, k, v))  # [n, L, H]
        s = qs @ ks.transpose(1, 2) * scale
        s = s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).triu(1), -math.inf)
        out[a:b] = (torch.softmax(s, dim=-1) @ vs).transpose(0, 1).to(q.dtype)
    return out


def _sdpa(q, k, v, cu, scale):
    outs = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, n, L, H]
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        outs.append(o.squeeze(0).transpose(0, 1))
    return torch.cat(outs)


def _sdpa_mask(q, k, v, cu, scale):
    T = q.shape[0]
    doc = torch.repeat_interleave(torch.arange(len(cu) - 1, device=q.device), cu[1:] - cu[:-1])
    pos = torch.arange(T, device=q.device)
    mask = (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    return F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale).squeeze(0).transpose(0, 1)


def _flash(q, k, v, cu, scale):
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError as exc:
        raise RuntimeError("attention backend 'flash' needs flash-attn (pip install -e '.[gpu]')") from exc
    cu32 = cu.to(torch.int32)
    max_len = int((cu[1:] - cu[:-1]).max())
    return flash_attn_varlen_func(q, k, v, cu32, cu32, max_len, max_len, softmax_scale=scale, causal=True)


@functools.lru_cache(maxsize=16)
def _te_module(n: int, H: int, n_kv: int, scale: float):
    try:
        from transformer_engine.pytorch import DotProductAttention
    except Exception as exc:  # TE raises RuntimeError, not ImportError, without a GPU
        raise RuntimeError(f"attention backend 'te' needs transformer-engine on a GPU ({exc})") from exc
    return DotProductAttention(n, H, num_gqa_groups=n_kv, attn_mask_type="padding_causal",
                               qkv_format="thd", softmax_scale=scale)


def _te(q, k, v, cu, scale):
    attn = _te_module(q.shape[1], q.shape[2], k.shape[1], float(scale))
    cu32 = cu.to(torch.int32)
    max_len = int((cu[1:] - cu[:-1]).max())
    out = attn(q, k, v, cu_seqlens_q=cu32, cu_seqlens_kv=cu32, max_seqlen_q=max_len, max_seqlen_kv=max_len)
    return out.reshape(q.shape)


_IMPL = {"reference": _reference, "sdpa": _sdpa, "sdpa-mask": _sdpa_mask, "flash": _flash, "te": _te}


def varlen_causal_attention(q_TnH: torch.Tensor, k_TkH: torch.Tensor, v_TkH: torch.Tensor,
                            cu_seqlens: torch.Tensor, *, backend: str = "sdpa",
                            scale: float | None = None) -> torch.Tensor:
    """Causal attention inside each document of a packed batch; returns ``[T, n, H]``."""
    if backend not in _IMPL:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
    if q_TnH.dim() != 3 or k_TkH.shape[0] != q_TnH.shape[0] or v_TkH.shape != k_TkH.shape:
        raise ValueError(f"expected q [T, n, H] and k, v [T, n_kv, H] with equal T; got "
                         f"{tuple(q_TnH.shape)}, {tuple(k_TkH.shape)}, {tuple(v_TkH.shape)}")
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != q_TnH.shape[0]:
        raise ValueError(f"cu_seqlens must run from 0 to T={q_TnH.shape[0]}, got "
                         f"{int(cu_seqlens[0])}..{int(cu_seqlens[-1])}")
    scale = scale if scale is not None else 1.0 / math.sqrt(q_TnH.shape[-1])
    if backend in ("flash", "te"):
        return _IMPL[backend](q_TnH, k_TkH, v_TkH, cu_seqlens, scale)
    n = q_TnH.shape[1]
    return _IMPL[backend](q_TnH, _expand_kv(k_TkH, n), _expand_kv(v_TkH, n), cu_seqlens, scale)
