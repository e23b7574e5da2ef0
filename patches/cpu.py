"""Megatron patches for CPU mode (applied only by :mod:`megatron_flexsp.integration.cpu_mode`).

- ``model_parallel_cuda_manual_seed``: installs :class:`CpuRNGStatesTracker` (same named states and
  seeds as Megatron's, held as CPU generator states) instead of asserting on CUDA.
- ``megatron.training.training.initialize_megatron``: called with ``allow_no_cuda=True``.
- ``megatron.training.initialize._warmup_jit_function``: no-op (19 s on CPU, and it draws from the
  RNG: compared runs must agree on skipping it, and CPU mode always skips it).
- ``get_device_arch_version`` (where argument validation and training read it): 9, Hopper's rules,
  so that tensor parallelism's validation (``CUDA_DEVICE_MAX_CONNECTIONS=1``) runs without a GPU.
- ``megatron.core.tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``: the CPU
  generator behind CPU mode's ``torch.cuda`` RNG stubs (activation recomputation saves and restores
  RNG states).
- ``torch.compile`` (applied first, before Megatron is imported): a function is compiled at its
  first call instead of where it is decorated. Megatron decorates about 40 fusion kernels with
  ``torch.compile`` at import (``megatron.core.jit.jit_fuser``), which imports TorchDynamo and
  Inductor (7-8 s of a 15 s ``import megatron.training`` per rank on a 2-core EPYC) for kernels the
  CPU model never calls; compilation itself already waited for the first call, so what runs is
  unchanged. Modules (``torch.compile(model)``) are compiled at once, as before.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from patches import Patch


def _cpu_tracker_class():
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    class CpuRNGStatesTracker(CudaRNGStatesTracker):
        """Megatron's RNG tracker with CPU generator states: ``fork`` swaps torch's CPU RNG."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(int(seed)).get_state()

        @contextlib.contextmanager
        def fork(self, name="model-parallel-rng"):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    return CpuRNGStatesTracker


def _make_seed(original):
    def model_parallel_cuda_manual_seed(seed, te_rng_tracker=False, inference_rng_tracker=False,
                                        use_cudagraphable_rng=False, tp_rank=None, ep_rank=None,
                                        etp_rank=None, force_reset_rng=False):
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import random as rnd

        tp_rank = ps.get_tensor_model_parallel_rank() if tp_rank is None else tp_rank
        ep_rank = ps.get_expert_model_parallel_rank() if ep_rank is None else ep_rank
        etp_rank = ps.get_expert_tensor_parallel_rank() if etp_rank is None else etp_rank
        tracker = _cpu_tracker_class()()
        rnd._CUDA_RNG_STATE_TRACKER = tracker
        rnd._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
        torch.cuda.manual_seed(seed)
        tracker.add(rnd._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
        tracker.add(rnd._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
        tracker.add(rnd._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + (etp_rank or 0))

    return model_parallel_cuda_manual_seed


def _make_init(original):
    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    return initialize_megatron


def _make_noop(original):
    def noop(*args, **kwargs):
        return None

    return noop


def _make_arch(original):
    def get_device_arch_version():
        return 9

    return get_device_arch_version


def _make_get_rng(original):
    def _get_cuda_rng_state(device="cuda", clone=False, graph_safe=False):
        state = torch.cuda.get_rng_state()
        return state.clone() if clone else state

    return _get_cuda_rng_state


def _make_set_rng(original):
    def _set_cuda_rng_state(new_state, device=-1, graph_safe=False):
        torch.cuda.set_rng_state(new_state)

    return _set_cuda_rng_state


def _make_lazy_compile(original):
    def compile(model=None, **options):  # noqa: A001 - stands in for torch.compile
        if model is None:  # ``@torch.compile(...)``: options first, the function next
            return lambda fn: compile(fn, **options)
        if isinstance(model, torch.nn.Module) or not callable(model):
            return original(model, **options)
        compiled = None

        @functools.wraps(model)
        def first_call_compiles(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = original(model, **options)
            return compiled(*args, **kwargs)

        return first_call_compiles
    return compile


_SEED_PARAMS = ("seed", "tp_rank", "ep_rank", "etp_rank")


def cpu_patches() -> list[Patch]:
    """Fresh patch objects for CPU mode (apply with :func:`patches.apply`)."""
    return [
        Patch("torch", "compile", _make_lazy_compile, expect_params=("model", "fullgraph", "backend")),
        Patch("megatron.core.tensor_parallel.random", "model_parallel_cuda_manual_seed", _make_seed,
              expect_params=_SEED_PARAMS),
        Patch("megatron.core.tensor_parallel", "model_parallel_cuda_manual_seed", _make_seed,
              expect_params=_SEED_PARAMS),
        Patch("megatron.training.training", "initialize_megatron", _make_init,
              expect_params=("allow_no_cuda",)),
        Patch("megatron.training.initialize", "_warmup_jit_function", _make_noop),
        Patch("megatron.training.arguments", "get_device_arch_version", _make_arch),
        Patch("megatron.core.tensor_parallel.random", "_get_cuda_rng_state", _make_get_rng,
              expect_params=("device", "clone", "graph_safe")),
        Patch("megatron.core.tensor_parallel.random", "_set_cuda_rng_state", _make_set_rng,
              expect_params=("new_state", "device", "graph_safe")),
    ]
