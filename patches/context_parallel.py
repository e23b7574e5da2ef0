"""Per-micro-batch context-parallel group: ``parallel_state`` getters and ``model.pg_collection.cp``.

Megatron reads the context-parallel group in two places during a forward pass: the module globals
behind ``parallel_state.get_context_parallel_group()`` / ``..._global_ranks()`` and the
``ProcessGroupCollection`` the model was built with (THD RoPE selects each rank's chunks from
``pg_collection.cp``). :class:`ContextParallelSwitch` points both at the micro-batch's group and
restores Megatron's own group afterwards. Backward never reads them: our all-to-alls keep their group
on the autograd context, and RoPE's backward is an index operation.
"""

from __future__ import annotations

_GLOBALS = ("_CONTEXT_PARALLEL_GROUP", "_CONTEXT_PARALLEL_GLOBAL_RANKS")


class ContextParallelSwitch:
    """Switches the context-parallel group of ``model_chunks`` (and of ``parallel_state``)."""

    def __init__(self, model_chunks) -> None:
        from megatron.core import parallel_state

        missing = [name for name in _GLOBALS if not hasattr(parallel_state, name)]
        if missing:
            raise RuntimeError(f"megatron.core.parallel_state lacks {missing}; this plugin was "
                               f"written for megatron-core 0.19")
        self._ps = parallel_state
        collections = {}
        for chunk in model_chunks:
            for module in chunk.modules():
                pg = getattr(module, "pg_collection", None)
                if pg is not None and hasattr(pg, "cp"):
                    collections[id(pg)] = pg
        if not collections:
            raise RuntimeError("the model has no pg_collection with a 'cp' group; FlexSP needs "
                               "megatron-core's ProcessGroupCollection (0.19)")
        self._collections = list(collections.values())
        self._saved = None

    @property
    def active(self) -> bool:
        return self._saved is not None

    def use(self, group, ranks: tuple[int, ...]) -> None:
        """Make ``group`` (over global ``ranks``) the context-parallel group until :meth:`restore`."""
        if self._saved is None:
            self._saved = ([getattr(self._ps, n) for n in _GLOBALS], [pg.cp for pg in self._collections])
        self._ps._CONTEXT_PARALLEL_GROUP = group
        self._ps._CONTEXT_PARALLEL_GLOBAL_RANKS = list(ranks)
        for pg in self._collections:
            pg.cp = group

    def restore(self) -> None:
        """Put Megatron's own context-parallel group back (no-op when not switched)."""
        if self._saved is None:
            return
        values, cps = self._saved
        for name, value in zip(_GLOBALS, values):
            setattr(self._ps, name, value)
        for pg, cp in zip(self._collections, cps):
            pg.cp = cp
        self._saved = None
