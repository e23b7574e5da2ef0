"""Megatron GPT pretraining on whole documents, with FlexSP heterogeneous sequence parallelism.

The shape of Megatron-LM's ``pretrain_gpt.py``: Megatron's argument parser, ``pretrain()``, GPTModel,
its logging, evaluation and ``--save/--load``, its loss checks; our flags come through
``extra_args_provider`` (:data:`megatron_flexsp.integration.args.FLEXSP_FLAGS`). Data: whole
documents of Megatron indexed datasets, blended and split by Megatron's dataset builder
(``--data-path [W] PREFIX ...``, ``--split``, ``--train/valid/test-data-path``, ``--mock-data``),
``--global-batch-size`` documents per step (or ``--step-batch-size-schedule``).

- with ``--flexsp``: Megatron runs with PP=CP=1, tensor parallelism inside a node (optionally with
  ``--sequence-parallel``) and DP = world / TP; every global batch is planned into heterogeneous
  Ulysses groups of devices (TP groups) and this script's patches run each rank's micro-batches;
- without it: plain Megatron (data and tensor parallelism) over the same documents packed into rows.

Required Megatron flags: ``--calculate-per-token-loss``; ``--dataloader-type`` is set to
``external``. CPU mode (``--flexsp-cpu``, default auto) runs all of it on CPU with gloo.

    torchrun --nproc-per-node 4 pretrain_gpt_flexsp.py --flexsp <Megatron flags> ...
    python pretrain_gpt_flexsp.py --flexsp-plan-only --lengths FILE ...   # plan only, as `flexsp plan`
"""

from __future__ import annotations

import os
import sys
from functools import partial


def _flag_value(argv: list[str], flag: str, default: str) -> str:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return default


SPIKY_LOSS_FACTOR = 10  # as in Megatron-LM's pretrain_gpt.py: 10x the largest loss seen is a spike


def loss_func(loss_mask, output_tensor):
    """Per-token loss terms of one micro-batch: (sum, token count, report) for Megatron, checked by
    Megatron's rerun state machine as ``pretrain_gpt.py`` checks them (NaN, Inf, spiky loss)."""
    import torch
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.training import get_args

    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    args, rerun = get_args(), get_rerun_state_machine()
    if getattr(args, "check_for_nan_in_loss_and_grad", True):
        rerun.validate_result(result=loss, rejection_func=torch.isnan,
                              message="found NaN in local forward loss calculation", tolerance=0.0, fatal=True)
        rerun.validate_result(result=loss, rejection_func=torch.isinf,
                              message="found Inf in local forward loss calculation", tolerance=0.0, fatal=True)
    if getattr(args, "check_for_spiky_loss", False):
        rerun.validate_result(result=loss, rejection_func=partial(rerun.is_unexpectedly_large,
                                                                  threshold=SPIKY_LOSS_FACTOR, context="loss"),
                              message="Spiky loss", tolerance=0.0, fatal=False)
    num_tokens = mask.sum().to(torch.int)
    report = torch.cat([loss.detach().view(1), num_tokens.float().view(1)])
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model):
    """Megatron forward step on one prepared micro-batch (see megatron_flexsp.integration)."""
    item = next(data_iterator)
    output = model(item.tokens, item.position_ids, item.attention_mask, labels=item.labels,
                   packed_seq_params=item.packed_seq_params)
    return output, partial(loss_func, item.loss_mask)


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None,
                   *, settings=None, flexsp=False, backend="sdpa"):
    """GPTModel with Megatron's layer spec (``--transformer-impl``: Transformer Engine's or the local
    one); with ``--flexsp`` FlexSP core attention in its ``core_attention`` slot."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training import get_args
    from megatron.training.argument_utils import core_transformer_config_from_args

    from megatron_flexsp.integration.attention import flexsp_layer_spec
    from megatron_flexsp.integration.norms import sequence_parallel_block

    args = get_args()
    config = config or core_transformer_config_from_args(args)
    norm = getattr(args, "normalization", None)
    if flexsp:
        spec = flexsp_layer_spec(backend=backend, kv_replication=settings.runtime.kv_replication,
                                 normalization=norm, qk_layernorm=args.qk_layernorm,
                                 transformer_impl=args.transformer_impl)
    else:
        spec = get_gpt_layer_local_spec(normalization=norm, qk_layernorm=args.qk_layernorm)
    if args.sequence_parallel:  # torch norms that sum their gradients over TP
        # negative control in the tests only: norms whose gradients are not summed over TP
        spec = sequence_parallel_block(spec, args.num_layers,
                                       mark=os.environ.get("FLEXSP_TEST_UNMARKED_SP_NORMS") != "1")
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
                    post_process=post_process, fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
                    parallel_output=True,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type,
                    rotary_percent=args.rotary_percent, rotary_base=args.rotary_base,
                    rope_scaling=args.use_rope_scaling, rope_scaling_factor=args.rope_scaling_factor,
                    seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
                    pg_collection=pg_collection)


def main(argv: list[str]) -> int:
    if "--flexsp-plan-only" in argv:
        from megatron_flexsp.cli import main as cli_main

        return cli_main(["plan", *[a for a in argv if a != "--flexsp-plan-only"]])

    from megatron_flexsp.integration.cpu_mode import enable_cpu_mode, resolve_cpu_mode

    on_cpu = resolve_cpu_mode(_flag_value(argv, "--flexsp-cpu", "auto"))
    if on_cpu:
        backend = _flag_value(argv, "--distributed-backend", "gloo")
        if backend != "gloo":
            raise ValueError(f"--distributed-backend {backend}: CPU mode needs gloo")
        if "--distributed-backend" not in " ".join(argv):
            sys.argv += ["--distributed-backend", "gloo"]
        enable_cpu_mode()

    from megatron.core.enums import ModelType
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.training import pretrain

    import patches
    from megatron_flexsp.integration.args import add_flexsp_args, load_settings
    from megatron_flexsp.integration.checks import check_megatron_args, optional_kernels, redundant_flag_notes
    from megatron_flexsp.integration.driver import StepDriver
    from patches.datasets import helpers_patch
    from patches.distrib_optimizer import distrib_optimizer_patches
    from patches.schedule import save_hook_patch, schedule_patch, train_step_patch

    args = parse_and_validate_args(extra_args_provider=add_flexsp_args,
                                   args_defaults={"dataloader_type": "external"})
    check_megatron_args(args, optional_kernels(cuda=not on_cpu))
    if args.rank == 0:
        from megatron_flexsp.utils.logging import get_logger

        for note in redundant_flag_notes(args):
            get_logger("flexsp.args").info("%s", note)
    settings = load_settings(args.flexsp_config)
    driver = StepDriver(args, settings, on_cpu=on_cpu)

    def datasets_provider(train_val_test_num_samples, vp_stage=None):
        return driver.datasets(train_val_test_num_samples)

    datasets_provider.is_distributed = True
    provider = partial(model_provider, settings=settings, flexsp=driver.flexsp, backend=driver.backend)
    active = [schedule_patch(driver), save_hook_patch(driver.on_save), helpers_patch(),
              train_step_patch(driver.on_train_step)]
    # negative controls in the tests only: "1" leaves all optimizer fixes out, or a comma list of the
    # patched method names (e.g. "sharded_state_dict") leaves those out
    left_out = os.environ.get("FLEXSP_TEST_UNPATCHED_OPTIMIZER", "")
    active += [p for p in distrib_optimizer_patches()
               if left_out != "1" and p.attribute.split(".")[-1] not in left_out.split(",")]
    patches.apply(active)
    try:
        pretrain(pretrain_cfg_container_from_args(args, None), datasets_provider,
                 ModelType.encoder_or_decoder, forward_step, model_provider=provider)
    except SystemExit as stop:  # Megatron's exit-interval / exit-signal paths end with sys.exit
        if not stop.code:
            _close_process_groups()
        raise
    else:
        _close_process_groups()
    finally:
        driver.close()
        patches.revert(active)
    return 0


def _close_process_groups() -> None:
    """Destroy every process group before the interpreter exits: gloo's worker threads left alive
    into interpreter finalization can abort the process (SIGABRT, "terminate called without an
    active exception") after a run that finished well."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _leave(code: int | str | None) -> None:
    """End the process with ``code`` (as ``SystemExit`` would) without the interpreter's own
    finalization: TensorBoard's writer is flushed and closed, the atexit handlers run (logging,
    multiprocessing's children, W&B), the standard streams are flushed, then ``os._exit``. Tearing
    down the modules Megatron imports does nothing for a run that has ended and takes about 2 s per
    process: 4-5 s of every 4-rank launch on 2 CPU cores, after the last rank is done."""
    import atexit

    if code is None:
        code = 0
    elif not isinstance(code, int):  # printed, exit status 1, as the interpreter does
        print(code, file=sys.stderr)
        code = 1
    if "megatron.training.global_vars" in sys.modules:
        from megatron.training.global_vars import get_tensorboard_writer

        writer = get_tensorboard_writer()
        if writer is not None:
            writer.close()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    try:
        status = main(sys.argv[1:])
    except SystemExit as stop:  # Megatron's exit paths and argument errors
        status = stop.code
    except Exception:  # the traceback as the interpreter prints it, exit status 1
        import traceback

        traceback.print_exc()
        status = 1
    _leave(status)
