#!/usr/bin/env python
"""Plant small bugs one at a time in a copy of the repository and check that the tests catch each.

Every mutation replaces one exact piece of code (it must occur exactly once) in a fresh copy of the
tracked files, runs the tests that should catch it (``pytest -x``, the project's own virtual
environment) and counts it caught when they fail. The bugs cover positions, causal masks, the
all-to-all's splits and head order, KV-head replication, shard order, the loss mask and token count,
dispatch, the plan hash and check, the memory limit, the lower bound and the context-parallel
switch. Prints a table, writes JSON (``--out``) and a markdown report (``--md``); exit status 1 if a
bug survived.

    .venv/bin/python scripts/mutation_check.py --md docs/mutation-check.md [--only NAME ...]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_flexsp.utils.report import header_lines, provenance, write_outputs  # noqa: E402

DIST = "tests/runtime/test_distributed.py"
ATTN = "tests/runtime/test_layout_attention.py"
TRAIN = "tests/integration/test_megatron_train.py::test_flexsp_matches_plain_megatron_step_by_step"


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTATIONS = (
    Mutation("positions", "every token's position within its document off by one",
             "megatron_flexsp/runtime/layout.py",
             "return torch.cat([shard_positions(L, size, r, multiple) for L in lengths])",
             "return torch.cat([shard_positions(L, size, r, multiple) for L in lengths]) + 1", (DIST,)),
    Mutation("causal-sdpa", "the SDPA kernel attends to later tokens",
             "megatron_flexsp/runtime/attention.py", "is_causal=True, scale=scale)",
             "is_causal=False, scale=scale)", (ATTN,)),
    Mutation("causal-reference", "the reference kernel lets a token see the next one",
             "megatron_flexsp/runtime/attention.py", "device=q.device).triu(1)", "device=q.device).triu(2)",
             (ATTN,)),
    Mutation("alltoall-splits", "the all-to-all assumes every rank holds as many tokens as this one",
             "megatron_flexsp/runtime/all_to_all.py", "output_split_sizes=[c * n * H for c in counts],",
             "output_split_sizes=[counts[me] * n * H] * d,", (DIST,)),
    Mutation("head-order", "heads come back in the wrong order after attention",
             "megatron_flexsp/runtime/all_to_all.py",
             "return recv.reshape(d, t, n, H).permute(1, 0, 2, 3).reshape(t, d * n, H)",
             "return recv.reshape(d, t, n, H).permute(1, 2, 0, 3).reshape(t, d * n, H)", (DIST,)),
    Mutation("kv-replication", "KV heads replicated by repeat, not repeat_interleave",
             "megatron_flexsp/runtime/ulysses.py", "k_tKH = k_tKH.repeat_interleave(d // K, dim=1)",
             "k_tKH = k_tKH.repeat(1, d // K, 1)", (DIST,)),
    Mutation("shard-order", "a rank holds its two chunks in the other order",
             "megatron_flexsp/runtime/layout.py", "return torch.cat([first, second])",
             "return torch.cat([second, first])", (DIST,)),
    Mutation("dispatch-order", "dispatch reassembles a group's sequences in reverse",
             "megatron_flexsp/runtime/dispatch.py",
             "    for ranks, seqs in groups:\n        if me not in ranks:\n            continue\n        for s in seqs:",
             "    for ranks, seqs in groups:\n        if me not in ranks:\n            continue\n        for s in reversed(seqs):",
             (DIST,)),
    Mutation("plan-hash", "every plan hashes alike, so ranks with different plans go on",
             "megatron_flexsp/runtime/agreement.py",
             'return int.from_bytes(hashlib.sha256(plan_json.encode()).digest()[:7], "big")', "return 0",
             (DIST,)),
    Mutation("plan-once", "a plan may run a sequence twice",
             "megatron_flexsp/plan.py", "if i not in dropped and count != 1:",
             "if i not in dropped and count < 1:", ("tests/unit/test_topology_plan.py",)),
    Mutation("memory-limit", "groups may hold twice the tokens memory allows",
             "megatron_flexsp/cost_model/model.py", "return self.capacity_tokens * d\n",
             "return self.capacity_tokens * d * 2\n", ("tests/unit/test_planner.py",)),
    Mutation("bound-inflated", "the LP bound reports 10% more than it proves",
             "megatron_flexsp/planner/step_lp.py", "return float(h.getInfo().objective_function_value)",
             "return 1.1 * float(h.getInfo().objective_function_value)", ("tests/unit/test_level_bound.py",)),
    Mutation("bound-status", "a non-optimal LP status counts as infeasible",
             "megatron_flexsp/planner/step_lp.py", "if status == highspy.HighsModelStatus.kInfeasible:",
             "if status != highspy.HighsModelStatus.kOptimal:", ("tests/unit/test_level_bound.py",)),
    Mutation("lost-memory", "a slow sequence's group is taken to have no time left for anything else",
             "megatron_flexsp/planner/step_lp.py", "- np.maximum(room - sl.work, 0.0) / self.rate[d])",
             "- 0.0 / self.rate[d])", ("tests/unit/test_level_bound.py",)),
    Mutation("explicit-box", "the second slowest micro-batch is taken to be at most a third of the target",
             "megatron_flexsp/planner/box_search.py", "(target_ms - (m - p - 1) * f) / (p + 1)) for p in range(self.k))",
             "(target_ms - (m - p - 1) * f) / (2 * p + 1)) for p in range(self.k))",
             ("tests/unit/test_level_bound.py",)),
    Mutation("group-dff", "the LP counts a sequence that fits beside a slow one as unable to",
             "megatron_flexsp/planner/count_rows.py", "middle = ~heavy & (work > room - w_star + 1e-9 * room)",
             "middle = ~heavy & (work > 0.5 * (room - w_star))", ("tests/unit/test_guided.py",)),
    Mutation("time-dff-ceil", "a group is taken to hold only k - 1 sequences over 1/(k+1) of its time",
             "megatron_flexsp/planner/count_rows.py",
             "    out = np.floor((k + 1) * x - 1e-9)\n",
             "    out = np.ceil((k + 1) * x - 1e-9)\n", ("tests/unit/test_guided.py",)),
    Mutation("time-dff-off", "the relaxation fills groups with a few long sequences fluidly",
             "megatron_flexsp/planner/count_rows.py", "PER_GROUP_KS = (2, 3, 4)", "PER_GROUP_KS = ()",
             ("tests/unit/test_guided.py",)),
    Mutation("open-first-off", "stuffing with open groups first opens a group of the cheapest size first",
             "megatron_flexsp/planner/level.py", "if open_first and pos_r < len(rows):",
             "if False and pos_r < len(rows):", ("tests/unit/test_guided.py",)),
    Mutation("bucket-share", "a bucket goes wholly to a level its shortest member finishes within",
             "megatron_flexsp/planner/count_rows.py",
             "upper[self.pos] = np.where(done > 0, self.share[self.starts + np.maximum(done, 1) - 1], 0.0)",
             "upper[self.pos] = np.where(done > 0, 1.0, 0.0)", ("tests/unit/test_guided.py",)),
    Mutation("cap-probe", "a probe of the pooled cap counts the LP value for plans above the cap too",
             "megatron_flexsp/planner/step_lp.py", "best = max(best, min(g, base + mid))",
             "best = max(best, g)", ("tests/unit/test_level_bound.py",)),
    Mutation("cap-unrefined", "the pooled cap is never refined below the whole cap",
             "megatron_flexsp/planner/step_lp.py", "best = max(best, min(g, base + mid))",
             "best = max(best, min(g, base + mid)) if False else best", ("tests/unit/test_level_bound.py",)),
    Mutation("guided-hint-ignored", "the rounding ignores where the relaxation put the long sequences",
             "megatron_flexsp/planner/guided.py", "for level, singles in zip(hint.levels, hint.singles):",
             "for level, singles in ():", ("tests/unit/test_guided.py",)),
    Mutation("bucket-slow", "bucketed sequences too slow to share a group within the level count no group",
             "megatron_flexsp/planner/step_lp.py",
             "append((c, t_alone, tokens, longest, tokens / longest,",
             "append((c, t_alone, tokens, longest, 0.0,", ("tests/unit/test_level_bound.py",)),
    Mutation("bucket-slow-count", "a bucket's slow members are counted as if each were its shortest",
             "megatron_flexsp/planner/step_lp.py",
             "append((c, t_alone, tokens, longest, tokens / longest,",
             "append((c, t_alone, tokens, longest, tokens / lo,", ("tests/unit/test_level_bound.py",)),
    Mutation("bucket-tail-chord", "a bucket's tangent row becomes the chord of its members' count (above it)",
             "megatron_flexsp/planner/count_rows.py",
             "slope = np.where(tangent, high - low, 0.0)\n        rhs = np.where(tangent, high * share - total, math.inf)",
             "slope = np.where(tangent, total / np.maximum(share, 1e-300) - low, 0.0)\n"
             "        rhs = np.where(tangent, 0.0, math.inf)", ("tests/unit/test_count_rows.py",)),
    Mutation("bucket-tail-off", "a bucket of long sequences counts only its lowest count per token",
             "megatron_flexsp/planner/count_rows.py",
             "tangent = some & (total > 0.0) & (high > low)", "tangent = some & False",
             ("tests/unit/test_count_rows.py",)),
    Mutation("guided-rest-groups", "a rounding lays out the sequences it leaves by shelves only",
             "megatron_flexsp/planner/guided.py", "for tail in groups_first_layouts(tab, rest, deadline)]",
             "for tail in []]", ("tests/unit/test_guided.py",)),
    Mutation("drain-first-class", "the drain stops at the first class with room instead of once no class can beat the best found",
             "megatron_flexsp/planner/drain.py",
             "if best_key is not None and (raise_lo, t_lo) > best_key[:2]:", "if best_key is not None:",
             ("tests/unit/test_packing.py",)),
    Mutation("opening-sizes-level", "groups first opens every group at its bin or smallest size, whatever the level",
             "megatron_flexsp/planner/groups_first.py",
             "slow = finish[row0, np.arange(len(items))] > level",
             "slow = finish[row0, np.arange(len(items))] > math.inf", ("tests/unit/test_packing.py",)),
    Mutation("fill-level-off", "the stuffed first micro-batch is never tried where the rest fits one micro-batch fewer",
             "megatron_flexsp/planner/search.py",
             "    if m_min > 1:  # where the rest first fits one micro-batch fewer",
             "    if False:  # where the rest first fits one micro-batch fewer", ("tests/unit/test_guided.py",)),
    Mutation("stuffed-groups", "a stuffed first micro-batch's rest is never packed groups first",
             "megatron_flexsp/planner/search.py",
             "tails = groups_first_layouts(tab, left, deadline, dcp=True) if by_memory else []",
             "tails = []", ("tests/unit/test_guided.py",)),
    Mutation("tail-off", "a layout's tail is never re-planned",
             "megatron_flexsp/planner/tail.py", "    if best is not None:\n        layout[:]",
             "    if False:\n        layout[:]", ("tests/unit/test_tail.py",)),
    Mutation("split-two-balanced", "re-splitting a pair never tries the split balanced in time and tokens",
             "megatron_flexsp/planner/polish.py",
             "    if not deadline.expired():  # and balanced in GPU-time and tokens",
             "    if False:  # and balanced in GPU-time and tokens", ("tests/unit/test_polish.py",)),
    Mutation("split-slowest-off", "the slowest micro-batch is never split in two",
             "megatron_flexsp/planner/polish.py",
             "found = split_two(packer, mb_items(layout[a]), tab.mb_ms(layout[a]) * (1 - 1e-9), deadline)",
             "found = None", ("tests/unit/test_polish.py",)),
    Mutation("room-not-raised", "a group's freed memory does not reopen its class to the index's searches",
             "megatron_flexsp/planner/layout.py", "        if free > self.room.get(key, free - 1):",
             "        if key not in self.room:", ("tests/unit/test_packing.py",)),
    Mutation("runners-up-count-all", "runners-up the local search leaves as they were count among the runners",
             "megatron_flexsp/planner/polish.py", "        gained += candidates[j][0] < ms * (1 - 1e-9)\n",
             "        gained += 1\n", ("tests/unit/test_polish.py",)),
    Mutation("rank-by-step-time", "layouts are settled in the order of their step times, not of their searched copies",
             "megatron_flexsp/planner/polish.py",
             "    found.sort(key=lambda c: searched[id(c[2])][0] if id(c[2]) in searched else c[0])",
             "    found.sort(key=lambda c: c[0])", ("tests/unit/test_polish.py",)),
    Mutation("neighbourhood-keeps-slower", "a re-planned neighbourhood replaces its micro-batches even when slower",
             "megatron_flexsp/planner/neighbourhood.py",
             "        if new is not None and tab.step_ms(new) < before * (1 - 1e-9):",
             "        if new is not None:", ("tests/unit/test_neighbourhood.py",)),
    Mutation("touch-up-no-neighbourhoods", "the touch-up stops where its other moves stall, re-planning no neighbourhood",
             "megatron_flexsp/planner/polish.py",
             "            if packer is not None and replan_neighbourhoods(",
             "            if False and replan_neighbourhoods(", ("tests/unit/test_neighbourhood.py",)),
    Mutation("wide-pass-refloor", "the LP bound's second pass keeps the floors handed over, and stalls",
             "megatron_flexsp/planner/bound.py",
             "        refloor = None\n",
             "        refloor = refloor if run.refloor is not None else None\n",
             ("tests/unit/test_level_bound.py",)),
    Mutation("milp-proves-all", "every micro-batch MILP run counts as proving its micro-batch",
             "megatron_flexsp/planner/exact.py",
             "        proven += res.dual_bound_ms >= tab.mb_ms(layout[j]) * (1 - cfg.rel_gap)",
             "        proven += 1", ("tests/unit/test_milp_proof.py",)),
    Mutation("groups-needed-overcounts", "the homogeneous search starts above the groups every packing needs",
             "megatron_flexsp/planner/heuristics.py",
             "        steps = cap * np.arange(1, k + 1) / (k + 1)",
             "        steps = cap * np.arange(0, k) / (k + 1)",
             ("tests/unit/test_high_load.py",)),
    Mutation("homogeneous-size-order", "the homogeneous search tries sizes least GPU-time first again",
             "megatron_flexsp/planner/heuristics.py",
             "    order = sorted(starts, key=lambda d: (floor(d, starts[d]), gpu_time[d]))",
             "    order = sorted(starts, key=lambda d: gpu_time[d])",
             ("tests/unit/test_high_load.py",)),
    Mutation("dcp-past-deadline", "Megatron-DCP's greedy as a candidate ignores its deadline",
             "megatron_flexsp/planner/heuristics.py",
             "            if not pos & 4095 and deadline is not None and deadline.expired():",
             "            if False:", ("tests/unit/test_high_load.py",)),
    Mutation("homogeneous-ignores-plan-in-hand", "the homogeneous search looks for layouts slower than the plan in hand",
             "megatron_flexsp/planner/heuristics.py",
             "    best_ms, best_d, best_m, best_owner = faster_than, 0, 0, None",
             "    best_ms, best_d, best_m, best_owner = math.inf, 0, 0, None", ("tests/unit/test_high_load.py",)),
    Mutation("shelf-past-deadline", "a shelf past its deadline stuffs every candidate level first",
             "megatron_flexsp/planner/shelves.py",
             "                    if best is not None:  # the best level tried so far\n                        break",
             "                    if best is not None:  # the best level tried so far\n                        pass",
             ("tests/unit/test_high_load.py",)),
    Mutation("repack-past-deadline", "re-packing a micro-batch bisects its level to the end past the deadline",
             "megatron_flexsp/planner/level.py",
             "            found = self.min_level(items, hi=before, rel_tol=rel_tol, deadline=deadline)",
             "            found = self.min_level(items, hi=before, rel_tol=rel_tol)", ("tests/unit/test_high_load.py",)),
    Mutation("drain-index-past-deadline", "draining indexes every micro-batch's groups past its deadline",
             "megatron_flexsp/planner/drain.py",
             "        if not j & 1023 and deadline is not None and deadline.expired():",
             "        if False:", ("tests/unit/test_high_load.py",)),
    Mutation("no-room-for-a-pass", "phases start a pass over the whole layout with any time left",
             "megatron_flexsp/planner/layout.py",
             "    return deadline.left() >= PASS_S_PER_ITEM * (len(tab.lens) + len(layout))",
             "    return deadline.left() >= 0.0", ("tests/unit/test_high_load.py",)),
    Mutation("touch-up-off", "the chosen plan is never touched up",
             "megatron_flexsp/planner/polish.py",
             "            exchanged += balance_groups(mb, tab, deadline)\n",
             "            exchanged += 0\n", ("tests/unit/test_polish.py",)),
    Mutation("touch-up-once", "the touch-up makes one pass of exchanges and local search, not until neither gains",
             "megatron_flexsp/planner/polish.py",
             "        if tab.step_ms(layout) >= before * (1 - 1e-9):\n            if shed_slowest_groups",
             "        if True:\n            if shed_slowest_groups", ("tests/unit/test_polish.py",)),
    Mutation("local-search-prune", "the local search bounds a class's gain by any of its groups, not the least loaded",
             "megatron_flexsp/planner/layout.py", "t = f_d + heap[0][0] + times[i]",
             "t = f_d + heap[-1][0] + times[i]", ("tests/unit/test_polish.py",)),
    Mutation("exchange-one", "exchanges never swap one sequence for one",
             "megatron_flexsp/planner/exchange.py", "        ok = (dt > 0) & (slow.tokens",
             "        ok = (dt > 9e9) & (slow.tokens", ("tests/unit/test_polish.py",)),
    Mutation("exchange-shortest", "exchanges never give a sequence for a partner's shortest",
             "megatron_flexsp/planner/exchange.py", "        fine = (need > 0) & (n <= len(order))",
             "        fine = (need > 0) & (n <= 0)", ("tests/unit/test_polish.py",)),
    Mutation("shelf-levels", "shelves never try the finish times of the hardest sequences",
             "megatron_flexsp/planner/shelves.py", "for t in times if c0 < t <= 3 * c0}",
             "for t in times if False}", ("tests/unit/test_shelves.py",)),
    Mutation("slot-bound-count", "the slot bound counts every token of a bucket as a sequence needing a group",
             "megatron_flexsp/planner/slot_bound.py", "dff(lens_o, int(tab.cap[d]), k) / ln, starts)",
             "dff(lens_o, int(tab.cap[d]), k) / ln * 0 + 1.0, starts)",
             ("tests/unit/test_packing.py",)),
    Mutation("lp-rounding-ignored", "the slot LP's placement is dropped: every sequence at its smallest size",
             "megatron_flexsp/planner/slot_bound.py", "    return np.maximum(out, tab.min_size)\n",
             "    return tab.min_size.copy()\n", ("tests/unit/test_packing.py",)),
    Mutation("drain-any-cost", "draining keeps its moves even when they slow the step",
             "megatron_flexsp/planner/drain.py", "if best is None or raised + best_key[0] >= budget_ms:",
             "if best is None:", ("tests/unit/test_packing.py",)),
    Mutation("simple-bound", "the simple bound charges the largest GPU-time, not the least",
             "megatron_flexsp/planner/layout.py", "best = np.where(ok, np.minimum(best, d * self.time[d]), best)",
             "best = np.where(ok, d * self.time[d], best)",
             ("tests/unit/test_level_bound.py", "tests/unit/test_planner.py")),
    Mutation("loss-mask", "the loss counts each shard's padding rows",
             "megatron_flexsp/integration/microbatches.py", "mask = pos < per_row_len\n",
             "mask = pos <= per_row_len\n", (TRAIN,)),
    Mutation("token-count", "per-token loss divided by every row, labelled or not",
             "pretrain_gpt_flexsp.py", "num_tokens = mask.sum().to(torch.int)",
             "num_tokens = torch.tensor(mask.numel(), dtype=torch.int)", (TRAIN,)),
    Mutation("cp-switch", "the model's context-parallel group is not switched per micro-batch",
             "patches/context_parallel.py", "            pg.cp = group\n", "            pass\n", (TRAIN,)),
    Mutation("exit-handlers", "the script leaves without running the atexit handlers",
             "pretrain_gpt_flexsp.py", "    atexit._run_exitfuncs()\n", "    pass\n",
             ("tests/unit/test_entry_script.py::test_the_script_leaves_as_system_exit_would_after_the_exit_handlers",)),
)


def copy_repo(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    for f in files:
        src = ROOT / f
        if src.is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f)
    data = ROOT / "data"
    if data.exists():
        (dest / "data").symlink_to(data)


def run(m: Mutation, python: str, timeout: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="flexsp-mutant-") as tmp:
        copy = Path(tmp) / "repo"
        copy.mkdir()
        copy_repo(copy)
        shared = ROOT.parent / "shared"
        if shared.exists():
            (Path(tmp) / "shared").symlink_to(shared)
        target = copy / m.path
        text = target.read_text()
        if text.count(m.old) != 1:
            raise SystemExit(f"mutation {m.name}: the code to replace occurs {text.count(m.old)} times in {m.path}")
        target.write_text(text.replace(m.old, m.new))
        t0 = time.perf_counter()
        env = {"PYTHONPATH": str(copy), "PATH": "/usr/bin:/bin", "HOME": tmp, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *m.tests],
                              cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
        tail = [line for line in proc.stdout.splitlines() if "passed" in line or "failed" in line][-1:]
        return {"name": m.name, "what": m.what, "file": m.path, "tests": list(m.tests),
                "caught": proc.returncode != 0, "seconds": time.perf_counter() - t0,
                "pytest": tail[0] if tail else proc.stdout[-200:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", help="run only these mutations")
    ap.add_argument("--python", default=str(ROOT / ".venv" / "bin" / "python"))
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--out", default="out/mutation_check.json")
    ap.add_argument("--md", default=None)
    args = ap.parse_args()
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    results = []
    for m in chosen:
        r = run(m, args.python, args.timeout)
        results.append(r)
        print(f"{'caught' if r['caught'] else 'SURVIVED':8s} {m.name:18s} {r['seconds']:6.0f} s  {r['pytest']}",
              file=sys.stderr, flush=True)
    caught = sum(r["caught"] for r in results)
    lines = header_lines("Mutation check", provenance()) + [
        f"Score: {caught} of {len(results)} planted bugs caught.", "",
        "| bug | what it breaks | file | caught by | caught | seconds |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['name']} | {r['what']} | `{r['file']}` | {', '.join(f'`{t}`' for t in r['tests'])} | "
              f"{'yes' if r['caught'] else '**no**'} | {r['seconds']:.0f} |" for r in results]
    print("\n".join(lines))
    for path in write_outputs(args.out, {"provenance": provenance(), "results": results}, args.md,
                              lines if args.md else None):
        print(f"wrote {path}")
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
