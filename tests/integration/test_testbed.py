"""Two emulated nodes (network namespaces, a shaped veth link): Megatron with --flexsp on 2 x 2 gloo
ranks, launched as the Slurm script launches it (torchrun --nnodes 2 --node-rank i, c10d rendezvous
at node 0's address). Skipped with a message where namespaces cannot be created."""

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("megatron.training")

from tests.integration.megatron_runs import build_dataset, run_pretrain  # noqa: E402


def test_two_node_smoke(tmp_path):
    data = build_dataset(tmp_path / "data" / "docs")
    out = tmp_path / "run"
    run = run_pretrain(out, data, ["--flexsp"], steps=3, seq_length=2048, gbs=16, timeout=600,
                       testbed={"rate": "400mbit"})
    if run.returncode == 77:
        pytest.skip(run.log.strip().splitlines()[-1])
    assert run.returncode == 0, run.log[-6000:]
    steps = run.steps
    assert [s["step"] for s in steps] == [0, 1, 2]
    assert all(math.isfinite(s["loss"]) and s["tokens"] > 0 for s in steps)
    plans = [json.loads(x) for x in (out / "plans.jsonl").read_text().splitlines()]
    assert all(p["num_gpus"] == 4 and p["gpus_per_node"] == 2 for p in plans)
    # node-aligned groups inside a node: some group runs on both ranks of one node
    inside = [g for p in plans for mb in p["micro_batches"] for g in mb["groups"]
              if len(g["ranks"]) == 2 and g["ranks"][0] // 2 == g["ranks"][1] // 2]
    assert inside, [p["micro_batches"] for p in plans]
    assert "two_nodes.sh: nodes" in run.log
    assert not Path("/var/run/netns").exists() or not any(
        p.name.startswith("fsn") for p in Path("/var/run/netns").iterdir())  # cleaned up
