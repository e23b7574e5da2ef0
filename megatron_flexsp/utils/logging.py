"""Rank-aware logging: the only logger the library uses (no ``print`` in library code).

The rank is read from the launcher's environment (``RANK``) once per call, so this module works before
and without ``torch.distributed``. By default only rank 0 emits INFO; every rank emits WARNING and above.
"""

from __future__ import annotations

import logging
import os

_FORMAT = "[flexsp %(rank_tag)s%(levelname)s] %(message)s"


def _rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


class _RankFilter(logging.Filter):
    """Tags records with the rank and drops sub-WARNING records on ranks other than 0."""

    def filter(self, record: logging.LogRecord) -> bool:
        rank = _rank()
        record.rank_tag = f"rank{rank} " if rank else ""
        return rank == 0 or record.levelno >= logging.WARNING


def get_logger(name: str) -> logging.Logger:
    """Return the library logger ``name`` (a child of ``megatron_flexsp``), rank-filtered."""
    root = logging.getLogger("megatron_flexsp")
    if not getattr(root, "_flexsp_configured", False):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT))
        handler.addFilter(_RankFilter())
        root.addHandler(handler)
        root.setLevel(os.environ.get("FLEXSP_LOG_LEVEL", "INFO").upper())
        root.propagate = False
        root._flexsp_configured = True  # type: ignore[attr-defined]
    if name.startswith("megatron_flexsp"):
        return logging.getLogger(name)
    return root.getChild(name)
