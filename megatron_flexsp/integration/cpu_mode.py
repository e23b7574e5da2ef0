"""CPU mode: run Megatron's training loop, optimizer and schedules on CPU with gloo.

Megatron-core hard-codes CUDA in about 40 places (``device='cuda'``, ``torch.cuda.current_device()``,
``Tensor.type()`` strings, CUDA streams and events, the CUDA RNG tracker). CPU mode makes those run on
CPU, and nothing else:

1. a torch function mode that maps ``device='cuda'`` (or a CUDA device index) to CPU, makes
   ``Tensor.cuda()`` / ``pin_memory()`` no-ops and reports ``Tensor.type()`` as ``torch.cuda.*``;
2. ``torch.cuda`` stubs: one fake device (``device_count`` 1, ``current_device`` 0), no-op
   ``set_device`` / ``synchronize`` / ``empty_cache``, inert streams and events, a CPU generator
   behind ``manual_seed`` / ``get_rng_state`` / ``set_rng_state``;
3. Megatron patches (:mod:`patches.cpu`): a CPU RNG tracker in ``model_parallel_cuda_manual_seed``,
   ``initialize_megatron(allow_no_cuda=True)``, no dataset-helper compilation (the wheel ships the
   built helpers), no fused-kernel load and no JIT warm-up; ``torch.compile`` compiles a function at
   its first call, so importing Megatron does not import TorchDynamo for kernels CPU runs never call.

It is explicit (``--flexsp-cpu on``) or automatic when CUDA is absent (``auto``), and refuses to turn
on where CUDA is available, so it is never active on a GPU. :func:`disable_cpu_mode` undoes it all.
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch.overrides import TorchFunctionMode

from megatron_flexsp.utils.logging import get_logger

log = get_logger(__name__)

CPU_MODES = ("auto", "on", "off")


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaAsCpu(TorchFunctionMode):
    """Maps CUDA device requests to CPU and makes tensors look like CUDA tensors to ``type()``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = dict(kwargs, device="cpu")
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
            return args[0]
        if func is torch.Tensor.to:
            args = tuple("cpu" if i > 0 and _is_cuda(a) else a for i, a in enumerate(args))
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


class _Inert:
    """A CUDA stream or event that does nothing (CPU work is synchronous)."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *a, **k: None

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


class _State:
    mode: _CudaAsCpu | None = None
    saved: dict[str, object] = {}
    generator: torch.Generator | None = None
    patches: list = []


def _cuda_stubs(gen: torch.Generator) -> dict[str, object]:
    def manual_seed(seed: int) -> None:
        gen.manual_seed(int(seed))

    def get_rng_state(device="cuda") -> torch.Tensor:
        return gen.get_state()

    def set_rng_state(state: torch.Tensor, device="cuda") -> None:
        gen.set_state(state)

    def const(value):  # a distinct function per name (torch.compile's rules reject shared objects)
        return lambda *a, **k: value

    return {
        "device_count": const(1), "current_device": const(0), "set_device": const(None),
        "synchronize": const(None), "empty_cache": const(None), "memory_allocated": const(0),
        "max_memory_allocated": const(0), "memory_reserved": const(0),
        "max_memory_reserved": const(0), "reset_peak_memory_stats": const(None),
        "memory_stats": lambda *a, **k: {}, "Stream": _Inert, "Event": _Inert,
        "current_stream": lambda *a, **k: _Inert(), "default_stream": lambda *a, **k: _Inert(),
        "stream": lambda *a, **k: contextlib.nullcontext(), "set_stream": const(None),
        "manual_seed": manual_seed, "manual_seed_all": manual_seed, "get_rng_state": get_rng_state,
        "set_rng_state": set_rng_state, "get_device_capability": const((9, 0)),
        "get_device_name": const("cpu (megatron-flexsp CPU mode)"),
    }


def resolve_cpu_mode(choice: str) -> bool:
    """Whether CPU mode should be on for ``choice`` in :data:`CPU_MODES` (``auto``: CUDA absent)."""
    if choice not in CPU_MODES:
        raise ValueError(f"--flexsp-cpu={choice!r} must be one of {CPU_MODES}")
    if choice == "auto":
        return not torch.cuda.is_available()
    if choice == "on" and torch.cuda.is_available():
        raise ValueError("--flexsp-cpu on was requested but CUDA is available; CPU mode is never "
                         "active on a GPU machine (use --flexsp-cpu off or auto)")
    return choice == "on"


def cpu_mode_active() -> bool:
    return _State.mode is not None


def enable_cpu_mode(seed: int = 0) -> None:
    """Turn CPU mode on for this process (idempotent). Call before importing Megatron's training."""
    if _State.mode is not None:
        return
    if torch.cuda.is_available():
        raise RuntimeError("CPU mode must not be enabled where CUDA is available")
    from patches import apply
    from patches.cpu import cpu_patches

    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    gen = torch.Generator().manual_seed(seed)
    stubs = _cuda_stubs(gen)
    _State.saved = {name: getattr(torch.cuda, name, None) for name in stubs}
    for name, value in stubs.items():
        setattr(torch.cuda, name, value)
    _State.generator = gen
    _State.patches = cpu_patches()
    try:
        apply(_State.patches)
    except Exception:
        _restore_cuda()
        raise
    _State.mode = _CudaAsCpu()
    _State.mode.__enter__()
    log.info("CPU mode on: CUDA device requests run on CPU, distributed backend gloo")


def _restore_cuda() -> None:
    for name, value in _State.saved.items():
        if value is None:
            delattr(torch.cuda, name)
        else:
            setattr(torch.cuda, name, value)
    _State.saved = {}


def disable_cpu_mode() -> None:
    """Undo :func:`enable_cpu_mode` (no-op when it is off)."""
    if _State.mode is None:
        return
    from patches import revert

    _State.mode.__exit__(None, None, None)
    _State.mode = None
    revert(_State.patches)
    _State.patches = []
    _restore_cuda()
