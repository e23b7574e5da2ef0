"""The pool of sequence-parallel process groups: created once, in the same order on every rank.

``SPGroupPool`` creates a process group for every node-aligned block a plan may use
(:func:`megatron_flexsp.topology.all_group_blocks`), runs one warm-up collective on each group this
rank belongs to (communicators are created lazily; a first use mid-step would stall), and afterwards
only looks groups up. Size-1 groups need no communicator and are represented by ``None``, unless
``singletons`` asks for real one-rank groups (Megatron's THD RoPE reads size and rank from a group).
``timeout`` bounds every collective on these groups (a peer that never arrives raises, not hangs).
The warm-up tensors live on ``device`` (default: the rank's GPU under NCCL, else the host).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from megatron_flexsp.runtime.device import comm_device
from megatron_flexsp.topology import ClusterSpec, all_group_blocks


class SPGroupPool:
    """Every candidate group of ``sizes`` on ``cluster``; collective: call on all ranks alike."""

    def __init__(self, cluster: ClusterSpec, sizes: list[int], *, warmup: bool = True,
                 device: torch.device | None = None, singletons: bool = False,
                 timeout: datetime.timedelta | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("SPGroupPool needs torch.distributed to be initialised first")
        world = dist.get_world_size()
        if world != cluster.num_gpus:
            raise ValueError(f"world size {world} differs from the cluster's num_gpus={cluster.num_gpus}")
        self.cluster = cluster
        self.rank = dist.get_rank()
        self._groups: dict[tuple[int, ...], object] = {}
        blocks = all_group_blocks(cluster, sorted(set(sizes) | ({1} if singletons else set())))
        for block in blocks:
            if len(block) == 1 and not singletons:
                self._groups[block] = None
                continue
            self._groups[block] = dist.new_group(list(block), timeout=timeout)  # every rank, same order
        if warmup:
            dev = device or comm_device()
            for block, group in self._groups.items():
                if group is not None and self.rank in block and len(block) > 1:
                    dist.all_reduce(torch.ones(1, device=dev), group=group)

    def get(self, ranks: tuple[int, ...] | list[int]):
        """The group of exactly these ranks (``None`` for one rank); ``ValueError`` if unknown."""
        key = tuple(ranks)
        if key not in self._groups:
            raise ValueError(f"no process group for ranks {list(key)[:8]} (size {len(key)}) in the "
                             f"pool; the pool holds node-aligned blocks of sizes "
                             f"{sorted({len(b) for b in self._groups})}")
        return self._groups[key]

    def __contains__(self, ranks) -> bool:
        return tuple(ranks) in self._groups
