"""An independent reference for one training step, on one process (run with torchrun, 1 rank).

Loads the weights a run saved at iteration ``--iteration`` and computes, for the global batch of
that step, the per-token loss over the batch and the norm of its gradient -- with Megatron's own
GPTModel and layer spec (``get_gpt_layer_local_spec``), each document alone under a causal mask with
positions ``0..n-2``, and the documents chosen by re-deriving the documented rule here (the train
split's document range ``[round(a n), round(b n))`` of the normalised ``--split``, per-epoch
permutations of its usable documents seeded by ``(seed, 0, epoch)``, ``--global-batch-size``
documents per step, ``--seq-length + 1`` tokens at most). Nothing of ``megatron_flexsp`` is used but CPU mode (the
platform shim that runs Megatron on the host). Prints one JSON line: ``{"lm_loss", "grad_norm"}``.

    torchrun --nproc-per-node 1 tests/integration/independent_step.py <tiny model flags> \
        --data-path PREFIX --load CKPT --iteration 3
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def batch_documents(prefix: str, *, seed: int, global_batch: int, seq_length: int, step: int, split: str):
    """Token arrays of global batch ``step`` (the rule, restated)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    bounds = np.asarray(ds.document_indices)
    docs = []
    for d in range(len(bounds) - 1):
        docs.append(np.concatenate([np.asarray(ds.get(i)) for i in range(bounds[d], bounds[d + 1])]))
    shares = [float(x) for x in split.split(",")]
    end = int(round(shares[0] / sum(shares) * len(docs)))
    usable = [d for d in range(end) if len(docs[d]) >= 2]
    out = []
    for pos in range(step * global_batch, (step + 1) * global_batch):
        epoch, off = divmod(pos, len(usable))
        perm = np.random.default_rng([seed, 0, epoch]).permutation(len(usable))
        out.append(docs[usable[perm[off]]][: seq_length + 1].astype(np.int64))
    return out


def main() -> int:
    from megatron_flexsp.integration.cpu_mode import enable_cpu_mode

    enable_cpu_mode()
    import torch
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.training.argument_utils import core_transformer_config_from_args
    from megatron.training.arguments import parse_args, validate_args

    extra = {}

    def own_args(parser):
        g = parser.add_argument_group("reference")
        g.add_argument("--iteration", type=int, required=True)
        return parser

    args = parse_args(own_args)
    args.dataloader_type = "external"
    validate_args(args, {})
    extra["iteration"] = args.iteration
    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(args.seed)
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding

    args.padded_vocab_size = vocab_size_with_padding(args.vocab_size, args, logging_enabled=False)
    config = core_transformer_config_from_args(args)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(
        normalization=args.normalization), vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base)
    state = torch.load(Path(args.load) / f"iter_{args.iteration:07d}" / "mp_rank_00" / "model_optim_rng.pt",
                       map_location="cpu", weights_only=False)["model"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    bad = [k for k in list(missing) + list(unexpected) if not k.endswith("_extra_state")]
    if bad:
        raise RuntimeError(f"checkpoint and model differ: {bad[:5]}")
    docs = batch_documents(args.data_path[0], seed=args.seed, global_batch=args.global_batch_size,
                           seq_length=args.seq_length, step=args.iteration, split=args.split)
    total = sum(len(d) - 1 for d in docs)
    loss_sum = torch.zeros((), dtype=torch.float64)
    for doc in docs:
        tokens = torch.from_numpy(doc)
        n = len(tokens) - 1
        mask = torch.ones(n, n, dtype=torch.bool).triu(1).view(1, 1, n, n)  # True: not attended
        losses = model(tokens[:-1].view(1, n), torch.arange(n).view(1, n), mask, labels=tokens[1:].view(1, n))
        (losses.float().sum() / total).backward()
        loss_sum += losses.double().sum().detach()
    grad_sq = sum(float((p.grad.double() ** 2).sum()) for p in model.parameters() if p.grad is not None)
    print(json.dumps({"lm_loss": float(loss_sum / total), "grad_norm": math.sqrt(grad_sq),
                      "documents": len(docs), "tokens": total, **extra}), flush=True)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
