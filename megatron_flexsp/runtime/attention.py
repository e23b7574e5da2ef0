"""Packed variable-length causal attention (documents never attend to each other).

One explicit switch, ``backend``: ``"reference"`` (plain softmax, float64 accumulation), ``"sdpa"``
(torch scaled_dot_product_attention per document), ``"sdpa-mask"`` (one call with a block-diagonal
causal mask), ``"flash"`` (flash-attn varlen, GPU) and ``"te"`` (Transformer Engine, GPU). A missing
package raises ``RuntimeError`` naming it. Inputs ``q_TnH`` and ``k_TkH``/``v_TkH`` (GQA: fewer K/V
heads, repeated to the query heads) and ``cu_seqlens`` (document boundaries, Python ints: the
kernels get them without a host-device synchronisation).
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


def _reference(q, k, v, cu, scale, max_len):
    out = torch.empty_like(q)
    for a, b in zip(cu[:-1], cu[1:]):
        qs, ks, vs = (x[a:b].transpose(0, 1).double() for x in (q, k, v))  # [n, L, H]
        s = qs @ ks.transpose(1, 2) * scale
        s = s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).triu(1), -math.inf)
        out[a:b] = (torch.softmax(s, dim=-1) @ vs).transpose(0, 1).to(q.dtype)
    return out


def _sdpa(q, k, v, cu, scale, max_len):
    outs = []
    for a, b in zip(cu[:-1], cu[1:]):
        qs, ks, vs = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, n, L, H]
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        outs.append(o.squeeze(0).transpose(0, 1))
    return torch.cat(outs)


def _sdpa_mask(q, k, v, cu, scale, max_len):
    T = q.shape[0]
    lens = torch.tensor([b - a for a, b in zip(cu[:-1], cu[1:])], device=q.device)
    doc = torch.repeat_interleave(torch.arange(len(cu) - 1, device=q.device), lens)
    pos = torch.arange(T, device=q.device)
    mask = (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    return F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale).squeeze(0).transpose(0, 1)


def _cu32(cu: tuple[int, ...], device, given: torch.Tensor | None) -> torch.Tensor:
    if given is not None and given.device == device and given.dtype == torch.int32:
        return given
    return torch.tensor(cu, dtype=torch.int32).to(device)


def _flash(q, k, v, cu, scale, max_len, cu_device=None):
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError as exc:
        raise RuntimeError("attention backend 'flash' needs flash-attn (pip install -e '.[gpu]')") from exc
    cu32 = _cu32(cu, q.device, cu_device)
    return flash_attn_varlen_func(q, k, v, cu32, cu32, max_len, max_len, softmax_scale=scale, causal=True)


@functools.lru_cache(maxsize=16)
def _te_module(n: int, H: int, n_kv: int, scale: float):
    try:
        from transformer_engine.pytorch import DotProductAttention
    except Exception as exc:  # TE raises RuntimeError, not ImportError, without a GPU
        raise RuntimeError(f"attention backend 'te' needs transformer-engine on a GPU ({exc})") from exc
    return DotProductAttention(n, H, num_gqa_groups=n_kv, attn_mask_type="padding_causal",
                               qkv_format="thd", softmax_scale=scale)


def _te(q, k, v, cu, scale, max_len, cu_device=None):
    attn = _te_module(q.shape[1], q.shape[2], k.shape[1], float(scale))
    cu32 = _cu32(cu, q.device, cu_device)
    out = attn(q, k, v, cu_seqlens_q=cu32, cu_seqlens_kv=cu32, max_seqlen_q=max_len, max_seqlen_kv=max_len)
    return out.reshape(q.shape)


_IMPL = {"reference": _reference, "sdpa": _sdpa, "sdpa-mask": _sdpa_mask, "flash": _flash, "te": _te}


def varlen_causal_attention(q_TnH: torch.Tensor, k_TkH: torch.Tensor, v_TkH: torch.Tensor,
                            cu_seqlens, *, backend: str = "sdpa", scale: float | None = None,
                            cu_device: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention inside each document of a packed batch; returns ``[T, n, H]``.

    ``cu_seqlens``: document boundaries ``[0, L_1, L_1 + L_2, ..., T]`` as Python ints (a list or
    tuple: no host-device synchronisation per call) or a 1-D integer tensor (read to the host once).
    ``cu_device``: the same boundaries as an int32 tensor on the inputs' device, for the GPU kernels
    (made once per micro-batch, e.g. by :meth:`GroupLayout.to`).
    """
    if backend not in _IMPL:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
    if q_TnH.dim() != 3 or k_TkH.shape[0] != q_TnH.shape[0] or v_TkH.shape != k_TkH.shape:
        raise ValueError(f"expected q [T, n, H] and k, v [T, n_kv, H] with equal T; got "
                         f"{tuple(q_TnH.shape)}, {tuple(k_TkH.shape)}, {tuple(v_TkH.shape)}")
    cu = tuple(int(x) for x in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens))
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != q_TnH.shape[0]:
        raise ValueError(f"cu_seqlens must run from 0 to T={q_TnH.shape[0]}, got "
                         f"{cu[0] if cu else None}..{cu[-1] if cu else None}")
    max_len = max(b - a for a, b in zip(cu[:-1], cu[1:]))
    scale = scale if scale is not None else 1.0 / math.sqrt(q_TnH.shape[-1])
    if backend in ("flash", "te"):
        return _IMPL[backend](q_TnH, k_TkH, v_TkH, cu, scale, max_len, cu_device)
    n = q_TnH.shape[1]
    return _IMPL[backend](q_TnH, _expand_kv(k_TkH, n), _expand_kv(v_TkH, n), cu, scale, max_len)


def installed_backends(cuda: bool) -> dict[str, bool]:
    """Which optional kernels can be used here: ``flash`` (flash-attn imports) and ``te``
    (Transformer Engine imports; probed only with CUDA, since without a GPU its import raises)."""
    import importlib

    found = {"flash": False, "te": False}
    if not cuda:
        return found
    for name, module in (("flash", "flash_attn"), ("te", "transformer_engine.pytorch")):
        try:
            importlib.import_module(module)
            found[name] = True
        except Exception:  # noqa: BLE001 - absent or broken: not usable either way
            found[name] = False
    return found


def choose_backend(requested: str, *, cuda: bool, dtype: torch.dtype, installed: dict[str, bool]) -> str:
    """The attention backend for ``requested`` (one of ``auto`` and :data:`BACKENDS`).

    ``auto``: flash-attn where it is installed and the dtype is fp16 or bf16 (its only inputs), else
    Transformer Engine where installed (any dtype), else SDPA; on the host always SDPA. An explicit
    choice that cannot run here raises ``ValueError`` naming what is missing.
    """
    half = dtype in (torch.float16, torch.bfloat16)
    if requested == "auto":
        if not cuda:
            return "sdpa"
        if installed.get("flash") and half:
            return "flash"
        return "te" if installed.get("te") else "sdpa"
    if requested not in BACKENDS:
        raise ValueError(f"attention backend {requested!r}: choose auto or one of {BACKENDS}")
    if requested in ("flash", "te") and not cuda:
        raise ValueError(f"attention backend {requested!r} needs a GPU; use sdpa or auto on the host")
    if requested in ("flash", "te") and not installed.get(requested):
        package = {"flash": "flash-attn", "te": "transformer-engine"}[requested]
        raise ValueError(f"attention backend {requested!r} needs {package}, which does not import here")
    if requested == "flash" and not half:
        raise ValueError(f"attention backend 'flash' takes fp16 or bf16, not {dtype}; use --bf16 or "
                         f"--fp16, or another backend")
    return requested
