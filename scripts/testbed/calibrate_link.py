#!/usr/bin/env python
"""The emulated inter-node link speed that gives the demo model GPT-7B's inter-node all-to-all share.

Under the ``a100-paper`` profile, GPT-7B's smallest inter-node group (16 GPUs, 2 nodes) is the one a
sequence just too long for one node (8 GPUs) must use; its all-to-all takes a share ``p`` of that
sequence's time. For the demo model (``cpu-gloo-measured`` compute) on the test bed, the smallest
inter-node group is 4 ranks (2 nodes x 2); a sequence just too long for one node takes a share ``p``
of its time in the all-to-all when each rank's all-to-all bandwidth is ``b``, solved here. In a
4-rank all-to-all every rank sends 1/4 of its data to each other rank, half of it across the link,
and the two ranks of a node send at once, so the link carries ``4/3 b`` per direction: the tbf
rate. Prints the derivation and the rate (Mbit/s).

    .venv/bin/python scripts/testbed/calibrate_link.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from megatron_flexsp.cost_model import CostModel, load_profile  # noqa: E402
from megatron_flexsp.model_spec import ModelSpec, get_model  # noqa: E402

DEMO = ModelSpec("gpt-2x64-4h", 2, 64, 4, ffn_hidden_size=256, vocab_size=384, dtype_bytes=4, swiglu=True)


def share(cm: CostModel, length: int, d: int) -> float:
    a2a = float(cm.alltoall_ms([length], d)[0])
    return a2a / (a2a + float(cm.compute_ms([length], d)[0]))


def main() -> int:
    paper = CostModel.from_profile(load_profile("a100-paper"), get_model("gpt-7b"), num_gpus=64,
                                   max_seq_len=196608)
    node = paper.cluster.gpus_per_node
    s_paper = paper.capacity_tokens * node + 1  # just too long for one node
    p = share(paper, s_paper, 2 * node)
    demo = CostModel.from_profile(load_profile("cpu-gloo-measured"), DEMO, num_gpus=4, max_seq_len=4096)
    s_demo = demo.capacity_tokens * demo.cluster.gpus_per_node + 1
    compute = float(demo.compute_ms([s_demo], 4)[0])
    sent = float(demo.alltoall_bytes([s_demo], 4)[0])  # bytes each rank sends, fwd + bwd, all layers
    a2a = p / (1 - p) * compute  # ms the all-to-all must take for the same share
    per_rank = sent / a2a  # bytes/ms of one rank
    link = per_rank * 4 / 3  # bytes/ms the link carries per direction
    mbit = link * 1e3 * 8 / 1e6
    print(f"GPT-7B (a100-paper): a {s_paper}-token sequence on {2 * node} GPUs spends {p:.1%} of its time "
          f"in the all-to-all")
    print(f"demo model (cpu-gloo-measured): a {s_demo}-token sequence on 4 ranks computes {compute:.1f} ms "
          f"and each rank sends {sent / 1e6:.2f} MB; the same share needs {a2a:.1f} ms, i.e. "
          f"{per_rank / 1e3:.2f} MB/s per rank, {link / 1e3:.2f} MB/s on the link")
    print(f"tbf rate: {mbit:.0f}mbit")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
