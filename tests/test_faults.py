"""Faults a cluster throws, injected into a real 2-process training run or its checkpoints.

- Damaged checkpoints (a node that died mid-write on shared storage): a run resumes from the
  newest whole step with one warning line per damaged newer step; with none whole it stops
  with one line and exit 2; conversion of a damaged step stops with one line, exit 2,
  nothing written.
- Preemption (SIGTERM to every process of the run, as SLURM sends it): a checkpoint of the
  last finished step, exit 75, and the rerun continues bit for bit.
- A full disk during a save: one line, exit 4, the rerun resumes from the step before.
- Non-finite values (NaN injected into the embedding, tests/fault_configs.py): the step is
  skipped, counted and named; too many in a row stop the run with one line and exit 3; a loss
  that diverges by itself stops at its first non-finite step when no skip is allowed."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from conftest import exit_code, load_script, REPO, train, train_command, train_env
from torchtitan_ext.training.run_log import parse_steps
from training_runs import CONFIGS

pytestmark = pytest.mark.slow

STEPS, INTERVAL = 12, 6  # checkpoints at steps 6 and 12
COMMON = CONFIGS["transformer"] + ["--validator.no-enable", "--debug.seed", "0", "--debug.deterministic",
                                   "--lr_scheduler.total_steps", str(STEPS), "--checkpoint.interval", str(INTERVAL),
                                   "--training.global_batch_size", "4", "--training.steps", str(STEPS)]
LAST, PREVIOUS = f"step-{STEPS}", f"step-{INTERVAL}"
NAN_COMMON = ["--module", "fault_configs", "--validator.no-enable", "--debug.seed", "0",
              "--training.global_batch_size", "4"]


def truncate_shard(step: Path) -> str:
    shard = sorted(step.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return f"shard '{shard.name}' is truncated"


def delete_shard(step: Path) -> str:
    shard = sorted(step.glob("*.distcp"))[-1]
    shard.unlink()
    return f"shard '{shard.name}' is missing"


def garble_metadata(step: Path) -> str:
    (step / ".metadata").write_bytes(b"not a pickle")
    return ".metadata does not parse"


DAMAGES = {"truncated": truncate_shard, "missing": delete_shard, "metadata": garble_metadata}


@pytest.fixture(scope="module")
def straight(tmp_path_factory, tokenizer_dir):
    """An uninterrupted 2-process run of STEPS steps, checkpoints at steps INTERVAL and STEPS."""
    folder = tmp_path_factory.mktemp("straight")
    run = train(COMMON + ["--dump_folder", str(folder)], nproc=2)
    assert run.returncode == 0 and sorted(run.losses) == list(range(1, STEPS + 1)), run
    return folder, run.losses


def damaged_copy(straight_folder: Path, target: Path, damage) -> str:
    shutil.copytree(straight_folder, target)
    return damage(target / "checkpoint" / LAST)


def transformer_state() -> dict:
    from torchtitan_ext.training.checkpoints import build_model

    return build_model("train_configs.transformer", "transformer_debug", "meta")[0].state_dict()


@pytest.mark.parametrize("case", sorted(DAMAGES))
def test_a_damaged_step_is_skipped_for_the_newest_whole_one_and_refused_by_conversion(case, straight, tmp_path, capsys):
    from torchtitan_ext.training.checkpoints import resume_step

    expected = damaged_copy(straight[0], tmp_path / "run", DAMAGES[case])
    step, damaged = resume_step(tmp_path / "run" / "checkpoint", transformer_state())
    assert step == INTERVAL and len(damaged) == 1 and damaged[0].startswith(f"{LAST}: ") and expected in damaged[0], damaged
    out = tmp_path / "hf"
    capsys.readouterr()
    code = exit_code(load_script("convert_to_hf").main, [*CONFIGS["transformer"], "--checkpoint",  # in this process
                                                         str(tmp_path / "run" / "checkpoint" / LAST), "--out", str(out)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and expected in lines[0], lines
    assert not out.exists()


def test_another_models_shards_are_not_a_step_to_resume_from(straight):
    from torchtitan_ext.training.checkpoints import build_model, resume_step

    mlp_state = build_model("train_configs.mlp_lm", "mlp_lm_debug", "meta")[0].state_dict()
    step, damaged = resume_step(straight[0] / "checkpoint", mlp_state)
    assert step is None and len(damaged) == 2 and all("does not hold a model of this config" in d for d in damaged)
    assert resume_step(straight[0] / "checkpoint", transformer_state()) == (STEPS, [])


def test_two_processes_resume_from_the_previous_step_and_match_the_uninterrupted_run(straight, tmp_path):
    reason = damaged_copy(straight[0], tmp_path / "run", truncate_shard)
    resumed = train(COMMON + ["--dump_folder", str(tmp_path / "run")], nproc=2)
    assert resumed.returncode == 0, resumed
    # rank 0's lines, as torchrun tees them ("[default0]:" prefix)
    warnings = [line for line in resumed.output.splitlines() if f"warning: checkpoint {LAST}" in line]
    assert len(warnings) == 1 and reason in warnings[0] and warnings[0].endswith(f"resuming from {PREVIOUS}"), resumed
    assert sorted(resumed.losses) == list(range(INTERVAL + 1, STEPS + 1))
    assert resumed.losses == {s: straight[1][s] for s in range(INTERVAL + 1, STEPS + 1)}


def test_with_no_whole_step_the_run_stops_with_one_line_and_exit_2(straight, tmp_path):
    damaged_copy(straight[0], tmp_path / "run", garble_metadata)
    truncate_shard(tmp_path / "run" / "checkpoint" / PREVIOUS)
    before = {p: p.read_bytes() for p in (tmp_path / "run" / "checkpoint").rglob("*") if p.is_file()}
    run = train(COMMON + ["--dump_folder", str(tmp_path / "run")], nproc=2, preflight=True)
    lines = [line for line in run.output.splitlines() if line.strip()]
    assert run.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: no whole checkpoint to resume"), run
    assert LAST in lines[0] and PREVIOUS in lines[0]
    # the damaged files stay as found, for the user to inspect
    assert {p: p.read_bytes() for p in (tmp_path / "run" / "checkpoint").rglob("*") if p.is_file()} == before


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc), children first."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, frontier = [], [pid]
    while frontier:
        children = [c for p in frontier for c in parents.get(p, [])]
        found += children
        frontier = children
    return found


def test_sigterm_checkpoints_the_last_step_exits_75_and_the_rerun_continues_bit_for_bit(straight, tmp_path):
    folder = tmp_path / "run"
    proc = subprocess.Popen(train_command(COMMON + ["--dump_folder", str(folder)]), cwd=REPO, env=train_env(nproc=2),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = ""
    for line in proc.stdout:
        output += line
        if 3 in parse_steps(output):
            for pid in [proc.pid, *descendants(proc.pid)]:  # SLURM signals every process of the step
                os.kill(pid, signal.SIGTERM)
            break
    output += proc.stdout.read()
    assert proc.wait(timeout=300) == 75, output[-3000:]
    stopped = int(output.split("preempted (SIGTERM) after step ")[1].split(",")[0])
    assert 3 <= stopped < STEPS and (folder / "checkpoint" / f"step-{stopped}" / ".metadata").exists(), output[-3000:]
    resumed = train(COMMON + ["--dump_folder", str(folder)], nproc=2)
    assert resumed.returncode == 0 and sorted(resumed.losses) == list(range(stopped + 1, STEPS + 1)), resumed
    assert resumed.losses == {s: straight[1][s] for s in range(stopped + 1, STEPS + 1)}


def test_a_disk_that_fills_during_a_save_stops_with_one_line_and_the_rerun_resumes(straight, tmp_path):
    """Every rank's DCP writer writes half a shard and raises ENOSPC on the second save
    (tests/fault_configs.py): the run stops naming the folder and the bytes a checkpoint
    takes, the step it was writing stays unloadable, and the rerun (with space) resumes from
    the step before and matches the uninterrupted run."""
    from torchtitan_ext.training.checkpoints import resume_step

    folder = tmp_path / "run"
    filling = ["--module", "fault_configs", "--config", "transformer_debug_disk_fills", *COMMON[4:]]
    run = train(filling + ["--dump_folder", str(folder)], nproc=2)
    errors = [line.split("error: ", 1)[1] for line in run.output.splitlines() if "error: disk full" in line]
    assert run.returncode == 4 and len(errors) == 1, run
    size = sum(f.stat().st_size for f in (folder / "checkpoint" / PREVIOUS).iterdir())
    assert errors[0] == (f"disk full while writing a checkpoint under '{folder / 'checkpoint'}': a checkpoint takes "
                         f"{size:,} bytes here ({PREVIOUS}); free that much and rerun the same command to resume from {PREVIOUS}")
    assert not (folder / "checkpoint" / LAST / ".metadata").exists()
    assert resume_step(folder / "checkpoint", transformer_state()) == (INTERVAL, [])
    resumed = train(COMMON + ["--dump_folder", str(folder)], nproc=2)
    assert resumed.returncode == 0 and resumed.losses == {s: straight[1][s] for s in range(INTERVAL + 1, STEPS + 1)}, resumed


def checkpoint_state(step: Path, tmp_path: Path) -> dict:
    """Everything a DCP step folder holds (model, optimizer, schedule, train state), loaded."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(step, tmp_path / f"{step.name}.pt")
    return torch.load(tmp_path / f"{step.name}.pt", weights_only=False)


def warned_steps(output: str) -> list[int]:
    """The steps of rank 0's "step N: ... not finite, update skipped" warning lines."""
    return [int(m.group(1)) for m in re.finditer(r"step (\d+): \w+ (?:is|are) not finite, update skipped", output)]


def test_a_non_finite_step_on_one_rank_is_skipped_by_both_and_counted(tmp_path):
    """Rank 0's loss turns NaN at step 3, its gradients (only) at step 5: both ranks skip both
    updates (a rank that stepped alone would leave the shards of one model at different
    steps), the run finishes, and the optimizer and the LR schedule took 6 - 2 steps."""
    import torch

    folder = tmp_path / "run"
    run = train(["--config", "transformer_debug_nan_once", *NAN_COMMON, "--training.steps", "6",
                 "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "0", "--dump_folder", str(folder)],
                nproc=2)
    assert run.returncode == 0 and warned_steps(run.output) == [3, 5], run
    assert "step 3: loss is not finite" in run.output and "step 5: gradients are not finite" in run.output
    assert sorted(run.losses) == [1, 2, 4, 5, 6]  # no loss line of step 3: its loss is NaN
    counts = [line.split("skipped_nonfinite_steps: ")[1].split()[0] for line in run.output.splitlines()
              if "skipped_nonfinite_steps: " in line]
    assert counts[-1] == "2", run
    # no interval checkpoint of a skipped step; the last one's state has 4 applied updates
    assert sorted(int(p.name.split("-")[1]) for p in (folder / "checkpoint").glob("step-*")) == [1, 2, 4, 6]
    state = checkpoint_state(folder / "checkpoint" / "step-6", tmp_path)
    steps = {float(v) for k, v in state["optimizer"].items() if k.endswith(".step")}
    assert steps == {4.0} and state["lr_scheduler"]["last_epoch"] == 4 and state["train_state"]["step"] == 6
    weights = [v for k, v in state.items() if isinstance(v, torch.Tensor)]
    assert weights and all(torch.isfinite(w).all() for w in weights)


def test_non_finite_loss_stops_with_one_line_and_keeps_the_last_checkpoint(tokenizer_dir, tmp_path):
    """A loss that diverges by itself (tests/nan_configs.py, 1 process): with no skips allowed
    (`--training.max_nonfinite_skips 0`) its first non-finite step stops the run (exit 3) and
    every checkpoint written before it is whole."""
    run = train(["--module", "nan_configs", "--config", "transformer_diverging", "--training.steps", "30",
                 "--checkpoint.interval", "1", "--training.max_nonfinite_skips", "0", "--validator.no-enable",
                 "--dump_folder", str(tmp_path)])
    assert run.returncode == 3, run.output[-2000:]
    assert "not finite at step" in run.output and "Checkpoints written" in run.output
    failed_at = max(run.losses) + 1 if run.losses else 1
    saved = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "checkpoint").glob("step-*"))
    assert saved and max(saved) < failed_at and all((tmp_path / "checkpoint" / f"step-{s}" / ".metadata").exists() for s in saved)


def test_too_many_non_finite_steps_in_a_row_stop_with_one_line_and_exit_3(tmp_path):
    """NaN from step 3 on, at most 2 skips: steps 3 and 4 are skipped, step 5 stops the run
    with exit 3; the newest checkpoint is step 2's (the last applied update), and it loads."""
    from torchtitan_ext.training.checkpoints import resume_step

    folder = tmp_path / "run"
    run = train(["--config", "transformer_debug_nan_from_step_3", *NAN_COMMON, "--training.steps", "8",
                 "--checkpoint.interval", "2", "--training.max_nonfinite_skips", "2", "--dump_folder", str(folder)])
    errors = [line.split("error: ", 1)[1] for line in run.output.splitlines() if "error: " in line]
    assert run.returncode == 3 and len(errors) == 1 and warned_steps(run.output) == [3, 4], run
    assert errors[0].startswith("Loss is not finite at step 5: 3 non-finite steps in a row (steps 3-5, none "
                                "applied), more than --training.max_nonfinite_skips 2. "), errors
    assert sorted(run.losses) == [1, 2]
    assert resume_step(folder / "checkpoint", transformer_state()) == (2, [])
