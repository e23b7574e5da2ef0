"""The pool of sequence-parallel process groups: created once, in the same order on every rank.

``SPGroupPool`` creates a process group for every node-aligned block of devices a plan may use
(:func:`megatron_flexsp.topology.all_group_blocks`), runs one warm-up collective on each group this
rank belongs to (communicators are created lazily; a first use mid-step would stall), and afterwards
only looks groups up. Size-1 groups need no communicator and are represented by ``None``, unless
``singletons`` asks for real one-rank groups (Megatron's THD RoPE reads size and rank from a group).
``timeout`` bounds every collective on these groups (a peer that never arrives raises, not hangs).
The warm-up tensors live on ``device`` (default: the rank's GPU under NCCL, else the host).

With tensor parallelism (``tp > 1``) a plan's "ranks" are devices of ``tp`` consecutive global ranks
(Megatron's order: ``rank = device * tp + tp_rank``). Every block of devices then has one group per
TP rank -- the ranks with that TP rank on each of the block's devices -- created for every
``(block, tp rank)`` pair in one fixed order; :meth:`SPGroupPool.get` returns this rank's.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from megatron_flexsp.runtime.device import comm_device
from megatron_flexsp.topology import ClusterSpec, all_group_blocks


def global_ranks(devices: tuple[int, ...], tp: int, tp_rank: int) -> tuple[int, ...]:
    """Global ranks of TP rank ``tp_rank`` on each of ``devices`` (``device * tp + tp_rank``)."""
    return tuple(dev * tp + tp_rank for dev in devices)


class SPGroupPool:
    """Every candidate group of ``sizes`` on ``cluster`` (of devices); collective: call on all ranks
    alike."""

    def __init__(self, cluster: ClusterSpec, sizes: list[int], *, warmup: bool = True,
                 device: torch.device | None = None, singletons: bool = False,
                 timeout: datetime.timedelta | None = None, tp: int = 1) -> None:
        if not dist.is_initialized():
            raise RuntimeError("SPGroupPool needs torch.distributed to be initialised first")
        world = dist.get_world_size()
        if world != cluster.num_gpus * tp:
            raise ValueError(f"world size {world} differs from the cluster's num_gpus={cluster.num_gpus}"
                             f" devices x tp={tp}")
        self.cluster, self.tp = cluster, tp
        self.rank = dist.get_rank()
        self.device_index, self.tp_rank = divmod(self.rank, tp)
        self._groups: dict[tuple[int, ...], object] = {}
        blocks = all_group_blocks(cluster, sorted(set(sizes) | ({1} if singletons else set())))
        for block in blocks:
            for t in range(tp):
                ranks = global_ranks(block, tp, t)
                if len(block) == 1 and not singletons:
                    group = None
                else:
                    group = dist.new_group(list(ranks), timeout=timeout)  # every rank, same order
                if t == self.tp_rank:
                    self._groups[block] = group
        if warmup:
            dev = device or comm_device()
            for block, group in self._groups.items():
                if group is not None and self.device_index in block and len(block) > 1:
                    dist.all_reduce(torch.ones(1, device=dev), group=group)

    def get(self, devices: tuple[int, ...] | list[int]):
        """This rank's group over ``devices`` (``None`` for one device without singletons);
        ``ValueError`` if unknown."""
        key = tuple(devices)
        if key not in self._groups:
            raise ValueError(f"no process group for devices {list(key)[:8]} (size {len(key)}) in the "
                             f"pool; the pool holds node-aligned blocks of sizes "
                             f"{sorted({len(b) for b in self._groups})}")
        return self._groups[key]

    def global_ranks(self, devices: tuple[int, ...] | list[int]) -> tuple[int, ...]:
        """The global ranks of this rank's group over ``devices``."""
        return global_ranks(tuple(devices), self.tp, self.tp_rank)

    def __contains__(self, devices) -> bool:
        return tuple(devices) in self._groups
