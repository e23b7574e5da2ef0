"""Run under torchrun with 4 gloo ranks: Ulysses attention over heterogeneous groups vs one process.

Every rank builds the same random sequences (seeded), computes the single-process reference
(attention per sequence, loss = sum(out * w), gradients of q, k, v), then executes several
micro-batch plans mixing group sizes 1, 2 and 4 and compares its own shard of the output and of the
gradients with the reference rows. fp32 tolerance 1e-5: the distributed path only reorders rows and
splits heads, so differences come from summation order inside the attention kernel alone.
Prints "ALL CHECKS PASSED" on rank 0 when every check held on every rank.
"""

import sys

import torch
import torch.distributed as dist

import random

from megatron_flexsp.runtime.all_to_all import head_to_seq, seq_to_head
from megatron_flexsp.plan import GroupPlan, MicroBatchPlan, StepPlan
from megatron_flexsp.runtime.dispatch import dispatch, owner
from megatron_flexsp.runtime.executor import run_step
from megatron_flexsp.runtime.testing import (IGNORE, ToyTransformer, local_positions, shifted_labels,
                                             token_loss_sum)
from megatron_flexsp.runtime.attention import varlen_causal_attention
from megatron_flexsp.runtime.agreement import check_agreement
from megatron_flexsp.runtime.groups import SPGroupPool
from megatron_flexsp.runtime.layout import build_group_layout
from megatron_flexsp.runtime.ulysses import ulysses_attention
from megatron_flexsp.topology import ClusterSpec

TOL = dict(rtol=1e-5, atol=1e-5)
N_HEADS, HEAD_DIM = 4, 8


def make_data(lengths, n_kv, seed=0):
    g = torch.Generator().manual_seed(seed)
    data = []
    for L in lengths:
        q = torch.randn(L, N_HEADS, HEAD_DIM, generator=g)
        k = torch.randn(L, n_kv, HEAD_DIM, generator=g)
        v = torch.randn(L, n_kv, HEAD_DIM, generator=g)
        w = torch.randn(L, N_HEADS, HEAD_DIM, generator=g)
        data.append((q, k, v, w))
    return data


def reference(data):
    out = []
    for q, k, v, w in data:
        q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
        o = varlen_causal_attention(q, k, v, torch.tensor([0, q.shape[0]]), backend="reference")
        (o * w).sum().backward()
        out.append((o.detach(), q.grad, k.grad, v.grad))
    return out


def natural(tensors, lengths, layout):
    """Concatenate per-sequence tensors in natural padded order (zeros in the padding)."""
    T = int(layout.cu_seqlens[-1])
    out = torch.zeros((T,) + tensors[0].shape[1:], dtype=tensors[0].dtype)
    for s, (x, L) in enumerate(zip(tensors, lengths)):
        a = int(layout.cu_seqlens[s])
        out[a:a + L] = x
    return out


def run_plan(pool, plan, lengths, data, ref, rank, *, wrong_shard=False, kv_replication=False):
    """Execute every micro-batch of ``plan``; return the worst abs error seen on this rank."""
    worst = 0.0
    for mb in plan:
        for ranks, seqs in mb:
            if rank not in ranks:
                continue
            d, r = len(ranks), ranks.index(rank)
            lens = [lengths[s] for s in seqs]
            lay = build_group_layout(lens, d)
            idx = lay.local_index[(r + 1) % d if wrong_shard else r]
            q, k, v, w = (natural([data[s][j] for s in seqs], lens, lay)[idx] for j in range(4))
            q, k, v = (x.requires_grad_(True) for x in (q, k, v))
            o = ulysses_attention(q, k, v, group=pool.get(ranks), layout=lay, backend="sdpa",
                                  kv_replication=kv_replication)
            (o * w).sum().backward()
            mine = lay.local_index[r]
            real = lay.valid[mine]
            for got, j in ((o.detach(), 0), (q.grad, 1), (k.grad, 2), (v.grad, 3)):
                want = natural([ref[s][j] for s in seqs], lens, lay)[mine]
                if j == 0:  # outputs at padding rows are not defined (their loss weight is 0)
                    got, want = got[real], want[real]
                worst = max(worst, float((got - want).abs().max()))
    return worst


def random_plan(rng, n_seqs, world):
    """Micro-batches of (ranks, sequences) with random node-aligned group layouts (sizes 1, 2, 4)."""
    layouts = [[(0, 1, 2, 3)], [(0, 1), (2, 3)], [(0, 1), (2,), (3,)], [(0,), (1,), (2,), (3,)]]
    seqs = list(range(n_seqs))
    rng.shuffle(seqs)
    cut = rng.randint(1, n_seqs - 1)
    plan = []
    for part in (seqs[:cut], seqs[cut:]):
        groups = rng.choice(layouts)
        members = {g: [] for g in groups}
        for s in part:
            members[rng.choice(groups)].append(s)
        plan.append([(g, tuple(m)) for g, m in members.items() if m])
    return plan


def to_step_plan(plan, lengths, world):
    mbs = tuple(MicroBatchPlan(tuple(GroupPlan(tuple(r), tuple(sq), 0.0) for r, sq in mb)) for mb in plan)
    return StepPlan(num_gpus=world, gpus_per_node=2, seq_lens=tuple(lengths), micro_batches=mbs,
                    strategy="test", method="random", predicted_step_ms=0.0)


def transformer_checks(pool, rank, world):
    failures = []
    g = torch.Generator().manual_seed(7)
    lengths = [int(x) for x in torch.randint(3, 40, (9,), generator=g)]
    docs = [torch.randint(0, 64, (L,), generator=g) for L in lengths]
    total = sum(L - 1 for L in lengths)  # labelled tokens of the global batch
    # single-process reference: all documents in one "group" of one rank
    ref = ToyTransformer(seed=3)
    lay = build_group_layout(lengths, 1)
    toks = natural(docs, lengths, lay)
    labels = natural([shifted_labels(d) for d in docs], lengths, lay)
    labels[~lay.valid] = IGNORE
    pos = local_positions(lengths, 1, 0)
    ref_loss = token_loss_sum(ref(toks, pos, group=None, layout=lay), labels) / total
    ref_loss.backward()
    rng = random.Random(11)
    for p in range(4):
        plan = random_plan(rng, len(lengths), world)
        model = ToyTransformer(seed=3)
        mine = {s: torch.stack([docs[s], shifted_labels(docs[s])], dim=1)
                for s in range(len(docs)) if owner(s, world) == rank}
        step = to_step_plan(plan, lengths, world)

        def run_group(rows, positions, group, glay, _model=model, _step=step):
            tok, lab = rows.unbind(1)
            loss = token_loss_sum(_model(tok, positions, group=group, layout=glay), lab) / total
            loss.backward()
            return loss.detach()

        stats = run_step(step, pool=pool, rank=rank, loaded=mine, run_group=run_group,
                         num_heads=4, num_kv_heads=4, pad_value=(0, IGNORE), trailing=(2,))
        loss_sum = torch.tensor(stats.loss_sum, dtype=torch.float32)
        dist.all_reduce(loss_sum)
        for param in model.parameters():
            dist.all_reduce(param.grad)
        if abs(float(loss_sum) - float(ref_loss)) > 1e-5:
            failures.append(f"plan {p}: loss {float(loss_sum):.6f} vs reference {float(ref_loss):.6f}")
        for (name, a), b in zip(model.named_parameters(), ref.parameters()):
            # fp32; only the order of sums differs (attention kernel, gradient all-reduce)
            if not torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6):
                failures.append(f"plan {p}: gradient of {name} differs by "
                                f"{float((a.grad - b.grad).abs().max()):.2e}")
    return failures


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4, world
    pool = SPGroupPool(ClusterSpec(4, 2), [1, 2, 4])
    failures = []

    # 1. all-to-all round trip is exact, uneven token counts
    for ranks in ((0, 1), (2, 3), (0, 1, 2, 3)):
        if rank in ranks:
            counts = [3 + 2 * i for i in range(len(ranks))]
            me = ranks.index(rank)
            x = torch.arange(counts[me] * 4 * 5, dtype=torch.float32).reshape(counts[me], 4, 5) + 1000 * rank
            y = seq_to_head(x, group=pool.get(ranks), token_counts=counts)
            if y.shape != (sum(counts), 4 // len(ranks), 5):
                failures.append(f"seq_to_head shape {tuple(y.shape)}")
            back = head_to_seq(y, group=pool.get(ranks), token_counts=counts)
            if not torch.equal(back, x):
                failures.append(f"round trip on {ranks} is not exact")

    # 2. heterogeneous plans vs the single-process reference (MHA and GQA)
    lengths = [13, 7, 20, 5, 9, 16, 3, 11]
    plans = [
        [[((0, 1), [0, 1]), ((2,), [2]), ((3,), [3])], [((0, 1, 2, 3), [4, 5, 6, 7])]],
        [[((0, 1, 2, 3), [2, 0])], [((0, 1), [5]), ((2, 3), [1, 3, 4])], [((0,), [6]), ((1,), [7])]],
        [[((2, 3), [7, 6, 5]), ((0,), [4]), ((1,), [0, 1, 2, 3])]],
    ]
    for n_kv, rep in ((4, False), (2, False), (1, True)):
        data = make_data(lengths, n_kv, seed=n_kv)
        ref = reference(data)
        for p, plan in enumerate(plans):
            if n_kv == 2 and any(len(r) > 2 for mb in plan for r, _ in mb):
                continue  # 2 KV heads cannot be split over 4 ranks without replication
            err = run_plan(pool, plan, lengths, data, ref, rank, kv_replication=rep)
            if err > TOL["atol"] + 1e-5:
                failures.append(f"plan {p} (kv heads {n_kv}): max error {err:.2e}")

    # 3. GQA beyond the KV-head count without replication is refused
    data = make_data(lengths, 1)
    try:
        run_plan(pool, [[((0, 1, 2, 3), [0])]], lengths, data, reference(data), rank)
        failures.append("KV heads 1 on 4 ranks without replication did not raise")
    except ValueError as exc:
        if "replication" not in str(exc):
            failures.append(f"unexpected error text: {exc}")

    # 4. negative control: a shard paired with the wrong rank must fail the comparison
    data = make_data(lengths, 4)
    ref = reference(data)
    err = run_plan(pool, [[((0, 1, 2, 3), [0, 2, 5])]], lengths, data, ref, rank, wrong_shard=True)
    if err <= 1e-3:
        failures.append(f"negative control passed (max error {err:.2e}): the check cannot fail")

    # 5. dispatch delivers exactly this rank's shards (from the owners), for random plans
    rng = random.Random(5)
    docs = [torch.arange(L) + 1000 * s for s, L in enumerate(lengths)]
    mine = {s: docs[s] for s in range(len(docs)) if owner(s, world) == rank}
    for p in range(5):
        for mb in random_plan(rng, len(lengths), world):
            got = dispatch(mb, lengths, mine, pad_value=-1)
            want = torch.empty(0, dtype=torch.int64)
            for ranks, seqs in mb:
                if rank in ranks:
                    lens = [lengths[s] for s in seqs]
                    lay = build_group_layout(lens, len(ranks))
                    nat = natural([docs[s] for s in seqs], lens, lay)
                    nat[~lay.valid] = -1
                    want = nat[lay.local_index[ranks.index(rank)]]
            if not torch.equal(got, want):
                failures.append(f"dispatch plan {p}: wrong rows on rank {rank}")

    # 6. a small transformer with per-token loss: loss and every gradient equal one process
    failures += transformer_checks(pool, rank, world)

    # 7. plan agreement: equal plans pass; one rank with another plan makes every rank raise
    check_agreement('{"plan": 1}', 0)
    try:
        check_agreement('{"plan": 1}' if rank != 2 else '{"plan": 2}', 1)
        failures.append("plan mismatch did not raise")
    except RuntimeError as exc:
        if "rank 2 holds" not in str(exc) or "rank 0 holds" not in str(exc):
            failures.append(f"mismatch message lacks both hashes: {exc}")

    flags = torch.tensor([len(failures)], dtype=torch.int64)
    dist.all_reduce(flags)
    for f in failures:
        print(f"rank {rank}: FAIL {f}", flush=True)
    if rank == 0 and int(flags) == 0:
        print("ALL CHECKS PASSED", flush=True)
    dist.destroy_process_group()
    return 0 if int(flags) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
