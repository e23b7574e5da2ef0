"""Megatron GPT pretraining with FlexSP (heterogeneous sequence parallelism).

The training integration (Megatron's ``pretrain()`` with ``--flexsp``) is issue 4 and not part of
this build yet. What works today is the plan-only mode, which needs no GPU and no Megatron::

    python pretrain_gpt_flexsp.py --flexsp-plan-only --lengths FILE --global-batch 512 \\
        --num-gpus 64 --gpus-per-node 8 --profile a100-paper --model gpt-7b --max-seq-len 196608

It plans and prints the steps exactly like ``flexsp plan`` (same arguments).
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    if "--flexsp-plan-only" not in argv:
        sys.stderr.write("pretrain_gpt_flexsp.py: training through Megatron is not available in this "
                         "build (see README, issue 4); use --flexsp-plan-only to plan steps.\n")
        return 2
    from megatron_flexsp.cli import main as cli_main

    rest = [a for a in argv if a != "--flexsp-plan-only"]
    return cli_main(["plan", *rest])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
