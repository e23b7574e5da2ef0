"""Integration pieces that need no launch: flags, option checks, settings, sampler, packing, patches."""

import argparse
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import pytest

pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[2]

from megatron_flexsp.integration.args import FLEXSP_FLAGS, add_flexsp_args, load_settings  # noqa: E402
from megatron_flexsp.integration.checks import check_megatron_args  # noqa: E402
from megatron_flexsp.integration.data import GlobalBatch  # noqa: E402


def test_flag_set_is_exactly_the_documented_one():
    parser = add_flexsp_args(argparse.ArgumentParser())
    added = {opt for a in parser._actions for opt in a.option_strings if opt.startswith("--flexsp")}
    assert added == set(FLEXSP_FLAGS), "update FLEXSP_FLAGS (and the README flag table)"
    assert set(FLEXSP_FLAGS) == {"--flexsp", "--flexsp-config", "--flexsp-profile",
                                 "--flexsp-over-length", "--flexsp-cpu", "--flexsp-plan-dir"}


def _args(**kw):
    base = dict(flexsp=True, calculate_per_token_loss=True, dataloader_type="external",
                pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
                tensor_model_parallel_size=1, context_parallel_size=1, hybrid_context_parallel=False,
                expert_model_parallel_size=1, num_experts=None, sequence_parallel=False,
                cuda_graph_impl="none", micro_batch_size=1)
    base.update(kw)
    return SimpleNamespace(**base)


@pytest.mark.parametrize("kw, named", [
    ({"pipeline_model_parallel_size": 2}, "--pipeline-model-parallel-size=2"),
    ({"use_megatron_fsdp": True}, "--use-megatron-fsdp=True: Megatron-FSDP"),
    ({"use_torch_fsdp2": True}, "--use-torch-fsdp2=True: torch FSDP2"),
    ({"context_parallel_size": 4}, "--context-parallel-size=4"),
    ({"cuda_graph_impl": "local"}, "--cuda-graph-impl=local"),
    ({"num_experts": 8}, "--num-experts=8"),
    ({"micro_batch_size": 2}, "--micro-batch-size=2"),
    ({"calculate_per_token_loss": False}, "--calculate-per-token-loss is required"),
    ({"dataloader_type": "single"}, "--dataloader-type single"),
])
def test_unsupported_options_are_refused_by_name(kw, named):
    with pytest.raises(ValueError, match=named.replace("-", r"\-")):
        check_megatron_args(_args(**kw))


def test_plain_mode_allows_megatron_parallelism_options():
    check_megatron_args(_args(flexsp=False, micro_batch_size=4))
    check_megatron_args(_args())
    # --flexsp runs with tensor parallelism and its sequence parallelism
    check_megatron_args(_args(tensor_model_parallel_size=2, sequence_parallel=True))


def test_random_plans_are_valid_deterministic_and_mixed():
    import numpy as np

    from megatron_flexsp.cost_model import CostModel, load_profile
    from megatron_flexsp.model_spec import get_model
    from megatron_flexsp.parallelism import Parallelism
    from megatron_flexsp.plan import validate_plan
    from megatron_flexsp.planner import plan_step
    from megatron_flexsp.sim import random_plans  # noqa: F401  (registers "random")

    cm = CostModel.from_profile(load_profile("h200-estimate"), get_model("llama3-8b"), num_gpus=64,
                                max_seq_len=1 << 17, parallel=Parallelism(tp=2, sequence_parallel=True))
    lens = np.random.default_rng(3).integers(100, 1 << 17, 96)
    plan = plan_step(lens, cm, strategy="random")
    validate_plan(plan)
    again = plan_step(lens, cm, strategy="random")
    assert plan.tensor_parallel == 2 and plan.micro_batches == again.micro_batches
    sizes = {g.size for mb in plan.micro_batches for g in mb.groups}
    assert len(sizes) >= 3, sizes
    for mb in plan.micro_batches:  # within memory
        for g in mb.groups:
            assert sum(int(lens[s]) for s in g.seqs) <= cm.group_capacity_tokens(g.size)


def test_sequence_parallel_norms_are_marked_and_replace_torch_norms():
    from types import SimpleNamespace

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_flexsp.integration.norms import SequenceParallelTorchNorm, sequence_parallel_block

    block = sequence_parallel_block(get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=True), 3)
    assert len(block.layer_specs) == 3 and block.layer_norm is SequenceParallelTorchNorm
    sub = block.layer_specs[0].submodules
    assert sub.input_layernorm is SequenceParallelTorchNorm and sub.pre_mlp_layernorm is SequenceParallelTorchNorm
    assert sub.self_attention.submodules.q_layernorm is not WrappedTorchNorm
    cfg = SimpleNamespace(normalization="RMSNorm", sequence_parallel=True, persist_layer_norm=False,
                          layernorm_zero_centered_gamma=False, memory_efficient_layer_norm=False)
    norm = SequenceParallelTorchNorm(cfg, 16, eps=1e-6)
    assert all(p.sequence_parallel for p in norm.parameters())
    with pytest.raises(ValueError, match="--persist-layer-norm"):
        SequenceParallelTorchNorm(SimpleNamespace(**{**vars(cfg), "persist_layer_norm": True}), 16)


def test_settings_file(tmp_path):
    cfg = tmp_path / "f.yaml"
    cfg.write_text("planner:\n  strategy: batchada\n  num_buckets: 8\nruntime:\n  attention_backend: sdpa\n")
    s = load_settings(str(cfg))
    import torch

    assert s.strategy == "batchada" and s.planner.num_buckets == 8
    assert s.runtime.backend(True, torch.float32) == "sdpa"
    assert load_settings(None).runtime.backend(on_cpu=True, dtype=torch.bfloat16) == "sdpa"
    cfg.write_text("planner:\n  bogus: 1\n")
    with pytest.raises(ValueError, match="bogus"):
        load_settings(str(cfg))
    cfg.write_text("runtime:\n  attention_backend: cuda-magic\n")
    with pytest.raises(ValueError, match="cuda-magic"):
        load_settings(str(cfg))
    with pytest.raises(ValueError, match="does not exist"):
        load_settings(str(tmp_path / "missing.yaml"))
    cfg.write_text("planning:\n  solver_priority: realtime\n")
    with pytest.raises(ValueError, match="solver_priority='realtime'"):
        load_settings(str(cfg))
    cfg.write_text("planning:\n  solver_priority: idle\n")
    assert load_settings(str(cfg)).planning.solver_priority == "idle"


def test_default_settings_file_lists_the_defaults():
    """configs/flexsp_default.yaml says it lists the defaults: every value it names is the code's."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    loaded, defaults = load_settings(str(root / "configs" / "flexsp_default.yaml")), load_settings(None)
    assert loaded == defaults


def _indexed(tmp_path, lens, name="docs"):
    """A Megatron indexed dataset whose document d holds tokens ``d*1000 + 0..lens[d]-1``."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / name)
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for d, n in enumerate(lens):
        b.add_item(torch.arange(n, dtype=torch.int32) + 1000 * d)
        b.end_document()
    b.finalize(prefix + ".idx")
    return prefix


def _splits(blend, sizes, *, split="100,0,0", seq_length=32, over_length="truncate", seed=7):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    from megatron_flexsp.integration.data import DocumentDataset, DocumentDatasetConfig, DocumentSplit

    cfg = DocumentDatasetConfig(random_seed=seed, sequence_length=seq_length, blend=blend, split=split,
                                over_length=over_length)
    built = BlendedMegatronDatasetBuilder(DocumentDataset, sizes, lambda: True, cfg).build()
    return [DocumentSplit(ds, name) if ds is not None and len(ds) else None
            for ds, name in zip(built, ("train", "valid", "test"))]


def test_documents_once_per_epoch_counted_cuts_and_split_ranges(tmp_path):
    lens = [1, 5, 50, 7, 300, 9, 2, 40, 11, 8]  # tokens per document
    prefix = _indexed(tmp_path, lens)
    train, _, _ = _splits(([prefix], None), [27, 0, 0])
    a = train.acct
    assert a.dropped_too_short == 1 and a.truncated_documents == 3  # 50, 300, 40 > 33
    assert a.truncated_tokens == (50 - 33) + (300 - 33) + (40 - 33) and a.usable_documents == 9
    batches = [train.batch(k, 3 * k, 3) for k in range(9)]  # 27 = 3 epochs of 9
    docs = np.concatenate([b.doc_ids for b in batches])
    usable = sorted(d for d in range(10) if lens[d] >= 2)
    for e in range(3):
        assert sorted(docs[e * 9:(e + 1) * 9].tolist()) == usable
    assert not np.array_equal(docs[:9], docs[9:18])  # reshuffled per epoch
    again, _, _ = _splits(([prefix], None), [27, 0, 0])
    assert np.array_equal(again.batch(5, 15, 3).doc_ids, batches[5].doc_ids)  # deterministic (resume)
    b = train.batch(0, 0, 3, load=True)
    assert (b.lengths == np.minimum(np.array(lens)[b.doc_ids], 33) - 1).all()
    for s, d in enumerate(b.doc_ids):  # tokens of the right document, inputs and labels shifted by one
        x = b.loaded[s]
        assert x[0, 0] == 1000 * d and (x[:, 1] - x[:, 0] == 1).all() and len(x) == b.lengths[s]
    with pytest.raises(ValueError, match="the train split holds 27 samples; position 27"):
        train.batch(9, 27, 3)
    # --split 60,40,0: the train split is documents 0..5, the valid split 6..9
    tr, va, te = _splits(([prefix], None), [5, 3, 0], split="60,40,0")
    assert set(tr.batch(0, 0, 5).doc_ids) <= set(range(6)) and set(va.batch(0, 0, 3).doc_ids) <= {6, 7, 8, 9}
    assert te is None


def test_over_length_policies_and_no_usable_documents(tmp_path):
    prefix = _indexed(tmp_path, [10, 100, 20])
    drop, _, _ = _splits(([prefix], None), [2, 0, 0], over_length="drop")
    assert drop.acct.dropped_too_long == 1 and drop.acct.usable_documents == 2
    with pytest.raises(ValueError, match="document 1 has 100 tokens"):
        _splits(([prefix], None), [2, 0, 0], over_length="error")
    short = _indexed(tmp_path, [1, 1], name="short")
    with pytest.raises(ValueError, match="no usable documents"):
        _splits(([short], None), [2, 0, 0])


def test_weighted_blend_draws_in_proportion(tmp_path):
    a = _indexed(tmp_path, [5 + d % 7 for d in range(50)], name="a")
    b = _indexed(tmp_path, [9 + d % 5 for d in range(50)], name="b")
    train, _, _ = _splits(([a, b], [0.25, 0.75]), [400, 0, 0])
    batch = train.batch(0, 0, 400)
    from_b = sum(1 for s in range(400) if train._where(s)[0] is train.parts[1])
    assert abs(from_b / 400 - 0.75) < 0.02 and len(batch.lengths) == 400


def test_plain_packing_keeps_documents_whole_and_masks_across_them():
    import torch

    from megatron_flexsp.integration.microbatches import plain_micro_batches

    lens = [5, 3, 7, 2]
    loaded = {s: torch.stack([torch.arange(L) + 10 * s, torch.arange(L) + 10 * s + 1], 1)
              for s, L in enumerate(lens)}
    batch = GlobalBatch(0, np.arange(4), np.array(lens), np.zeros(4, int), 0, loaded)
    items = plain_micro_batches(batch, rank=0, world=1, seq_length=8, micro_batch_size=1, device="cpu")
    assert sum(int(i.loss_mask.sum()) for i in items) == sum(lens)
    assert len(items) == 3  # 7 | 5+3 | 2
    row = items[1]  # documents 0 (5 tokens) and 1 (3 tokens)
    assert row.position_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    mask = row.attention_mask[0, 0]  # True = masked
    assert not mask[4, 0] and mask[5, 4] and mask[0, 1] and not mask[7, 5]


def test_distributed_optimizer_patches_apply_and_revert():
    pytest.importorskip("megatron.core")
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    import patches
    from patches.distrib_optimizer import distrib_optimizer_patches

    before = DistributedOptimizer.load_state_dict
    ps = distrib_optimizer_patches()
    patches.apply(ps)
    patches.apply(ps)  # idempotent
    assert DistributedOptimizer.load_state_dict is not before
    patches.revert(ps)
    assert DistributedOptimizer.load_state_dict is before


def test_cpu_mode_maps_cuda_to_cpu_and_turns_off():
    import torch

    from megatron_flexsp.integration.cpu_mode import (cpu_mode_active, disable_cpu_mode,
                                                      enable_cpu_mode, resolve_cpu_mode)

    if torch.cuda.is_available():
        pytest.skip("CPU mode is refused where CUDA exists")
    assert resolve_cpu_mode("auto") is True
    with pytest.raises(ValueError, match="--flexsp-cpu"):
        resolve_cpu_mode("maybe")
    enable_cpu_mode()
    try:
        assert cpu_mode_active()
        x = torch.zeros(3, device="cuda")
        assert x.device.type == "cpu" and x.type() == "torch.cuda.FloatTensor"
        assert torch.cuda.device_count() == 1 and x.cuda() is x
    finally:
        disable_cpu_mode()
    assert not cpu_mode_active()
    with pytest.raises(RuntimeError):
        torch.zeros(1, device="cuda")


def test_cpu_mode_compiles_megatron_kernels_at_their_first_call():
    import torch

    from patches.cpu import _make_lazy_compile

    calls = []

    def real_compile(model, **options):
        calls.append(options)
        return lambda *a, **k: ("compiled", model(*a, **k))

    lazy = _make_lazy_compile(real_compile)

    @lazy
    def double(x):
        return 2 * x

    @lazy(fullgraph=True, backend="eager")
    def triple(x):
        return 3 * x

    assert calls == [] and double.__name__ == "double"  # decorating compiles nothing
    assert double(2) == ("compiled", 4) and double(3) == ("compiled", 6)
    assert triple(1) == ("compiled", 3)
    assert calls == [{}, {"fullgraph": True, "backend": "eager"}]  # once each, with its options
    module = torch.nn.Linear(2, 2)
    assert lazy(module)(torch.ones(2))[0] == "compiled" and len(calls) == 3  # modules at once


def test_cpu_mode_imports_megatron_without_torchdynamo():
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("CPU mode is refused where CUDA exists")
    code = ("import sys; from megatron_flexsp.integration.cpu_mode import enable_cpu_mode; "
            "enable_cpu_mode(); import megatron.training.training; "
            "from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl; "
            "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_shared_adam_step_is_a_real_bug_and_the_patch_unshares_it():
    import torch

    from patches.distrib_optimizer import _make_unshared_step

    params = [torch.nn.Parameter(torch.ones(2)) for _ in range(3)]
    opt = torch.optim.AdamW(params, lr=0.1)
    for p in params:
        p.grad = torch.ones(2)
    opt.step()
    shared = torch.tensor(1.0)

    class FakeDistOpt:  # what megatron-core's DistributedOptimizer.load_state_dict leaves behind
        optimizer = opt

        def load_state_dict(self, state_dict):
            for st in opt.state.values():
                st["step"] = shared

    buggy = FakeDistOpt()
    buggy.load_state_dict({})
    opt.step()
    assert float(shared) == 4.0  # the bug: one step counted once per parameter
    fixed = _make_unshared_step(FakeDistOpt.load_state_dict)
    shared.fill_(1.0)
    fixed(FakeDistOpt(), {})
    assert len({id(st["step"]) for st in opt.state.values()}) == 3
    opt.step()
    assert [float(st["step"]) for st in opt.state.values()] == [2.0, 2.0, 2.0]


def test_resume_refuses_changed_data_settings(tmp_path):
    import json

    from megatron_flexsp.integration.accounting import CheckpointAccounting
    from megatron_flexsp.integration.data import DataAccounting

    args = SimpleNamespace(iteration=2, load=str(tmp_path), flexsp_over_length="truncate", seed=3,
                           seq_length=16, split="969,30,1", data_path=["p"], train_data_path=None,
                           valid_data_path=None, test_data_path=None, mock_data=False)
    data = SimpleNamespace(data_acct=DataAccounting(num_documents=4, usable_documents=4),
                           batches=SimpleNamespace(state=lambda: {"global_batch": 2,
                                                                  "step_batch_size_schedule": None}))
    d = CheckpointAccounting(args, data, tmp_path, recorder=None)
    (tmp_path / "iter_0000002").mkdir()
    saved = {"version": 2, "data": dict(d.data_state(), global_batch=4), "documents_consumed": 4}
    (tmp_path / "iter_0000002" / "flexsp_data.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=r"'global_batch': \(4, 2\)"):
        d.check_resume()
    saved["data"]["global_batch"] = 2
    (tmp_path / "iter_0000002" / "flexsp_data.json").write_text(json.dumps(saved))
    d.check_resume()


def test_attention_backend_follows_installed_packages_and_dtype():
    import torch

    from megatron_flexsp.runtime.attention import choose_backend

    bf16, fp32 = torch.bfloat16, torch.float32
    both, none = {"flash": True, "te": True}, {"flash": False, "te": False}
    assert choose_backend("auto", cuda=False, dtype=bf16, installed=both) == "sdpa"
    assert choose_backend("auto", cuda=True, dtype=bf16, installed=both) == "flash"
    assert choose_backend("auto", cuda=True, dtype=fp32, installed=both) == "te"  # flash takes no fp32
    assert choose_backend("auto", cuda=True, dtype=bf16, installed={"flash": False, "te": True}) == "te"
    assert choose_backend("auto", cuda=True, dtype=bf16, installed=none) == "sdpa"
    assert choose_backend("auto", cuda=True, dtype=fp32, installed={"flash": True, "te": False}) == "sdpa"
    assert choose_backend("sdpa", cuda=True, dtype=fp32, installed=none) == "sdpa"
    with pytest.raises(ValueError, match="needs flash-attn"):
        choose_backend("flash", cuda=True, dtype=bf16, installed=none)
    with pytest.raises(ValueError, match="fp16 or bf16"):
        choose_backend("flash", cuda=True, dtype=fp32, installed=both)
    with pytest.raises(ValueError, match="needs a GPU"):
        choose_backend("te", cuda=False, dtype=bf16, installed=both)
    with pytest.raises(ValueError, match="choose auto"):
        choose_backend("cudnn", cuda=True, dtype=bf16, installed=both)


def test_step_numbers_reach_megatron_tensorboard_and_wandb_writers(monkeypatch, tmp_path):
    """publish() hands each scalar to Megatron's TensorBoard writer (add_scalar) and its W&B writer
    (the wandb module: log(dict, step)) as flexsp/<name> at the iteration; evaluation records are not
    published; without writers nothing is called."""
    import megatron.training.global_vars as gv
    from megatron_flexsp.integration.records import StepRecorder

    class Board:
        def __init__(self):
            self.calls = []

        def add_scalar(self, name, value, step):
            self.calls.append((name, value, step))

    class Wandb:
        def __init__(self):
            self.calls = []

        def log(self, data, step=None):
            self.calls.append((dict(data), step))

    rec = {"step": 7, "loss": 2.5, "tokens": 4096, "run_ms": 900.0, "plan_wait_ms": 3.0, "dispatch_ms": 20.0,
           "switch_ms": 0.1, "max_micro_batches_per_rank": 2, "idle_ranks": 0, "predicted_ms": 1000.0,
           "gap": 0.02, "plan_source": "fallback-late", "group_sizes": [[2, 1, 1], [4]]}
    tb, wb = Board(), Wandb()
    monkeypatch.setattr(gv, "_GLOBAL_TENSORBOARD_WRITER", tb)
    monkeypatch.setattr(gv, "_GLOBAL_WANDB_WRITER", wb)
    recorder = StepRecorder(tmp_path, None, "flexsp")
    recorder.publish(rec, 12)
    board = {name: (value, step) for name, value, step in tb.calls}
    assert board["flexsp/run_ms"] == (900.0, 12) and board["flexsp/predicted_ms"] == (1000.0, 12)
    assert board["flexsp/measured_over_predicted"] == (pytest.approx(0.9), 12)
    assert board["flexsp/plan_fallback"] == (1.0, 12) and board["flexsp/plan_from_solver"] == (0.0, 12)
    assert board["flexsp/groups_of_1"] == (2, 12) and board["flexsp/groups_of_2"] == (1, 12)
    assert board["flexsp/groups_of_4"] == (1, 12) and board["flexsp/gap"] == (0.02, 12)
    assert len(wb.calls) == 1 and wb.calls[0][1] == 12
    assert wb.calls[0][0] == {name: value for name, (value, _) in board.items()}
    recorder.publish({**rec, "split": "valid"}, 13)  # evaluation batches go to Megatron's own eval log
    assert len(tb.calls) == len(board) and len(wb.calls) == 1
    monkeypatch.setattr(gv, "_GLOBAL_TENSORBOARD_WRITER", None)
    monkeypatch.setattr(gv, "_GLOBAL_WANDB_WRITER", None)
    recorder.publish(rec, 14)
    assert len(tb.calls) == len(board) and len(wb.calls) == 1
