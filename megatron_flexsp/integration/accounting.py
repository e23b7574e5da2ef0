"""The document accounting saved with every checkpoint, and checked on resume.

Each Megatron checkpoint gets ``iter_NNNNNNN/flexsp_data.json``: the train split's samples consumed,
the epochs its last batch drew from, the split's document counts, this run's totals and the data
settings (seed, lengths, over-length policy, split, blend, batch schedule). A resume refuses changed
settings (documents would be skipped or trained twice).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

from megatron_flexsp.utils.logging import get_logger

log = get_logger(__name__)

DATA_STATE_FORMAT = "megatron-flexsp-data"


class CheckpointAccounting:
    """``args``: Megatron's; ``data``: the run's :class:`StepDriver` (``data_acct``, ``batches``);
    ``recorder``: its totals."""

    def __init__(self, args, data, out_dir: Path, recorder) -> None:
        self.args, self.data, self.out_dir, self.recorder = args, data, Path(out_dir), recorder

    def data_state(self) -> dict:
        a = self.args
        blend = [str(x) for x in (a.data_path or [])] or None
        per_split = {k: getattr(a, f"{k}_data_path", None) for k in ("train", "valid", "test")}
        return {"seed": a.seed, "seq_length": a.seq_length, "over_length": a.flexsp_over_length,
                "split": a.split, "data_path": blend, "per_split_data_path": per_split,
                "mock_data": bool(getattr(a, "mock_data", False)), **self.data.batches.state(),
                "num_documents": self.data.data_acct.num_documents,
                "usable_documents": self.data.data_acct.usable_documents}

    def on_save(self, iteration: int) -> None:
        """Rank 0: write the document accounting next to Megatron's checkpoint of ``iteration``."""
        if dist.get_rank() != 0 or not self.args.save:
            return
        consumed = self.data.batches.start(iteration)
        acct = self.data.data_acct
        rec = {"format": DATA_STATE_FORMAT, "version": 2, "iteration": iteration,
               "next_step": iteration, "documents_consumed": consumed,
               "consumed_valid_samples": int(getattr(self.args, "consumed_valid_samples", 0) or 0),
               "data": self.data_state(), "dataset": acct.to_dict(), "this_run": dict(self.recorder.totals)}
        folder = Path(self.args.save) / f"iter_{iteration:07d}"
        folder = folder if folder.is_dir() else self.out_dir
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "flexsp_data.json").write_text(json.dumps(rec, indent=1))
        log.info("data accounting at iteration %d: %d train samples consumed, this run %d documents, "
                 "%d truncated; train split: %d dropped short, %d dropped long", iteration, consumed,
                 self.recorder.totals["documents"], self.recorder.totals["truncated_documents"],
                 acct.dropped_too_short, acct.dropped_too_long)

    def check_resume(self) -> None:
        """On resume, the saved data settings must equal this run's (else documents would be skipped
        or repeated): ``ValueError`` naming the differing values."""
        it = int(getattr(self.args, "iteration", 0) or 0)
        if not it or not self.args.load:
            return
        path = Path(self.args.load) / f"iter_{it:07d}" / "flexsp_data.json"
        if not path.exists():
            log.warning("resuming at iteration %d without %s: document accounting starts here", it, path)
            return
        saved = json.loads(path.read_text())
        if saved.get("version") != 2:
            raise ValueError(f"{path}: data accounting version {saved.get('version')!r}, this build "
                             f"writes version 2 (documents were drawn differently)")
        now = self.data_state()
        diff = {k: (saved["data"].get(k), v) for k, v in now.items() if saved["data"].get(k) != v}
        if diff:
            raise ValueError(f"resuming from {path}: the data settings changed (saved, now): {diff}; "
                             f"documents would be skipped or trained twice")
        log.info("resume: %d train samples consumed before, data settings unchanged",
                 saved["documents_consumed"])
