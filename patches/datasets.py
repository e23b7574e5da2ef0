"""``megatron.core.datasets.utils.compile_helpers``: keep the dataset helpers the wheel ships.

``initialize_megatron`` builds Megatron's C++ dataset helpers with ``make`` in the package folder.
The megatron-core wheel ships them already compiled (``helpers_cpp*.so``) and has no Makefile, so
the build fails and rank 0 exits, on a GPU as on a CPU. The patched function builds only when the
compiled module cannot be imported (a source install), otherwise it does nothing.
"""

from __future__ import annotations

import importlib.util

from patches import Patch

HELPERS = "megatron.core.datasets.helpers_cpp"


def _make(original):
    def compile_helpers(*args, **kwargs):
        if importlib.util.find_spec(HELPERS) is not None:
            return None  # shipped compiled: nothing to build
        return original(*args, **kwargs)

    return compile_helpers


def helpers_patch() -> Patch:
    """The patch object (apply with :func:`patches.apply`)."""
    return Patch("megatron.core.datasets.utils", "compile_helpers", _make)
