"""Three megatron-core 0.19 ``DistributedOptimizer`` bugs on the resume path with torch's Adam.

Without apex or Transformer Engine (CPU, or a GPU install without them) Megatron falls back to
``torch.optim.AdamW``, and resuming from a checkpoint with ``--use-distributed-optimizer``:

1. ``_set_main_param_and_optimizer_states`` copies the saved main parameters in place into views of
   leaf tensors that require grad, outside ``no_grad`` ("a view of a leaf Variable that requires
   grad is being used in an in-place operation"), and looks up torch Adam's ``step`` among the
   per-parameter tensors: absent from ``torch`` checkpoints (``KeyError: 'step'``, the load
   crashes), and in ``torch_dist`` checkpoints the load template's value, which silently resets
   the step (the resumed run's second step diverged by 0.4%). Fixed by running it under
   ``torch.no_grad()`` and never copying ``step`` there: the step count is restored from the param
   groups by ``load_state_dict``, as Megatron's own comments intend.
2. ``load_state_dict`` gives every parameter's Adam state the *same* ``step`` tensor; torch's Adam
   increments it once per parameter per step, so after a resume the bias correction is silently
   wrong (the step count races ahead by the number of parameters each iteration). Fixed by giving
   each parameter its own copy after loading.

3. Loading a ``torch_dist`` checkpoint builds the optimizer's sharded state dict before any step
   has run, while torch's Adam has no state yet: ``state_dict`` asserts that all parameters share
   exactly one ``step`` and finds none (``assert len(steps) == 1``), and even past that the saved
   moments would have no tensors to load into. Fixed by creating the state first with Megatron's own
   ``_init_optimizer_states_with_dummy_values`` (one zero-gradient step; the checkpoint overwrites
   every value it produced), as Megatron already does for its FSDP path.

With all three, a resume reproduces the uninterrupted run exactly with ``--ckpt-format torch`` and
``torch_dist``; ``tests/integration/test_megatron_train.py`` checks both and that each fix is needed.
"""

from __future__ import annotations

import functools

import torch

from patches import Patch

_MODULE = "megatron.core.optimizer.distrib_optimizer"


def _make_no_grad(original):
    @functools.wraps(original)
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        # torch Adam's step comes from the param groups (load_state_dict); a per-parameter "step"
        # here is absent (torch format) or the load template's value (torch_dist): never copy it
        tensors = {**tensors, "step": None}  # non-tensor entries are skipped by the original
        with torch.no_grad():
            return original(self, model_param, tensors)

    return _set_main_param_and_optimizer_states


def _make_unshared_step(original):
    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        out = original(self, state_dict)
        seen = set()
        for state in self.optimizer.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                if id(step) in seen:
                    state["step"] = step.detach().clone()
                seen.add(id(state["step"]))
        return out

    return load_state_dict


def _make_sharded_state_dict(original):
    @functools.wraps(original)
    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading=False, *args, **kwargs):
        import megatron.core.optimizer.distrib_optimizer as mod

        if is_loading and not getattr(mod, "HAVE_APEX_OR_TE", True) and not len(self.optimizer.state):
            # torch Adam creates its state lazily: make it now (one zero-gradient step whose values
            # the checkpoint then overwrites) so the template has a step and moments to load into
            self._init_optimizer_states_with_dummy_values()
        if model_sharded_state_dict is None:
            return original(self, is_loading=is_loading, *args, **kwargs)
        return original(self, model_sharded_state_dict, is_loading, *args, **kwargs)

    return sharded_state_dict


def distrib_optimizer_patches() -> list[Patch]:
    """Fresh patch objects for the three fixes (apply with :func:`patches.apply`)."""
    return [
        Patch(_MODULE, "DistributedOptimizer.sharded_state_dict", _make_sharded_state_dict,
              expect_params=("self", "model_sharded_state_dict", "is_loading")),
        Patch(_MODULE, "DistributedOptimizer._set_main_param_and_optimizer_states", _make_no_grad,
              expect_params=("self", "model_param", "tensors")),
        Patch(_MODULE, "DistributedOptimizer.load_state_dict", _make_unshared_step,
              expect_params=("self", "state_dict")),
    ]
