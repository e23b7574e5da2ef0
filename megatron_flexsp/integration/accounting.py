"""The document accounting saved with every checkpoint, and checked on resume.

Each Megatron checkpoint gets ``iter_NNNNNNN/flexsp_data.json``: documents consumed, epoch and
position in it, the dataset's counts, this run's totals and the sampler's settings. A resume
refuses a changed sampler (documents would be skipped or trained twice).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

from megatron_flexsp.utils.logging import get_logger

log = get_logger(__name__)

DATA_STATE_FORMAT = "megatron-flexsp-data"


class CheckpointAccounting:
    """``args``: Megatron's; ``sampler``: the run's document sampler; ``recorder``: its totals."""

    def __init__(self, args, sampler, out_dir: Path, recorder) -> None:
        self.args, self.sampler, self.out_dir, self.recorder = args, sampler, Path(out_dir), recorder

    def sampler_state(self) -> dict:
        smp = self.sampler
        return {"seed": smp.seed, "global_batch": smp.global_batch, "seq_length": smp.seq_length,
                "over_length": self.args.flexsp_over_length,
                "num_documents": smp.acct.num_documents, "usable_documents": smp.acct.usable_documents}

    def on_save(self, iteration: int) -> None:
        """Rank 0: write the document accounting next to Megatron's checkpoint of ``iteration``."""
        if dist.get_rank() != 0 or not self.args.save:
            return
        usable = self.sampler.acct.usable_documents
        consumed = int(getattr(self.args, "consumed_train_samples", 0)
                       or iteration * self.args.global_batch_size)
        rec = {"format": DATA_STATE_FORMAT, "version": 1, "iteration": iteration,
               "next_step": iteration, "documents_consumed": consumed, "epoch": consumed // usable,
               "position_in_epoch": consumed % usable, "sampler": self.sampler_state(),
               "dataset": self.sampler.acct.to_dict(), "this_run": dict(self.recorder.totals)}
        folder = Path(self.args.save) / f"iter_{iteration:07d}"
        folder = folder if folder.is_dir() else self.out_dir
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "flexsp_data.json").write_text(json.dumps(rec, indent=1))
        log.info("data accounting at iteration %d: %d documents consumed (epoch %d, %d/%d), this run "
                 "%d documents, %d truncated; dataset: %d dropped short, %d dropped long", iteration,
                 consumed, rec["epoch"], rec["position_in_epoch"], usable,
                 self.recorder.totals["documents"], self.recorder.totals["truncated_documents"],
                 self.sampler.acct.dropped_too_short, self.sampler.acct.dropped_too_long)

    def check_resume(self) -> None:
        """On resume, the saved sampler settings must equal this run's (else documents would be
        skipped or repeated): ``ValueError`` naming the differing values."""
        it = int(getattr(self.args, "iteration", 0) or 0)
        if not it or not self.args.load:
            return
        path = Path(self.args.load) / f"iter_{it:07d}" / "flexsp_data.json"
        if not path.exists():
            log.warning("resuming at iteration %d without %s: document accounting starts here", it, path)
            return
        saved = json.loads(path.read_text())
        now = self.sampler_state()
        diff = {k: (saved["sampler"].get(k), v) for k, v in now.items() if saved["sampler"].get(k) != v}
        if diff:
            raise ValueError(f"resuming from {path}: the document sampler changed (saved, now): {diff}; "
                             f"documents would be skipped or trained twice")
        log.info("resume: %d documents consumed before (epoch %d), sampler settings unchanged",
                 saved["documents_consumed"], saved["epoch"])

