"""Measurements for the cost model: a model-shaped layer stack, compute, all-to-all and activation memory.

Collective helpers: every rank of the job calls them together, so ranks contend for the machine as
they do in training. Times (ms) are medians over repeats of the median over groups of each group's
slowest rank. No Megatron import; the fitting lives in :mod:`megatron_flexsp.cost_model.calibrate`.
"""

from __future__ import annotations

import os
import statistics
import time
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_flexsp.model_spec import ModelSpec
from megatron_flexsp.runtime.dispatch import dispatch
from megatron_flexsp.runtime.layout import GroupLayout, build_group_layout, local_positions
from megatron_flexsp.runtime.ulysses import ulysses_attention


class _Layer(torch.nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, hd = spec.hidden_size, spec.head_dim
        self.n, self.k, self.hd = spec.num_heads, spec.num_kv_heads, hd
        self.norm1 = torch.nn.RMSNorm(h)
        self.norm2 = torch.nn.RMSNorm(h)
        self.qkv = torch.nn.Linear(h, (self.n + 2 * self.k) * hd, bias=False)
        self.proj = torch.nn.Linear(self.n * hd, h, bias=False)
        ffn = spec.ffn_hidden_size
        self.swiglu = spec.swiglu
        self.up = torch.nn.Linear(h, 2 * ffn if spec.swiglu else ffn, bias=False)
        self.down = torch.nn.Linear(ffn, h, bias=False)

    def forward(self, x, group, layout, backend):
        t = x.shape[0]
        qkv = self.qkv(self.norm1(x))
        q, k, v = qkv.split([self.n * self.hd, self.k * self.hd, self.k * self.hd], dim=-1)
        a = ulysses_attention(q.reshape(t, self.n, self.hd), k.reshape(t, self.k, self.hd),
                              v.reshape(t, self.k, self.hd), group=group, layout=layout, backend=backend)
        x = x + self.proj(a.reshape(t, -1))
        u = self.up(self.norm2(x))
        if self.swiglu:
            g, u = u.chunk(2, dim=-1)
            u = F.silu(g) * u
        else:
            u = F.gelu(u)
        return x + self.down(u)


class SpecStack(torch.nn.Module):
    """Embedding, ``spec.num_layers`` pre-norm layers (Ulysses attention + MLP) and the output layer
    of the shape ``spec`` describes; used to profile and validate the cost model, not to train."""

    def __init__(self, spec: ModelSpec, *, max_len: int = 1 << 20) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = torch.nn.ModuleList(_Layer(spec) for _ in range(spec.num_layers))
        self.out = torch.nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)

    def forward(self, tokens_t, *, group, layout: GroupLayout, backend: str) -> torch.Tensor:
        x = self.emb(tokens_t)
        for layer in self.layers:
            x = layer(x, group, layout, backend)
        return self.out(x)


def step_loss(model: SpecStack, tokens_t: torch.Tensor, *, group, layout: GroupLayout,
              backend: str) -> torch.Tensor:
    """Forward and backward of this rank's shard ``tokens_t`` ``[t]``; returns the detached loss sum."""
    logits = model(tokens_t, group=group, layout=layout, backend=backend)
    loss = F.cross_entropy(logits.float(), torch.roll(tokens_t, -1), reduction="sum")
    loss.backward()
    return loss.detach()


def init_job() -> tuple[torch.device, int, int]:
    """Join the torchrun job: NCCL with one GPU per rank when this node has a GPU for every local
    rank, else gloo on the host (one thread per rank; e.g. 4 ranks on a 1-GPU machine). Returns
    this rank's device, its rank and the world size."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= local_ranks
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    if not cuda:
        torch.set_num_threads(1)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return device, dist.get_rank(), dist.get_world_size()


def lengths_that_fit(lengths: list[int], group_size: int, capacity_tokens: int) -> list[int]:
    """The profiling lengths a group of ``group_size`` can hold, ``capacity_tokens`` per rank
    (activations of one sequence are spread over the group)."""
    return [s for s in lengths if s <= capacity_tokens * group_size]


def device_capacity_tokens(model: torch.nn.Module, act_bytes_per_token: float, device: torch.device,
                           reserve: float = 0.1) -> int:
    """Tokens of activations one rank can hold next to ``model``'s parameters, gradients and Adam
    states (16 bytes per parameter) on ``device``, keeping ``reserve`` of the memory free; on the
    host there is no limit to find (a very large number)."""
    if device.type != "cuda":
        return 1 << 40
    total = torch.cuda.get_device_properties(device).total_memory
    states = 16 * sum(p.numel() for p in model.parameters())
    free = (1 - reserve) * total - states
    return max(int(free // max(act_bytes_per_token, 1.0)), 0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _group_ms(seconds: float, group) -> float:
    """Median over the job's groups of each group's slowest rank (ms); collective on every rank."""
    nccl = dist.get_backend() == "nccl"  # NCCL reduces only GPU tensors
    t = torch.tensor([seconds * 1e3], dtype=torch.float64,
                     device=torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    every = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(every, t)
    return statistics.median(float(x.item()) for x in every)


def _median_ms(run, *, repeats: int, group, device: torch.device) -> float:
    """Median over ``repeats`` timed calls of ``run()`` (after one warm-up call) of the job's
    median group time (:func:`_group_ms`), in ms; collective on every rank."""
    samples = []
    for rep in range(repeats + 1):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        run()
        _sync(device)
        ms = _group_ms(time.perf_counter() - t0, group)
        if rep:  # the first run warms up
            samples.append(ms)
    return statistics.median(samples)


def time_sequences(model: SpecStack, lengths: list[int], *, group, repeats: int, backend: str,
                   device: torch.device, vocab: int, progress=None) -> list[float]:
    """Forward+backward time (ms) of one sequence of each length on ``group`` (each rank its shard)."""
    d = dist.get_world_size(group)
    r = dist.get_rank(group)
    out = []
    for k, s in enumerate(lengths):
        layout = build_group_layout([s], d)
        gen = torch.Generator().manual_seed(s)
        tokens = torch.randint(0, vocab, (len(local_positions([s], d, r)),), generator=gen).to(device)
        out.append(_median_ms(lambda: step_loss(model, tokens, group=group, layout=layout, backend=backend),
                              repeats=repeats, group=group, device=device))
        model.zero_grad(set_to_none=True)
        if progress:
            progress(f"compute {k + 1}/{len(lengths)}: {s} tokens, {out[-1]:.2f} ms")
    return out


def time_alltoall(group, nbytes: list[int], *, repeats: int, device: torch.device,
                  progress=None) -> list[float]:
    """Time (ms) of one all-to-all on ``group`` sending ``b`` bytes per rank, for each ``b``."""
    d = dist.get_world_size(group)
    out = []
    for b in nbytes:
        n = max(d, (b // 4) // d * d)
        x = torch.ones(n, dtype=torch.float32, device=device)
        y = torch.empty_like(x)
        out.append(_median_ms(lambda: dist.all_to_all_single(y, x, group=group), repeats=repeats,
                              group=group, device=device))
        if progress:
            progress(f"all-to-all size {d}: {b} bytes, {out[-1]:.3f} ms")
    return out


def time_allreduce(group, nbytes: list[int], *, repeats: int, device: torch.device,
                   progress=None) -> list[float]:
    """Time (ms) of one all-reduce on ``group`` of a ``b``-byte tensor, for each ``b`` (the collective
    tensor parallelism runs per layer; a ring sends ``2 (t-1)/t b`` bytes per rank)."""
    t = dist.get_world_size(group)
    out = []
    for b in nbytes:
        x = torch.ones(max(1, b // 4), dtype=torch.float32, device=device)
        out.append(_median_ms(lambda: dist.all_reduce(x, group=group), repeats=repeats, group=group,
                              device=device))
        if progress:
            progress(f"all-reduce size {t}: {b} bytes, {out[-1]:.3f} ms")
    return out


class SavedTensorMeter:
    """Context manager measuring the tensors autograd saves for backward (activations).

    Parameters' storages (``params``) are not counted, nor a storage twice. ``bytes``: all saved
    bytes; ``peak``: the most saved bytes alive at once (a tensor stops counting when nothing holds
    it, e.g. after its backward), so activations recomputed in backward (``--recompute-*``) are not
    counted twice. :meth:`micro_batch` starts a new micro-batch of ``tokens`` tokens and
    :attr:`peak_per_token` is the largest peak of a micro-batch over its tokens. Works for any model,
    Megatron's included.
    """

    def __init__(self, params) -> None:
        self._params = {p.untyped_storage().data_ptr() for p in params}
        self._seen: set[int] = set()
        self._refs: dict[int, int] = {}
        self._size: dict[int, int] = {}
        self.bytes = 0
        self.live = 0
        self.peak = 0
        self._mb_peak = 0
        self._mb_tokens = 0
        self.peak_per_token = 0.0
        self._ctx = None

    def _pack(self, t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr in self._params:
            return t
        if ptr not in self._seen:
            self._seen.add(ptr)
            self.bytes += t.untyped_storage().nbytes()
        if not self._refs.get(ptr):
            self._size[ptr] = t.untyped_storage().nbytes()
            self.live += self._size[ptr]
            self.peak = max(self.peak, self.live)
            self._mb_peak = max(self._mb_peak, self.live)
        self._refs[ptr] = self._refs.get(ptr, 0) + 1
        weakref.finalize(t, self._release, ptr)
        return t

    def _release(self, ptr: int) -> None:
        self._refs[ptr] -= 1
        if not self._refs[ptr]:
            self.live -= self._size.pop(ptr)

    def micro_batch(self, tokens: int) -> None:
        """Close the current micro-batch (if any) and start one holding ``tokens`` tokens."""
        if self._mb_tokens:
            self.peak_per_token = max(self.peak_per_token, self._mb_peak / self._mb_tokens)
        self._mb_tokens, self._mb_peak = tokens, self.live

    def __enter__(self) -> "SavedTensorMeter":
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)
        self.micro_batch(0)


def activation_bytes_per_token(model: SpecStack, length: int, *, group, backend: str,
                               device: torch.device, vocab: int) -> float:
    """Bytes of tensors autograd saves for backward in one forward of ``length`` tokens, per token
    held by this rank (the cost model's ``activation_bytes_per_token``)."""
    d = dist.get_world_size(group)
    layout = build_group_layout([length], d)
    local = len(local_positions([length], d, dist.get_rank(group)))
    tokens = torch.randint(0, vocab, (local,)).to(device)
    with SavedTensorMeter(model.parameters()) as meter:  # backward saves nothing more
        step_loss(model, tokens, group=group, layout=layout, backend=backend)
    model.zero_grad(set_to_none=True)
    return meter.peak / local


def time_dispatch(lengths: list[int], *, repeats: int, device: torch.device, progress=None) -> list[float]:
    """Time (ms) of the runtime's token dispatch for one micro-batch in which every rank receives one
    sequence of ``L`` tokens that another rank loaded, for each ``L`` (a per-micro-batch cost the
    cost model charges as part of each group's fixed cost and per-token rate)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    out = []
    for length in lengths:
        groups = [((r,), ((r + 1) % world,)) for r in range(world)]  # sequence s lives on rank s
        loaded = {rank: torch.zeros(length, dtype=torch.int64)}
        out.append(_median_ms(lambda: dispatch(groups, [length] * world, loaded, device=device),
                              repeats=repeats, group=None, device=device))
        if progress:
            progress(f"dispatch: {length} tokens per rank, {out[-1]:.2f} ms")
    return out
