"""Every rank must execute the same plan: compare a hash of it before any plan collective.

The plan arrives as a value (broadcast JSON). :func:`check_agreement` all-gathers a 56-bit hash of
that text over the world group; when any rank differs, every rank raises the same ``RuntimeError``
naming rank 0's hash and the first differing rank's, instead of entering mismatched collectives and
hanging.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist


def plan_hash(plan_json: str) -> int:
    """56-bit hash of a plan's JSON text (fits an int64 tensor)."""
    return int.from_bytes(hashlib.sha256(plan_json.encode()).digest()[:7], "big")


def check_agreement(plan_json: str, step: int, device: torch.device | str = "cpu") -> None:
    """Collective over the world group: raise on every rank unless all hold ``plan_json``."""
    mine = torch.tensor([plan_hash(plan_json)], dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    hashes = [int(h.item()) for h in every]
    bad = [r for r, h in enumerate(hashes) if h != hashes[0]]
    if bad:
        raise RuntimeError(f"step {step}: ranks disagree on the plan: rank 0 holds {hashes[0]:014x}, "
                           f"rank {bad[0]} holds {hashes[bad[0]]:014x} ({len(bad)} rank(s) differ)")
