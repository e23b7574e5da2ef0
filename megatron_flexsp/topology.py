"""Pure rank arithmetic for sequence-parallel groups (layer 0, stdlib only).

Shared by the planner (which sizes and places groups) and the runtime (which creates every group a
plan may use, once, in the same order on every rank). Group sizes are powers of two; a group of
``size <= gpus_per_node`` lies inside one node, a larger group is a run of whole nodes. Placement is
"buddy" placement: a group of size d starts at a rank that is a multiple of d.
"""

from __future__ import annotations

from dataclasses import dataclass


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class ClusterSpec:
    """``num_gpus`` GPUs in nodes of ``gpus_per_node`` (a power of two); ``num_gpus`` a multiple of it."""

    num_gpus: int
    gpus_per_node: int

    def __post_init__(self) -> None:
        if self.num_gpus <= 0:
            raise ValueError(f"num_gpus={self.num_gpus} must be positive")
        if not is_power_of_two(self.gpus_per_node):
            raise ValueError(f"gpus_per_node={self.gpus_per_node} must be a power of two")
        if self.num_gpus % self.gpus_per_node and self.num_gpus > self.gpus_per_node:
            raise ValueError(f"num_gpus={self.num_gpus} is not a multiple of "
                             f"gpus_per_node={self.gpus_per_node}")

    def is_intra_node(self, size: int) -> bool:
        """A node-aligned group of ``size`` GPUs stays inside one node."""
        return size <= self.gpus_per_node


def candidate_group_sizes(cluster: ClusterSpec, *, num_heads: int, num_kv_heads: int,
                          allow_kv_replication: bool = False, max_size: int = 0) -> list[int]:
    """Group sizes a plan may use: powers of two up to ``num_gpus`` that the model allows.

    Ulysses splits heads over the group, so the size must divide ``num_heads``; it must divide
    ``num_kv_heads`` too, unless KV heads are replicated (then the size only has to be a multiple of
    ``num_kv_heads``). Sizes that fit in a node must divide it; larger ones must be whole nodes.
    ``max_size`` (> 0) caps the size further.
    """
    sizes = []
    d = 1
    while d <= cluster.num_gpus and (max_size <= 0 or d <= max_size):
        heads_ok = num_heads % d == 0
        kv_ok = num_kv_heads % d == 0 or (allow_kv_replication and d % num_kv_heads == 0)
        node_ok = (cluster.gpus_per_node % d == 0) or (d % cluster.gpus_per_node == 0
                                                       and cluster.num_gpus % d == 0)
        if heads_ok and kv_ok and node_ok and cluster.num_gpus % d == 0:
            sizes.append(d)
        d *= 2
    return sizes


def check_group_size(size: int, cluster: ClusterSpec, *, num_heads: int, num_kv_heads: int,
                     allow_kv_replication: bool = False) -> None:
    """Raise ``ValueError`` naming the limit that makes ``size`` unusable."""
    if not is_power_of_two(size):
        raise ValueError(f"group size {size} is not a power of two")
    if size > cluster.num_gpus:
        raise ValueError(f"group size {size} exceeds num_gpus={cluster.num_gpus}")
    if num_heads % size:
        raise ValueError(f"group size {size} does not divide num_heads={num_heads} "
                         f"(Ulysses needs at least one head per GPU)")
    if num_kv_heads % size and not (allow_kv_replication and size % num_kv_heads == 0):
        raise ValueError(f"group size {size} does not divide num_kv_heads={num_kv_heads}; "
                         f"enable KV-head replication to go beyond {num_kv_heads}")


def place_groups(sizes: list[int], cluster: ClusterSpec) -> list[tuple[int, ...]]:
    """Node-aligned placement of groups of the given sizes onto ranks ``0..num_gpus-1``.

    Groups are laid out largest first, contiguously; since sizes are powers of two this puts every
    group at an offset that is a multiple of its size. Returns rank tuples in the input order.
    Raises ``ValueError`` when the sizes need more than ``num_gpus`` GPUs.
    """
    total = sum(sizes)
    if total > cluster.num_gpus:
        raise ValueError(f"groups of sizes {sorted(sizes, reverse=True)} need {total} GPUs, "
                         f"only num_gpus={cluster.num_gpus} exist")
    for s in sizes:
        if not is_power_of_two(s):
            raise ValueError(f"group size {s} is not a power of two")
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    out: list[tuple[int, ...]] = [()] * len(sizes)
    offset = 0
    for i in order:
        out[i] = tuple(range(offset, offset + sizes[i]))
        offset += sizes[i]
    return out


def is_node_aligned(ranks: tuple[int, ...] | list[int], cluster: ClusterSpec) -> bool:
    """True when ``ranks`` is a contiguous block of power-of-two size at a multiple of its size."""
    size = len(ranks)
    if not is_power_of_two(size) or list(ranks) != list(range(ranks[0], ranks[0] + size)):
        return False
    if ranks[0] % size or ranks[-1] >= cluster.num_gpus:
        return False
    if size <= cluster.gpus_per_node:
        return ranks[0] // cluster.gpus_per_node == ranks[-1] // cluster.gpus_per_node
    return size % cluster.gpus_per_node == 0


def all_group_blocks(cluster: ClusterSpec, sizes: list[int]) -> list[tuple[int, ...]]:
    """Every aligned block a plan with these sizes may use, in one fixed order (size, then offset).

    The runtime creates exactly these process groups, in this order, on every rank.
    """
    blocks = []
    for size in sorted(sizes):
        for offset in range(0, cluster.num_gpus - size + 1, size):
            blocks.append(tuple(range(offset, offset + size)))
    return blocks
