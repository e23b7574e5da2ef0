"""Environment of the worker processes that scripts start with torchrun (layer 0, stdlib only).

The project root goes in front of ``PYTHONPATH`` (the caller's entries are kept behind it), one
thread per CPU rank unless set, and the script's own worker flag.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def worker_env(flag: str | None = None, base: dict | None = None, **extra: str) -> dict[str, str]:
    """A copy of ``base`` (default: this process's environment) with ``ROOT`` prepended to
    ``PYTHONPATH``, ``OMP_NUM_THREADS=1`` unless set, ``flag=1`` when given and ``extra``."""
    env = dict(os.environ if base is None else base)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(ROOT)]
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *paths])
    env.setdefault("OMP_NUM_THREADS", "1")
    if flag:
        env[flag] = "1"
    env.update(extra)
    return env
