"""The micro-batch loop: ``megatron.training.training.get_forward_backward_func``.

Megatron's ``train()`` looks the name up in ``training.py``'s namespace, so the patch replaces it
there (patching ``megatron.core.pipeline_parallel`` after import changes nothing in ``train()``).
The replacement returns ``step_driver.forward_backward``, which takes one global batch from the data
iterator, makes this rank's micro-batches (their number varies per step and per rank) and runs
Megatron's own no-pipelining schedule over them: Megatron's forward step, backward, per-token loss
accounting and ``finalize_model_grads`` (gradient all-reduce over all ranks) stay Megatron's.
"""

from __future__ import annotations

from patches import Patch

#: Keyword arguments ``train()`` and ``evaluate()`` pass to the schedule in megatron-core 0.19.
SCHEDULE_KWARGS = ("forward_step_func", "data_iterator", "model", "num_microbatches", "seq_length",
                   "micro_batch_size", "forward_only")


def schedule_patch(step_driver) -> Patch:
    """Patch making ``train()`` and ``evaluate()`` use ``step_driver.forward_backward``."""

    def make(original):
        def get_forward_backward_func(*args, **kwargs):
            return step_driver.forward_backward

        return get_forward_backward_func

    return Patch("megatron.training.training", "get_forward_backward_func", make)


def megatron_no_pipelining():
    """Megatron's own schedule for one model chunk, checked for the keywords we pass."""
    import inspect

    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    params = set(inspect.signature(forward_backward_no_pipelining).parameters)
    missing = [k for k in SCHEDULE_KWARGS if k not in params]
    if missing:
        raise RuntimeError(f"megatron.core.pipeline_parallel.schedules.forward_backward_no_pipelining "
                           f"lacks {missing}; this plugin was written for megatron-core 0.19")
    return forward_backward_no_pipelining


def save_hook_patch(on_save) -> Patch:
    """After Megatron saves a checkpoint, call ``on_save(iteration)`` (document accounting)."""

    def make(original):
        def save_checkpoint(iteration, *args, **kwargs):
            out = original(iteration, *args, **kwargs)
            on_save(int(iteration))
            return out

        return save_checkpoint

    return Patch("megatron.training.training", "save_checkpoint", make,
                 expect_params=("iteration", "model", "optimizer"))


def train_step_patch(on_step) -> Patch:
    """After each of Megatron's training steps, call ``on_step(iteration, result)`` with what
    ``train_step`` returned (its reduced losses, grad norm, ...), at full precision."""

    def make(original):
        def train_step(*args, **kwargs):
            out = original(*args, **kwargs)
            on_step(kwargs.get("iteration"), out)
            return out

        return train_step

    return Patch("megatron.training.training", "train_step", make,
                 expect_params=("forward_step_func", "data_iterator", "model", "optimizer", "iteration"))
