"""Shared fixtures. No torch or megatron imports here: the default run is CPU-only and light."""

from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SEQLEN = ROOT.parent / "shared" / "seqlen" / "flexsp_wikipedia_seqlens.txt"


@pytest.fixture(scope="session")
def wiki_lengths() -> np.ndarray:
    if not SEQLEN.exists():
        pytest.skip(f"real Wikipedia lengths not found at {SEQLEN} (../shared/seqlen absent)")
    return np.loadtxt(SEQLEN, dtype=np.int64)


@pytest.fixture(scope="session")
def paper_cm():
    from megatron_flexsp.cost_model import CostModel, load_profile
    from megatron_flexsp.model_spec import get_model

    return CostModel.from_profile(load_profile("a100-paper"), get_model("gpt-7b"), num_gpus=64,
                                  max_seq_len=196608)
