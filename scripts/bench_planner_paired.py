#!/usr/bin/env python
"""Paired planner benchmark: flexsp alone on the sweep's hardest cells, batch by batch.

The sweep (``bench_planner.py --sweep``) reports how many cells meet the gap targets; with four
batches a cell and a wall-clock budget, that count moves by a few cells between two runs of the
same code. This benchmark measures a change instead: the same batches (14 cells of 64 GPUs, four
batches each by default) planned at each budget of ``--budgets``, every batch's step time, proven
bound, gap and plan time, and each budget's plans against the lowest budget's (more time should
never cost plan quality: the worst batch is shown); with ``--baseline`` (an earlier run's JSON)
the mean change of the plans and of the bounds on the same batches, and how many plans got faster
or slower.

Runs apart in time differ by more than many changes are worth: two runs of the same code an hour
apart differed by 0.12% in mean plan time (and -0.11% in bounds) on this machine, as its speed
drifted. ``--against REV`` (a git revision, checked out into a temporary worktree, or a folder
holding another checkout) measures side by side in one run instead: two worker processes, one per
tree, plan every batch in turn (alternating which goes first, never at once, so both see the same
machine), ``--repeats`` times; the table gives the mean paired change with its 95% interval over
the batches, and, from the second repeat on, how far the revision's repeats differ from each other.

    python scripts/bench_planner_paired.py --md docs/planner-paired.md --out out/bench_planner_paired.json
    python scripts/bench_planner_paired.py --baseline out/bench_planner_paired.json --out out/after.json
    python scripts/bench_planner_paired.py --against HEAD --budgets 1 --repeats 2 --out out/ab.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_flexsp.config import PlannerConfig  # noqa: E402
from megatron_flexsp.cost_model import CostModel, load_profile  # noqa: E402
from megatron_flexsp.model_spec import get_model  # noqa: E402
from megatron_flexsp.planner import plan_step  # noqa: E402
from megatron_flexsp.sim.corpora import synthetic_lengths  # noqa: E402
from megatron_flexsp.sim.workloads import load_lengths, sample_batches  # noqa: E402
from megatron_flexsp.utils.report import header_lines, machine_speed, provenance, write_outputs  # noqa: E402

WIKI = ROOT.parent / "shared" / "seqlen" / "flexsp_wikipedia_seqlens.txt"
#: (corpus, global batch) at 64 GPUs: the sweep cells with the largest gaps
HARD_CELLS = ("wikipedia:2048,wikipedia:4096,github:1024,github:2048,commoncrawl:2048,commoncrawl:4096,"
              "lognormal-1k:4096,lognormal-4k:512,lognormal-4k:1024,lognormal-4k:2048,lognormal-4k:4096,"
              "pareto-1.1:2048,pareto-1.1:4096,pareto-1.5:4096")


def add_sample_args(ap: argparse.ArgumentParser, cells: str, batches: int) -> None:
    """The arguments :func:`sample` and :func:`cost_model` read: the cells, batches per cell and
    their seed, and the cluster and model to plan for (``cells``, ``batches``: the defaults)."""
    ap.add_argument("--cells", default=cells, help="corpus:global_batch,... at --gpus (default: %(default)s)")
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--batches", type=int, default=batches, help="batches per cell")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default="a100-paper")
    ap.add_argument("--model", default="gpt-7b")
    ap.add_argument("--max-seq-len", type=int, default=196608)


def cost_model(args) -> CostModel:
    """The cost model of ``args``' profile, model, GPUs and longest sequence (:func:`add_sample_args`)."""
    return CostModel.from_profile(load_profile(args.profile), get_model(args.model), num_gpus=args.gpus,
                                  max_seq_len=args.max_seq_len)


def sample(args) -> dict[tuple[str, int], list[np.ndarray]]:
    """The batches of every cell of ``args.cells`` (sequence lengths, tokens)."""
    batches = {}
    for corpus, gb in ((c, int(gb)) for c, gb in (x.split(":") for x in args.cells.split(","))):
        lens = load_lengths(WIKI) if corpus == "wikipedia" else synthetic_lengths(corpus, seed=1)
        batches[corpus, gb], _ = sample_batches(lens, global_batch=gb, num_batches=args.batches, seed=args.seed,
                                                max_seq_len=args.max_seq_len)
    return batches


def plan_cells(args, cm: CostModel) -> list[dict]:
    """Every batch of every cell at every budget: step ms, bound ms, gap, plan s, method."""
    batches = sample(args)
    # one untimed plan first: the first call imports and initialises HiGHS, which is not planning time
    plan_step(next(iter(batches.values()))[0], cm, config=PlannerConfig(over_length="truncate", time_budget_s=0.2),
              max_seq_len=args.max_seq_len)
    gc.freeze()  # the results kept so far stay out of the garbage collector's passes
    rows = []
    for budget in args.budgets:
        cfg = PlannerConfig(over_length="truncate", time_budget_s=budget)
        t0 = time.perf_counter()
        for (corpus, gb), bs in batches.items():
            for k, b in enumerate(bs):
                start = time.perf_counter()
                plan = plan_step(b, cm, config=cfg, max_seq_len=args.max_seq_len)
                rows.append({"cell": f"{corpus}:{gb}", "batch": k, "budget_s": budget,
                             "step_ms": plan.predicted_step_ms, "bound_ms": plan.lower_bound_ms, "gap": plan.gap,
                             "plan_s": time.perf_counter() - start, "method": plan.method,
                             "micro_batches": len(plan.micro_batches)})
        print(f"budget {budget:g} s: {len(rows)} plans so far ({time.perf_counter() - t0:.0f} s)",
              file=sys.stderr, flush=True)
    return rows


#: A worker process of ``--against``: plans the batches it is sent with the tree at ``argv[1]``
#: (its first request also plans once, untimed, as :func:`plan_cells` does). Answers are the lines
#: that start with ``_ANSWER`` (HiGHS prints its banner on the same stream).
_ANSWER = "@@plan "
_WORKER = f"""
import gc, json, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import numpy as np
import megatron_flexsp
if not Path(megatron_flexsp.__file__).resolve().is_relative_to(Path(sys.argv[1]).resolve()):
    sys.exit(f"megatron_flexsp came from {{megatron_flexsp.__file__}}, not from {{sys.argv[1]}}")
from megatron_flexsp.config import PlannerConfig
from megatron_flexsp.cost_model import CostModel, load_profile
from megatron_flexsp.model_spec import get_model
from megatron_flexsp.planner import plan_step
spec = json.loads(sys.stdin.readline())
cm = CostModel.from_profile(load_profile(spec["profile"]), get_model(spec["model"]), num_gpus=spec["gpus"],
                            max_seq_len=spec["max_seq_len"])
warm = True
for line in sys.stdin:
    req = json.loads(line)
    lens = np.asarray(req["lens"], dtype=np.int64)
    if warm:
        plan_step(lens, cm, config=PlannerConfig(over_length="truncate", time_budget_s=0.2),
                  max_seq_len=spec["max_seq_len"])
        gc.freeze()
        warm = False
    start = time.perf_counter()
    plan = plan_step(lens, cm, config=PlannerConfig(over_length="truncate", time_budget_s=req["budget"]),
                     max_seq_len=spec["max_seq_len"])
    out = {{"step_ms": plan.predicted_step_ms, "bound_ms": plan.lower_bound_ms, "gap": plan.gap,
           "plan_s": time.perf_counter() - start, "method": plan.method,
           "micro_batches": len(plan.micro_batches)}}
    sys.stdout.write({_ANSWER!r} + json.dumps(out) + "\\n")
    sys.stdout.flush()
"""


class _Worker:
    """One worker process planning with the checkout at ``root``."""

    def __init__(self, root: Path, spec: dict, log: Path) -> None:
        self.root, self.log = root, log
        self.err = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-c", _WORKER, str(root)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.err, text=True, cwd=root)
        self._send(spec)

    def _send(self, obj: dict) -> None:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def plan(self, lens: np.ndarray, budget: float) -> dict:
        self._send({"lens": [int(x) for x in lens], "budget": budget})
        for line in self.proc.stdout:
            if line.startswith(_ANSWER):
                return json.loads(line[len(_ANSWER):])
        self.err.flush()
        raise RuntimeError(f"the worker for {self.root} ended (status {self.proc.wait()}): "
                           f"{self.log.read_text()[-3000:]}")

    def close(self) -> None:
        with contextlib.suppress(OSError):  # a worker that failed has closed its end already
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.err.close()


@contextlib.contextmanager
def checkout(rev: str):
    """A folder holding ``rev``: the folder itself when ``rev`` is one, else a temporary git worktree
    of that revision (removed afterwards)."""
    if Path(rev).is_dir():
        if not (Path(rev) / "megatron_flexsp" / "__init__.py").is_file():
            raise ValueError(f"--against {rev!r} is a folder without megatron_flexsp/ (not a checkout)")
        yield Path(rev).resolve()
        return
    tmp = Path(tempfile.mkdtemp(prefix="flexsp-against-"))
    tree = tmp / "tree"
    made = subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev],
                          capture_output=True, text=True)
    if made.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ValueError(f"--against {rev!r} is neither a folder nor a git revision: {made.stderr.strip()}")
    try:
        yield tree
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)


def plan_side_by_side(args, against: Path) -> list[dict]:
    """Every batch at every budget, ``args.repeats`` times, by this tree and by ``against`` in turn
    (which plans first alternates from batch to batch and repeat to repeat): rows as in
    :func:`plan_cells` with ``version`` (``this`` or ``against``) and ``repeat``."""
    batches = sample(args)
    spec = {"profile": args.profile, "model": args.model, "gpus": args.gpus, "max_seq_len": args.max_seq_len}
    logs = Path(tempfile.mkdtemp(prefix="flexsp-workers-"))
    workers = {"this": _Worker(ROOT, spec, logs / "this.log"), "against": _Worker(against, spec, logs / "against.log")}
    rows = []
    try:
        t0 = time.perf_counter()
        for repeat in range(args.repeats):
            for budget in args.budgets:
                turn = repeat
                for (corpus, gb), bs in batches.items():
                    for k, b in enumerate(bs):
                        turn += 1
                        for version in (("this", "against") if turn % 2 else ("against", "this")):
                            rows.append({"cell": f"{corpus}:{gb}", "batch": k, "budget_s": budget,
                                         "version": version, "repeat": repeat, **workers[version].plan(b, budget)})
                print(f"repeat {repeat + 1}/{args.repeats}, budget {budget:g} s: {len(rows)} plans so far "
                      f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    finally:
        for w in workers.values():
            w.close()
        shutil.rmtree(logs, ignore_errors=True)
    return rows


def _change(pairs: list[tuple[float, float]]) -> str:
    """Mean of ``b / a - 1`` over the pairs with its 95% interval (normal, over the pairs)."""
    d = np.array([b / a - 1 for a, b in pairs])
    half = 1.96 * d.std(ddof=1) / np.sqrt(len(d)) if len(d) > 1 else float("nan")
    return f"{d.mean():+.3%} ± {half:.3%}"


def side_by_side_table(rows: list[dict]) -> list[str]:
    """Per budget: this tree against the other, paired per batch (means over the repeats)."""
    lines = ["| budget s | batches | repeats | gap mean this / against | plan p99 s this / against | "
             "plans this vs against (mean ± 95%) | faster / slower | bounds this vs against | "
             "against: repeat 2 vs 1 |", "|---|---|---|---|---|---|---|---|---|"]
    for budget in sorted({r["budget_s"] for r in rows}):
        mine = [r for r in rows if r["budget_s"] == budget]
        runs: dict[tuple, list[dict]] = {}  # (version, cell, batch) -> its repeats
        for r in mine:
            runs.setdefault((r["version"], r["cell"], r["batch"]), []).append(r)
        keys = list(dict.fromkeys((r["cell"], r["batch"]) for r in mine))

        def pairs(field):  # (against, this) per batch, each the mean over the repeats
            return [tuple(float(np.mean([r[field] for r in runs[v, *k]])) for v in ("against", "this"))
                    for k in keys]
        plans, bounds = pairs("step_ms"), pairs("bound_ms")
        gaps = {v: np.mean([r["gap"] for r in mine if r["version"] == v]) for v in ("this", "against")}
        p99 = {v: np.percentile([r["plan_s"] for r in mine if r["version"] == v], 99) for v in ("this", "against")}
        repeats = max(r["repeat"] for r in mine) + 1
        noise = "needs 2 repeats"
        if repeats > 1:
            first = {(r["cell"], r["batch"]): r["step_ms"] for r in mine if r["version"] == "against" and r["repeat"] == 0}
            noise = _change([(first[(r["cell"], r["batch"])], r["step_ms"]) for r in mine
                             if r["version"] == "against" and r["repeat"] == 1])
        ratio = np.array([b / a - 1 for a, b in plans])
        lines.append(f"| {budget:g} | {len(keys)} | {repeats} | {gaps['this']:.2%} / {gaps['against']:.2%} | "
                     f"{p99['this']:.2f} / {p99['against']:.2f} | {_change(plans)} | "
                     f"{int((ratio < -1e-4).sum())} / {int((ratio > 1e-4).sum())} | {_change(bounds)} | {noise} |")
    return lines


def table(rows: list[dict], baseline: list[dict] | None) -> list[str]:
    """One line per budget: gap mean / median / max, plan p99, the plans against the lowest budget's
    (mean / worst), and the paired change against ``baseline``."""
    before = {(r["cell"], r["batch"], r["budget_s"]): r for r in baseline or []}
    low = min(r["budget_s"] for r in rows)
    at_low = {(r["cell"], r["batch"]): r["step_ms"] for r in rows if r["budget_s"] == low}
    head = ("| budget s | batches | gap mean | gap median | gap max | plan p99 s | "
            f"plans vs {low:g} s (mean / worst) |")
    sep = "|---|---|---|---|---|---|---|"
    if baseline is not None:
        head += " plans vs baseline (mean) | faster / slower | bounds vs baseline (mean) |"
        sep += "---|---|---|"
    lines = [head, sep]
    for budget in sorted({r["budget_s"] for r in rows}):
        mine = [r for r in rows if r["budget_s"] == budget]
        gaps = np.array([r["gap"] for r in mine])
        line = (f"| {budget:g} | {len(mine)} | {gaps.mean():.2%} | {np.median(gaps):.2%} | {gaps.max():.2%} | "
                f"{np.percentile([r['plan_s'] for r in mine], 99):.2f} |")
        # more budget should not cost plan quality: each batch against its plan at the lowest budget
        vs_low = np.array([r["step_ms"] / at_low[r["cell"], r["batch"]] - 1 for r in mine])
        line += f" {vs_low.mean():+.3%} / {vs_low.max():+.3%} |" if budget != low else " |"
        if baseline is not None:
            pairs = [(before[k], r) for r in mine if (k := (r["cell"], r["batch"], r["budget_s"])) in before]
            if pairs:
                plan = np.array([b["step_ms"] / a["step_ms"] - 1 for a, b in pairs])
                bound = np.array([b["bound_ms"] / a["bound_ms"] - 1 for a, b in pairs])
                line += (f" {plan.mean():+.3%} | {int((plan < -1e-4).sum())} / {int((plan > 1e-4).sum())} | "
                         f"{bound.mean():+.3%} |")
            else:
                line += " no common batches | | |"
        lines.append(line)
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_sample_args(ap, HARD_CELLS, 4)
    ap.add_argument("--budgets", default="1,4", help="planner time budgets (s), each over every batch")
    ap.add_argument("--baseline", default=None, help="an earlier run's JSON: paired changes per budget")
    ap.add_argument("--against", default=None,
                    help="a git revision or a folder with another checkout: both planned side by side in this run")
    ap.add_argument("--repeats", type=int, default=1, help="with --against: passes over every batch")
    ap.add_argument("--out", default="out/bench_planner_paired.json")
    ap.add_argument("--md", default=None, help="write the markdown table here")
    args = ap.parse_args()
    args.budgets = [float(x) for x in args.budgets.split(",")]
    if min(args.budgets) <= 0:
        raise ValueError(f"--budgets {args.budgets}: every budget must be > 0 seconds")
    if args.repeats < 1:
        raise ValueError(f"--repeats {args.repeats} must be >= 1")
    if args.against and args.baseline:
        raise ValueError("--against and --baseline are two ways to compare: give one")
    result, lines = side_by_side_report(args) if args.against else paired_report(args)
    print("\n".join(lines))
    for path in write_outputs(args.out, result, args.md, lines if args.md else None):
        print(f"wrote {path}")
    return 0


def side_by_side_report(args) -> tuple[dict, list[str]]:
    """``--against``: the rows of :func:`plan_side_by_side` and their table."""
    with checkout(args.against) as tree:
        commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True).stdout.strip() or "unknown"
        result = {"provenance": provenance(profile=args.profile, model=args.model, num_gpus=args.gpus,
                                           max_seq_len=args.max_seq_len, cells=args.cells,
                                           against=f"{args.against} (commit {commit})",
                                           machine=machine_speed()),
                  "rows": plan_side_by_side(args, tree)}
    lines = header_lines("Paired planner benchmark, side by side", result["provenance"])
    lines += side_by_side_table(result["rows"])
    lines += ["", "Each batch planned by both trees in turn, in the same run; changes are this tree's "
              "over the other's, per batch (means over the repeats), with a 95% interval over the "
              "batches. The last column compares the other tree with itself between repeats."]
    return result, lines


def paired_report(args) -> tuple[dict, list[str]]:
    """This tree alone (against ``--baseline``, an earlier run's JSON, when given): rows and tables."""
    cm = cost_model(args)
    before = json.loads(Path(args.baseline).read_text()) if args.baseline else None
    baseline = before["rows"] if before else None
    named = f"{args.baseline} (commit {before['provenance'].get('commit', 'unknown')})" if before else None
    result = {"provenance": provenance(profile=args.profile, model=args.model, num_gpus=args.gpus,
                                       max_seq_len=args.max_seq_len, cells=args.cells, baseline=named,
                                       machine=machine_speed()),
              "rows": plan_cells(args, cm)}
    lines = header_lines("Paired planner benchmark", result["provenance"]) + table(result["rows"], baseline)
    lines += ["", "Gaps are against each plan's own proven bound; plan times are wall time on one core. "
              "Per cell (median / max gap at each budget):", "",
              "| cell | " + " | ".join(f"{b:g} s" for b in args.budgets) + " |",
              "|---|" + "---|" * len(args.budgets)]
    for cell in dict.fromkeys(r["cell"] for r in result["rows"]):
        parts = []
        for budget in args.budgets:
            gaps = [r["gap"] for r in result["rows"] if r["cell"] == cell and r["budget_s"] == budget]
            parts.append(f"{np.median(gaps):.2%} / {max(gaps):.2%}")
        lines.append(f"| {cell} | " + " | ".join(parts) + " |")
    return result, lines


if __name__ == "__main__":
    raise SystemExit(main())
