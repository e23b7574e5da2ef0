"""Where collectives and timers run: the rank's GPU under NCCL, the host under gloo.

NCCL reduces only GPU tensors, and GPU work is asynchronous: a timer read without a synchronisation
measures the launch, not the work. Every collective tensor of this package is made on
:func:`comm_device`, and every timed span ends with :func:`synchronize`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def comm_device(group=None) -> torch.device:
    """The device a collective on ``group`` (default: the world) needs its tensors on."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def synchronize(device: torch.device | str) -> None:
    """Wait for the work queued on ``device`` (a no-op on the host)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
