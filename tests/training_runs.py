"""The debug training commands and helpers the end-to-end training tests share."""

from __future__ import annotations

from conftest import train

CONFIGS = {
    "transformer": ["--module", "train_configs.transformer", "--config", "transformer_debug"],
    "mlp_lm": ["--module", "train_configs.mlp_lm", "--config", "mlp_lm_debug"],
    "mela": ["--module", "train_configs.mela", "--config", "mela_debug"],
    "backbone": ["--module", "train_configs.backbone", "--config", "backbone_qwen3_debug"],
} | {f"titans_{v}": ["--module", "train_configs.titans", "--config", f"titans_{v}_debug"] for v in ("mac", "mag", "mal", "lmm")}
# Grafted backbones (frozen random weights from a seed: they learn too little for the 1-vs-2 test's bar).
GRAFTS = {"memoryllama": ["--module", "train_configs.backbone", "--config", "memoryllama_alma_debug"]}
SHORT_STEPS = 6  # a launch costs ~15 s before and after its steps of ~1 s: a few steps suffice
SHORT = ["--training.steps", str(SHORT_STEPS), "--validator.no-enable", "--debug.seed", "0"]


def seeded_folder(family: str, folder) -> None:
    """A dump folder holding an unsharded seed checkpoint (step-0) both runs start from."""
    run = train((CONFIGS | GRAFTS)[family] + SHORT + ["--dump_folder", str(folder), "--checkpoint.create-seed-checkpoint"])
    assert run.returncode == 0 and (folder / "checkpoint" / "step-0" / ".metadata").exists(), run


def relative_gap(a: dict, b: dict) -> float:
    """Largest relative loss difference of two SHORT runs."""
    assert a.keys() == b.keys() and len(a) == SHORT_STEPS
    return max(abs(a[s] - b[s]) / abs(a[s]) for s in a)
