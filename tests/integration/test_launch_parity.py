"""A Llama-style launch script with --flexsp added (configs/llama3_8b_pretrain_flexsp.args), shrunk
to the demo model, on 4 CPU gloo ranks (seven launches, ~4 min).

The script's features all run: a 2-prefix weighted blend (0.3 / 0.7) through Megatron's dataset
builder, a train/valid/test split, evaluation every 5 steps, a batch-size ramp (Megatron's
``--step-batch-size-schedule``: 4 documents, then 8 after 24 x 1024 tokens), TensorBoard, the loss checks, the
exit signal handler.

- ramp: steps 0-5 draw 4 documents, the later steps 8, as Megatron counts them;
- evaluation: Megatron logs a validation loss at iterations 5 and 10 and after training, from
  --eval-iters batches planned like training batches;
- parity: --flexsp and plain Megatron on the same documents give the same losses, grad norms and
  validation losses (fp32, relative 1e-5);
- resume: from the iteration-6 checkpoint (across the ramp) the run continues exactly: same
  documents, plans, losses, grad norms, validation losses;
- exit: a SIGTERM to the training processes (``--exit-signal-handler``, as the Slurm script sends
  it) and ``--exit-interval`` each save a checkpoint and exit 0; resuming from it reproduces the
  uninterrupted run. (``--exit-duration-in-mins`` takes whole minutes, too long for this test; it
  ends the run through the same save-and-exit step of Megatron's loop as ``--exit-interval``.)
- rerun: when Megatron's rerun state machine replays a step (an error injected into the loss
  check), the replay reuses the step's plan and documents and reproduces its loss bit for bit;
- TensorBoard: the run's event file holds FlexSP's per-step scalars.
"""

import re
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

pytest.importorskip("megatron.training")

from tests.integration.megatron_runs import ROOT, build_dataset, run_pretrain  # noqa: E402

RTOL = 1e-5
STEPS = 12
_VALID = re.compile(r"validation loss at iteration\s+(\d+)( on validation set)? \| lm loss value: ([0-9.E+-]+)")


def shrunk_args(base: Path, a: Path, b: Path) -> list[str]:
    """The args file's flags with the model, data paths and sizes replaced for the CPU demo."""
    text = "\n".join(line.split("#", 1)[0] for line in
                     (ROOT / "configs" / "llama3_8b_pretrain_flexsp.args").read_text().splitlines())
    replace = {
        "--num-layers": ["2"], "--hidden-size": ["64"], "--num-attention-heads": ["4"],
        "--num-query-groups": ["2"], "--ffn-hidden-size": ["256"], "--seq-length": ["1024"],
        "--max-position-embeddings": ["1024"], "--tokenizer-type": ["NullTokenizer"],
        "--tokenizer-model": None, "--bf16": None, "--data-path": ["0.3", str(a), "0.7", str(b)],
        "--split": ["90,8,2"], "--data-cache-path": [str(base / "cache")],
        "--step-batch-size-schedule": ["0:4 24576:8"], "--train-iters": [str(STEPS)],
        "--eval-interval": ["5"], "--eval-iters": ["2"], "--lr-warmup-iters": ["2"],
        "--tensorboard-dir": None, "--save-interval": ["6"], "--ckpt-format": ["torch"],
        "--flexsp-profile": ["cpu-gloo-measured"], "--log-interval": ["1"]}
    out, skip = [], False
    for tok in shlex.split(text):
        if tok.startswith("--"):
            skip = tok in replace
        if not skip:
            out.append(tok)
    for flag, values in replace.items():
        if values is not None:
            out += [flag, *values]
    # the host: Megatron's local layers without fused kernels, fp32, CPU initialisation
    return out + ["--vocab-size", "257", "--transformer-impl", "local", "--no-rope-fusion",
                  "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion",
                  "--no-persist-layer-norm", "--use-cpu-initialization"]


def _launch(base, name, args, extra, **kw):
    return run_pretrain(base / name, None, [*args, *extra], raw=True, **kw)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("launch")
    a = build_dataset(base / "data" / "asyncio", max_docs=300, source="asyncio")
    b = build_dataset(base / "data" / "email", max_docs=300, source="email")
    args = shrunk_args(base, a, b)
    assert "--flexsp" in args and "--exit-signal-handler" in args and "--eod-mask-loss" in args
    plain_args = [x for x in args if x != "--flexsp"]
    out = {"base": base}
    out["full"] = _launch(base, "full", args, ["--save", str(base / "ckpt"),
                                               "--tensorboard-dir", str(base / "tb")], steps=STEPS)
    out["plain"] = _launch(base, "plain", plain_args, [], steps=STEPS)
    at6 = base / "ckpt_at6"
    at6.mkdir()
    shutil.copytree(base / "ckpt" / "iter_0000006", at6 / "iter_0000006")
    (at6 / "latest_checkpointed_iteration.txt").write_text("6")
    out["resumed"] = _launch(base, "resumed", args, ["--load", str(at6)], steps=STEPS)
    # --exit-interval: saves after step 3 and exits; the next launch resumes
    out["timed"] = _launch(base, "timed", args, ["--save", str(base / "ckpt_timed"),
                                                 "--exit-interval", "3"], steps=STEPS)
    out["after_timed"] = _launch(base, "after_timed", args, ["--load", str(base / "ckpt_timed")], steps=STEPS)
    # SIGTERM to the training processes, as the Slurm script forwards it
    out["signalled"] = _launch(base, "signalled", args, ["--save", str(base / "ckpt_sig")], steps=STEPS,
                               on_start=_sigterm_workers_after(base / "signalled" / "steps.jsonl", 3))
    out["after_signal"] = _launch(base, "after_signal", args, ["--load", str(base / "ckpt_sig")], steps=STEPS)
    # an error injected into a loss check: Megatron replays the step, then stops the job (a transient
    # error asks for a restart)
    out["rerun"] = _launch(base, "rerun", args, ["--error-injection-rate", "1", "--error-injection-type",
                                                 "transient_error"], steps=2)
    return out


def _sigterm_workers_after(steps_file: Path, steps: int):
    """Once ``steps`` steps are recorded, SIGTERM the torchrun launcher's worker processes."""

    def watch(proc: subprocess.Popen) -> None:
        deadline = time.time() + 600
        while time.time() < deadline and proc.poll() is None:
            if steps_file.exists() and len(steps_file.read_text().splitlines()) >= steps:
                kids = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
                for pid in kids.stdout.split():
                    subprocess.run(["kill", "-TERM", pid])
                return
            time.sleep(0.2)

    return watch


def _close(x: float, y: float) -> bool:
    return abs(x - y) <= RTOL * max(abs(x), abs(y))


def _valid(run) -> dict:
    return {(int(m.group(1)), bool(m.group(2))): float(m.group(3)) for m in _VALID.finditer(run.log)}


def test_runs_end_well(runs):
    for name in ("full", "plain", "resumed", "timed", "after_timed", "signalled", "after_signal"):
        assert runs[name].returncode == 0, (name, runs[name].log[-5000:])


def test_batch_ramp_follows_megatron(runs):
    docs = [r["documents"] for r in runs["full"].steps]
    assert docs == [4] * 6 + [8] * 6, docs
    assert "consumed samples:           72" in runs["full"].log  # 6 x 4 + 6 x 8


def test_evaluation_every_five_steps_from_planned_batches(runs):
    valid = _valid(runs["full"])
    assert {5, 10} <= {it for it, final in valid if not final} and (12, True) in valid, valid
    evals = [r for r in runs["full"].eval if r["split"] == "valid"]
    assert len(evals) == 3 * 2 and all(r["plan_source"] == "solver-sync" for r in evals)


def test_flexsp_matches_plain_megatron_with_blend_split_ramp_and_eval(runs):
    f, p = runs["full"], runs["plain"]
    assert [r["tokens"] for r in f.steps] == [r["tokens"] for r in p.steps]
    for it in range(STEPS):
        x, y = f.megatron[it], p.megatron[it]
        assert _close(x["lm_loss"], y["lm_loss"]) and _close(x["grad_norm"], y["grad_norm"]), (it, x, y)
    fv, pv = _valid(f), _valid(p)
    assert fv.keys() == pv.keys() and all(abs(fv[k] - pv[k]) <= 2e-6 * abs(pv[k]) for k in fv), (fv, pv)


def _continues(full, part, first: int) -> None:
    assert sorted(part.megatron) == list(range(first, STEPS))
    for it in range(first, STEPS):
        x, y = full.megatron[it], part.megatron[it]
        assert _close(x["lm_loss"], y["lm_loss"]) and _close(x["grad_norm"], y["grad_norm"]), (it, x, y)
    by_step = {r["step"]: r for r in full.steps}
    for r in part.steps:
        assert r["tokens"] == by_step[r["step"]]["tokens"]
        assert r["group_sizes"] == by_step[r["step"]]["group_sizes"]
    fv, pv = _valid(full), _valid(part)
    for key, value in pv.items():
        assert abs(value - fv[key]) <= 2e-6 * abs(fv[key]), (key, value, fv[key])


def test_resume_across_the_ramp_is_exact(runs):
    _continues(runs["full"], runs["resumed"], 6)


def test_exit_interval_saves_and_resumes_exactly(runs):
    stopped = sorted(runs["timed"].megatron)
    assert stopped == [0, 1, 2], stopped
    assert "exiting program at iteration 3" in runs["timed"].log
    _continues(runs["full"], runs["after_timed"], stopped[-1] + 1)


def test_exit_signal_saves_and_resumes_exactly(runs):
    stopped = sorted(runs["signalled"].megatron)
    assert 2 <= stopped[-1] < STEPS - 1, stopped
    assert "exiting program after receiving SIGTERM" in runs["signalled"].log
    _continues(runs["full"], runs["after_signal"], stopped[-1] + 1)


def test_tensorboard_has_flexsp_scalars(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ev = EventAccumulator(str(runs["base"] / "tb"))
    ev.Reload()
    tags = set(ev.Tags()["scalars"])
    for tag in ("flexsp/run_ms", "flexsp/predicted_ms", "flexsp/plan_wait_ms", "flexsp/gap",
                "flexsp/plan_from_solver", "flexsp/tokens"):
        assert tag in tags, sorted(tags)[:40]
    assert len(ev.Scalars("flexsp/run_ms")) == STEPS
    assert any(t.startswith("flexsp/groups_of_") for t in tags)


def test_a_replayed_step_reuses_its_plan_and_documents(runs):
    run = runs["rerun"]
    assert "Need to rerun step to check reproducibility" in run.log, run.log[-3000:]
    replays = [k for k, r in enumerate(run.steps) if r["plan_source"] == "replay"]
    assert replays, [r["plan_source"] for r in run.steps]
    first, replay = run.steps[replays[0] - 1], run.steps[replays[0]]
    assert first["step"] == replay["step"] and first["plan_source"] != "replay"
    assert replay["group_sizes"] == first["group_sizes"] and replay["tokens"] == first["tokens"]
    assert replay["loss"] == first["loss"]  # the same documents on the same plan: bit for bit
