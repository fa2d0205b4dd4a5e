"""The debug training commands and helpers the end-to-end training tests share."""

from __future__ import annotations

import fcntl
import shutil
import subprocess
from pathlib import Path

from conftest import REPO, train

CONFIGS = {
    "transformer": ["--module", "train_configs.transformer", "--config", "transformer_debug"],
    "mlp_lm": ["--module", "train_configs.mlp_lm", "--config", "mlp_lm_debug"],
    "mela": ["--module", "train_configs.mela", "--config", "mela_debug"],
    "backbone": ["--module", "train_configs.backbone", "--config", "backbone_qwen3_debug"],
} | {f"titans_{v}": ["--module", "train_configs.titans", "--config", f"titans_{v}_debug"] for v in ("mac", "mag", "mal", "lmm")}
SHORT_STEPS = 6  # a launch costs ~15 s before and after its steps of ~1 s: a few steps suffice
SHORT = ["--training.steps", str(SHORT_STEPS), "--validator.no-enable", "--debug.seed", "0"]


def seeded_folder(family: str, folder: Path, cache: Path) -> None:
    """A dump folder holding an unsharded seed checkpoint (step-0) both runs start from.

    The seed is torchtitan's own (`--checkpoint.create-seed-checkpoint`, one process), launched
    once per family and session into `cache` (`seed_cache`) under a lock, then copied: its
    weights depend only on the config and `--debug.seed`, which every caller shares."""
    seed = cache / f"seed_{family}"
    with open(cache / f"seed_{family}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (seed / "checkpoint" / "step-0" / ".metadata").exists():
            shutil.rmtree(seed, ignore_errors=True)
            run = train(CONFIGS[family] + SHORT
                        + ["--dump_folder", str(seed), "--checkpoint.create-seed-checkpoint"])
            assert run.returncode == 0 and (seed / "checkpoint" / "step-0" / ".metadata").exists(), run
    shutil.copytree(seed / "checkpoint" / "step-0", folder / "checkpoint" / "step-0")


def pretrained_backbone(cache: Path) -> tuple[Path, str]:
    """scripts/pretrain_backbone.sh's folder and printed summary at the ci leaderboard suite's
    settings, run as the suite runs it (`leaderboard_cells.pretrain_command`), made once per
    session into `cache` under a lock: tests/test_pretrain_backbone.py checks it, the ci fixture
    of tests/test_leaderboard.py starts from a copy (its rows' backbone, not pretrained again)."""
    from torchtitan_ext.eval.leaderboard_cells import pretrain_command
    from torchtitan_ext.eval.leaderboard_suites import SUITES

    folder, summary = cache / "pretrained_backbone", cache / "pretrained_backbone.stdout"
    with open(cache / "pretrained_backbone.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not summary.exists():
            shutil.rmtree(folder, ignore_errors=True)
            command, env = pretrain_command(folder, SUITES["ci"])
            proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            summary.write_text(proc.stdout)
    return folder, summary.read_text()


def relative_gap(a: dict, b: dict) -> float:
    """Largest relative loss difference of two SHORT runs."""
    assert a.keys() == b.keys() and len(a) == SHORT_STEPS
    return max(abs(a[s] - b[s]) / abs(a[s]) for s in a)
