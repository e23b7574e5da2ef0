"""Explicit, idempotent, reversible monkey-patches of Megatron (applied only by the entry script).

Each :class:`Patch` names its target (``module`` + ``attribute``), checks that the target exists
and, optionally, that its signature has the expected parameters before replacing it, and keeps the
original so :func:`revert` restores it. Applying twice is a no-op; a missing or changed target raises
``RuntimeError`` naming the target and the installed version. The Megatron patches themselves land
with the integration (issue 4); this module is the mechanism they use.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class Patch:
    """Replace ``module.attribute`` with ``make(original)``.

    ``attribute`` may be dotted (``"Class.method"``): the last part is replaced on the object the
    earlier parts name.
    """

    module: str
    attribute: str
    make: Callable[[Any], Any]
    expect_params: tuple[str, ...] = ()
    _original: Any = field(default=None, repr=False)
    _applied: bool = field(default=False, repr=False)

    @property
    def target(self) -> str:
        return f"{self.module}.{self.attribute}"

    def _version(self) -> str:
        root = self.module.split(".")[0]
        try:
            from importlib.metadata import version

            return f"{root} {version('megatron-core' if root == 'megatron' else root)}"
        except Exception:  # noqa: BLE001 - a version is only for the message
            return f"{root} (version unknown)"

    def apply(self) -> None:
        if self._applied:
            return
        try:
            mod = importlib.import_module(self.module)
        except ImportError as exc:
            raise RuntimeError(f"patch target {self.target}: cannot import {self.module} "
                               f"({exc}); installed: {self._version()}") from exc
        owner = self._owner(mod)
        name = self.attribute.split(".")[-1]
        if owner is None or name not in vars(owner) and not hasattr(owner, name):
            raise RuntimeError(f"patch target {self.target} does not exist in {self._version()}")
        original = getattr(owner, name)
        if self.expect_params:
            try:
                params = set(inspect.signature(original).parameters)
            except (TypeError, ValueError):
                params = set()
            missing = [p for p in self.expect_params if p not in params]
            if missing:
                raise RuntimeError(f"patch target {self.target} lacks parameter(s) {missing} in "
                                   f"{self._version()}; this plugin was written against other "
                                   f"signatures")
        self._original = original
        setattr(owner, name, self.make(original))
        self._applied = True

    def _owner(self, mod):
        obj = mod
        for part in self.attribute.split(".")[:-1]:
            obj = getattr(obj, part, None)
            if obj is None:
                return None
        return obj

    def revert(self) -> None:
        if not self._applied:
            return
        owner = self._owner(importlib.import_module(self.module))
        setattr(owner, self.attribute.split(".")[-1], self._original)
        self._original, self._applied = None, False

    @property
    def applied(self) -> bool:
        return self._applied


def apply(patch_list: list[Patch]) -> None:
    """Apply ``patch_list`` in order; on failure revert the ones already applied, then raise."""
    done = []
    try:
        for p in patch_list:
            p.apply()
            done.append(p)
    except Exception:
        for p in reversed(done):
            p.revert()
        raise


def revert(patch_list: list[Patch]) -> None:
    """Revert ``patch_list`` in reverse order (no-op for patches not applied)."""
    for p in reversed(patch_list):
        p.revert()
