"""Pictures of plans (matplotlib, imported lazily; entry-level module, not used by the planner)."""

from __future__ import annotations

from megatron_flexsp.cost_model import CostModel
from megatron_flexsp.plan import StepPlan


def plot_plan(plan: StepPlan, cm: CostModel, path: str, *, title: str = "") -> None:
    """Gantt chart of ``plan``: ranks on the y axis, time on the x axis, micro-batches side by side.

    Each group is a band as tall as its size; inside it the fixed cost (grey) and one bar per
    sequence, coloured by length. Writes a PNG to ``path``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import cm as mcm
    from matplotlib.colors import LogNorm

    lens = plan.seq_lens
    longest = max([lens[i] for mb in plan.micro_batches for g in mb.groups for i in g.seqs] or [1])
    norm = LogNorm(vmin=max(1, min(lens) if lens else 1), vmax=max(2, longest))
    cmap = matplotlib.colormaps["viridis"]
    fig, ax = plt.subplots(figsize=(12, max(3.0, min(12.0, plan.num_gpus / 6))))
    start = 0.0
    for j, mb in enumerate(plan.micro_batches):
        for g in mb.groups:
            y0, h = g.ranks[0], g.size
            fixed = cm.group_fixed_ms(g.size)
            ax.broken_barh([(start, fixed)], (y0, h), facecolors="lightgrey", edgecolors="none")
            x = start + fixed
            widths = cm.seq_time_ms([lens[i] for i in g.seqs], g.size)
            for i, width in zip(g.seqs, widths):
                ax.broken_barh([(x, width)], (y0 + 0.05, h - 0.1), facecolors=cmap(norm(lens[i])),
                               edgecolors="white", linewidth=0.3)
                x += width
        ax.axvline(start, color="black", linewidth=0.6)
        ax.text(start, plan.num_gpus + 0.3, f"mb {j}", fontsize=7)
        start += mb.predicted_ms
    ax.set_xlim(0, start * 1.01)
    ax.set_ylim(plan.num_gpus + 1.5, 0)
    ax.set_xlabel("time (ms)")
    ax.set_ylabel("rank")
    ax.set_title(title or f"{plan.strategy} ({plan.method}): step {plan.predicted_step_ms:.0f} ms, "
                          f"{len(plan.micro_batches)} micro-batches")
    fig.colorbar(mcm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, label="sequence length (tokens)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
