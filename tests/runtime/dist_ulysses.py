"""Run under torchrun with 4 gloo ranks: Ulysses attention over heterogeneous groups vs one process.

Every expected value comes from :mod:`tests.reference`, written without the runtime: per-document
causal attention in float64 with the GQA head grouping spelled out, shard rows from the layout's
definition (chunks r and 2d-1-r), positions from ``arange``, the toy transformer's forward from its
parameter tensors. Every rank builds the same random data (seeded), runs plans mixing group sizes
1, 2 and 4 (MHA, GQA, GQA with KV heads replicated over a group larger than their count) and
compares its own rows of the output and of every gradient with the reference (fp32 computation
against a float64 reference, tolerance 1e-5: only summation order differs); the transformer check
compares every per-token loss and every parameter gradient. Negative controls must fail.
Prints "ALL CHECKS PASSED" on rank 0 when every check held on every rank.
"""

import random
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_flexsp.plan import GroupPlan, MicroBatchPlan, StepPlan
from megatron_flexsp.runtime.agreement import check_agreement
from megatron_flexsp.runtime.all_to_all import head_to_seq, seq_to_head
from megatron_flexsp.runtime.dispatch import dispatch, owner
from megatron_flexsp.runtime.executor import run_step
from megatron_flexsp.runtime.groups import SPGroupPool
from megatron_flexsp.runtime.layout import build_group_layout
from megatron_flexsp.runtime.testing import ToyTransformer
from megatron_flexsp.runtime.ulysses import ulysses_attention
from megatron_flexsp.topology import ClusterSpec
from tests.reference import IGNORE, causal_attention, shard_rows, toy_token_losses

TOL = 1e-5
N_HEADS, HEAD_DIM = 4, 8


def make_data(lengths, n_kv, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(L, n, HEAD_DIM, generator=g) for n in (N_HEADS, n_kv, n_kv, N_HEADS))
            for L in lengths]


def reference(data):
    """Per document: output of sum(o * w) and the gradients of q, k, v (float64 reference)."""
    out = []
    for q, k, v, w in data:
        q, k, v = (x.double().requires_grad_(True) for x in (q, k, v))
        o = causal_attention(q, k, v)
        (o * w.double()).sum().backward()
        out.append(tuple(x.float() for x in (o.detach(), q.grad, k.grad, v.grad)))
    return out


def rows_of(tensors, lengths, d, r):
    """This rank's rows of documents ``tensors`` on a group of d (zeros in the padding)."""
    parts = []
    for x, L in zip(tensors, lengths):
        padded = torch.zeros((len(shard_rows(L, d, 0)) * d,) + x.shape[1:], dtype=x.dtype)
        padded[:L] = x
        parts.append(padded[shard_rows(L, d, r)])
    return torch.cat(parts)


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
            fed = (r + 1) % d if wrong_shard else r
            q, k, v, w = (rows_of([data[s][j] for s in seqs], lens, d, fed) for j in range(4))
            q, k, v = (x.requires_grad_(True) for x in (q, k, v))
            o = ulysses_attention(q, k, v, group=pool.get(ranks), layout=lay, backend="sdpa",
                                  kv_replication=kv_replication)
            (o * w).sum().backward()
            real = rows_of([torch.ones(L, dtype=torch.bool) for L in lens], lens, d, r)
            for got, j in ((o.detach(), 0), (q.grad, 1), (k.grad, 2), (v.grad, 3)):
                want = rows_of([ref[s][j] for s in seqs], lens, d, r)
                if j == 0:  # outputs at padding rows are not defined (their loss weight is 0)
                    got, want = got[real], want[real]
                worst = max(worst, float((got - want).abs().max()))
    return worst


def random_plan(rng, n_seqs):
    """Two micro-batches of (ranks, sequences) with random node-aligned layouts (sizes 1, 2, 4)."""
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


def transformer_checks(pool, rank, world, *, shift_positions=False):
    """Per-token losses and every gradient of the toy transformer, distributed vs the reference."""
    failures = []
    g = torch.Generator().manual_seed(7)
    lengths = [int(x) for x in torch.randint(3, 40, (9,), generator=g)]
    docs = [torch.randint(0, 64, (L,), generator=g) for L in lengths]
    total = sum(L - 1 for L in lengths)  # labelled tokens of the global batch
    ref = ToyTransformer(seed=3)
    ref_losses = toy_token_losses(ref, docs)
    (sum(ref_losses.values()) / total).backward()
    rng = random.Random(11)
    for p in range(4):
        plan = random_plan(rng, len(lengths))
        model = ToyTransformer(seed=3)
        mine = {s: torch.stack([docs[s], torch.cat([docs[s][1:], torch.tensor([IGNORE])])], dim=1)
                for s in range(len(docs)) if owner(s, world) == rank}
        step = to_step_plan(plan, lengths, world)
        got: dict = {}
        order = iter(_groups_of(step, rank))  # the executor runs this rank's groups in plan order

        def run_group(rows, positions, group, glay, _model=model, _got=got, _order=order):
            tok, lab = rows.unbind(1)
            if shift_positions:  # negative control: positions off by one
                positions = positions + 1
            logits = _model(tok, positions, group=group, layout=glay)
            losses = F.cross_entropy(logits, lab, ignore_index=IGNORE, reduction="none")
            (losses.sum() / total).backward()
            g = next(_order)
            at = 0
            for s in g.seqs:  # rows: each document's shard rows, in the group's order
                for pos in shard_rows(lengths[s], g.size, g.ranks.index(rank)):
                    if pos < lengths[s] - 1:
                        _got[s, pos] = float(losses[at])
                    at += 1
            return losses.sum().detach() / total

        run_step(step, pool=pool, rank=rank, loaded=mine, run_group=run_group, num_heads=4, num_kv_heads=4,
                 pad_value=(0, IGNORE), trailing=(2,))
        gathered = [None] * world
        dist.all_gather_object(gathered, got)
        every = {k: v for part in gathered for k, v in part.items()}
        for param in model.parameters():
            dist.all_reduce(param.grad)
        if set(every) != set(ref_losses):
            failures.append(f"plan {p}: token losses for {len(every)} tokens, expected {len(ref_losses)}")
        worst = max((abs(every[k] - float(ref_losses[k])) for k in every if k in ref_losses), default=0.0)
        if worst > TOL:
            failures.append(f"plan {p}: a per-token loss differs from the reference by {worst:.2e}")
        for (name, a), b in zip(model.named_parameters(), ref.parameters()):
            # fp32 against a float64 attention: summation order only
            if not torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6):
                failures.append(f"plan {p}: gradient of {name} differs by "
                                f"{float((a.grad - b.grad).abs().max()):.2e}")
    return failures


def _groups_of(step, rank):
    return [g for mb in step.micro_batches for g in mb.groups if rank in g.ranks]


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

    # 2. mixed group sizes in one micro-batch vs the reference: MHA, GQA, GQA with KV heads
    #    replicated over groups larger than their count (2 KV heads on a group of 4)
    lengths = [13, 7, 20, 5, 9, 16, 3, 11]
    plans = [
        [[((0, 1), [0, 1]), ((2,), [2]), ((3,), [3])], [((0, 1, 2, 3), [4, 5, 6, 7])]],
        [[((0, 1, 2, 3), [2, 0])], [((0, 1), [5]), ((2, 3), [1, 3, 4])], [((0,), [6]), ((1,), [7])]],
        [[((2, 3), [7, 6, 5]), ((0,), [4]), ((1,), [0, 1, 2, 3])]],
    ]
    for n_kv, rep in ((4, False), (2, False), (2, True), (1, True)):
        data = make_data(lengths, n_kv, seed=n_kv)
        ref = reference(data)
        for p, plan in enumerate(plans):
            if n_kv == 2 and not rep and any(len(r) > 2 for mb in plan for r, _ in mb):
                continue  # 2 KV heads cannot be split over 4 ranks without replication
            err = run_plan(pool, plan, lengths, data, ref, rank, kv_replication=rep)
            if err > TOL:
                failures.append(f"plan {p} (kv heads {n_kv}, replication {rep}): max error {err:.2e}")

    # 3. GQA beyond the KV-head count without replication is refused
    data = make_data(lengths, 1)
    try:
        run_plan(pool, [[((0, 1, 2, 3), [0])]], lengths, data, reference(data), rank)
        failures.append("KV heads 1 on 4 ranks without replication did not raise")
    except ValueError as exc:
        if "replication" not in str(exc):
            failures.append(f"unexpected error text: {exc}")

    # 4. negative controls: a shard given to the wrong rank, positions shifted by one
    data = make_data(lengths, 4)
    err = run_plan(pool, [[((0, 1, 2, 3), [0, 2, 5])]], lengths, data, reference(data), rank, wrong_shard=True)
    if err <= 1e-3:
        failures.append(f"negative control passed (max error {err:.2e}): the check cannot fail")
    if not transformer_checks(pool, rank, world, shift_positions=True):
        failures.append("positions shifted by one passed the transformer check: it cannot fail")

    # 5. dispatch delivers exactly this rank's shards (from the owners), for random plans
    rng = random.Random(5)
    docs = [torch.arange(L) + 1000 * s for s, L in enumerate(lengths)]
    mine = {s: docs[s] for s in range(len(docs)) if owner(s, world) == rank}
    for p in range(5):
        for mb in random_plan(rng, len(lengths)):
            got = dispatch(mb, lengths, mine, pad_value=-1)
            want = torch.empty(0, dtype=torch.int64)
            for ranks, seqs in mb:
                if rank in ranks:
                    lens = [lengths[s] for s in seqs]
                    padded = [torch.cat([docs[s], torch.full((len(shard_rows(L, len(ranks), 0)) * len(ranks) - L,), -1)])
                              for s, L in zip(seqs, lens)]
                    want = torch.cat([x[shard_rows(L, len(ranks), ranks.index(rank))] for x, L in zip(padded, lens)])
            if not torch.equal(got, want):
                failures.append(f"dispatch plan {p}: wrong rows on rank {rank}")

    # 6. a small transformer with per-token loss: every token's loss and every gradient
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
