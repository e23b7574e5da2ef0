"""Megatron options ``pretrain_gpt_flexsp.py`` cannot honour: refused by name before training.

:func:`check_megatron_args` lists every offending option with the reason, in one ``ValueError``:
options the document sampler or ``--flexsp`` cannot serve, and options whose kernels are not
installed here (apex's fused gradient accumulation, Transformer Engine's layers and fused RoPE), so
a run never fails at model build or, worse, runs something else than asked.
"""

from __future__ import annotations

import importlib


def _imports(module: str) -> bool:
    try:
        importlib.import_module(module)
        return True
    except Exception:  # noqa: BLE001 - absent or broken (TE raises RuntimeError without a GPU)
        return False


def optional_kernels(cuda: bool) -> dict[str, bool]:
    """Which optional packages import here: apex's ``fused_weight_gradient_mlp_cuda`` and
    Transformer Engine (probed only with CUDA)."""
    return {"apex_gradient_fusion": _imports("fused_weight_gradient_mlp_cuda"),
            "transformer_engine": cuda and _imports("transformer_engine.pytorch")}


# (attribute, bad-value predicate, what to say)
_UNSUPPORTED = (
    ("pipeline_model_parallel_size", lambda v: v not in (None, 1), "pipeline parallelism"),
    ("virtual_pipeline_model_parallel_size", lambda v: v not in (None, 1), "virtual pipeline stages"),
    ("context_parallel_size", lambda v: v not in (None, 1),
     "Megatron context parallelism (--flexsp forms its own sequence-parallel groups)"),
    ("hybrid_context_parallel", bool, "Megatron's hybrid/dynamic context parallelism"),
    ("expert_model_parallel_size", lambda v: v not in (None, 1), "expert parallelism"),
    ("num_experts", lambda v: v not in (None, 0), "mixture of experts"),
    ("use_megatron_fsdp", bool, "Megatron-FSDP (ZeRO-3): its parameter all-gathers run per "
     "micro-batch on every rank, but FlexSP ranks run different numbers of micro-batches; use "
     "--use-distributed-optimizer (ZeRO-1) with tensor parallelism for large models"),
    ("use_torch_fsdp2", bool, "torch FSDP2 (ZeRO-3): its parameter all-gathers run per micro-batch on "
     "every rank, but FlexSP ranks run different numbers of micro-batches; use "
     "--use-distributed-optimizer (ZeRO-1) with tensor parallelism for large models"),
    ("tp_comm_overlap", bool, "TP communication overlap (Transformer Engine userbuffers sized for "
     "fixed-length sequences)"),
    ("cuda_graph_impl", lambda v: v not in (None, "none"), "CUDA graphs"),
    ("micro_batch_size", lambda v: v not in (None, 1),
     "--micro-batch-size other than 1 (FlexSP forms its own micro-batches)"),
)


def check_megatron_args(args, kernels: dict[str, bool] | None = None) -> None:
    """Refuse Megatron options our data path or ``--flexsp`` cannot honour, naming the option.

    ``kernels``: :func:`optional_kernels` of this machine (default: none installed).
    """
    kernels = kernels or {}
    problems = []
    te = kernels.get("transformer_engine", False)
    impl = getattr(args, "transformer_impl", "local")
    if impl == "transformer_engine" and not te:
        problems.append("--transformer-impl transformer_engine (Megatron's default) needs Transformer "
                        "Engine, which does not import here: add --transformer-impl local")
    if impl == "transformer_engine" and not getattr(args, "flexsp", False):
        problems.append("--transformer-impl transformer_engine without --flexsp: this script packs "
                        "documents into rows with a document-causal mask, which needs --transformer-impl "
                        "local")
    if getattr(args, "gradient_accumulation_fusion", False) and not kernels.get("apex_gradient_fusion"):
        problems.append("--gradient-accumulation-fusion (Megatron's default) needs apex's "
                        "fused_weight_gradient_mlp_cuda, which is not installed: add "
                        "--no-gradient-accumulation-fusion")
    if getattr(args, "apply_rope_fusion", False) and not te:
        problems.append("RoPE fusion (Megatron's default) needs Transformer Engine, which does not "
                        "import here: add --no-rope-fusion")
    if getattr(args, "rampup_batch_size", None):
        problems.append(f"--rampup-batch-size {' '.join(map(str, args.rampup_batch_size))}: "
                        f"megatron-core 0.19 ignores it (deprecated; the batch would not ramp); use "
                        f"--step-batch-size-schedule, which the document batches follow")
    for attr, why in (("full_validation", "evaluation draws --eval-iters global batches of validation "
                                          "documents per evaluation"),
                      ("multiple_validation_sets", "one validation split is built"),
                      ("phase_transition_iterations", "the document batches follow one schedule")):
        if getattr(args, attr, None):
            problems.append(f"--{attr.replace('_', '-')}: not supported ({why})")
    if not getattr(args, "calculate_per_token_loss", False):
        problems.append("--calculate-per-token-loss is required (per-token loss over the global batch)")
    if getattr(args, "dataloader_type", None) != "external":
        problems.append(f"--dataloader-type {args.dataloader_type} (this script's document sampler "
                        f"needs 'external')")
    if getattr(args, "flexsp", False):
        if getattr(args, "window_size", None) is not None:
            problems.append(f"--window-size {args.window_size}: FlexSP's core attention is causal over "
                            f"whole documents (no sliding window)")
        for attr in ("fp8", "fp4"):
            if getattr(args, attr, None):
                problems.append(f"--{attr}-format {getattr(args, attr)}: FlexSP does not pad each rank's "
                                f"THD shard to Transformer Engine's {attr.upper()} alignment")
        for attr, bad, what in _UNSUPPORTED:
            value = getattr(args, attr, None)
            if bad(value):
                problems.append(f"--{attr.replace('_', '-')}={value}: {what}")
    if problems:
        raise ValueError("unsupported Megatron options" + (" with --flexsp" if args.flexsp else "")
                         + ":\n  " + "\n  ".join(problems))


#: Data flags this script's document batches make redundant: accepted, with one log line each.
REDUNDANT = (
    ("reset_position_ids", "positions always restart at every document"),
    ("reset_attention_mask", "attention never crosses a document boundary"),
)


def redundant_flag_notes(args) -> list[str]:
    """One line per given flag that whole-document batches make redundant (``--num-workers``
    included: documents are read in the training process, only by the ranks that own them)."""
    notes = [f"--{attr.replace('_', '-')}: redundant, {why}" for attr, why in REDUNDANT
             if getattr(args, attr, False)]
    if getattr(args, "num_workers", 0):
        notes.append(f"--num-workers {args.num_workers}: no DataLoader workers are used; each rank reads "
                     f"only the documents it owns, in the training process")
    return notes
