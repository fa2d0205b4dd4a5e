"""End-to-end training through scripts/train.sh: resume, compile and activation-checkpointing
modes, a non-finite loss. Slow: about 8 minutes."""

from __future__ import annotations

import shutil

import pytest

from conftest import train
from training_runs import CONFIGS, GRAFTS, relative_gap, seeded_folder, SHORT

pytestmark = pytest.mark.slow


# One family: the grafts' resume (MoNe, 2 processes) is tests/test_mone.py's, a 2-process
# resume from a damaged step tests/test_faults.py's.
@pytest.mark.parametrize("family", ["transformer"])
def test_resume_reproduces_the_straight_run_bit_for_bit(family, tokenizer_dir, tmp_path):
    common = (CONFIGS | GRAFTS)[family] + ["--validator.no-enable", "--debug.seed", "0", "--debug.deterministic",
                                           "--lr_scheduler.total_steps", "12", "--checkpoint.interval", "6"]
    straight = train(common + ["--training.steps", "12", "--dump_folder", str(tmp_path / "straight")])
    first = train(common + ["--training.steps", "6", "--dump_folder", str(tmp_path / "resumed"), "--metrics.enable-wandb"])
    second = train(common + ["--training.steps", "12", "--dump_folder", str(tmp_path / "resumed")])
    assert all(r.returncode == 0 for r in (straight, first, second)), (straight, first, second)
    assert sorted(second.losses) == list(range(7, 13))
    assert {**first.losses, **second.losses} == straight.losses
    assert straight.losses[12] < straight.losses[1] - (1.0 if family in CONFIGS else 0.1)  # a graft on a random backbone
    assert list((tmp_path / "resumed").rglob("offline-run-*")), "wandb wrote no offline run"


# Each family's default AC mode first (transformer: selective; Mela debug: none).
AC_MODES = {
    "transformer": {"eager-selective": [], "compiled": ["--compile.enable"], "full-ac": ["activation-checkpoint:full"],
                    "no-ac": ["activation-checkpoint:none"]},
    "mela": {"eager-no-ac": [], "compiled": ["--compile.enable"], "full-ac": ["activation-checkpoint:full"]},
    # compiled by region (torchtitan_ext/families/titans.py `compile_regions`), the chunk loop eager
    "titans_mac": {"eager-no-ac": [], "compiled": ["--compile.enable"]},
}
# mela_debug's lr 3e-3 makes a loss spike at steps 8-10 (7.17 -> 7.51 -> 9.03) that amplifies
# rounding: eager and compiled agree to 5 decimals through step 7, then part by 1.2e-5,
# 4.0e-5 and 4.0e-4 (measured 2026-11-24, the same at the commits before and after the
# bounded compile). At lr 1e-3 the 10 steps descend smoothly and agree to 5 decimals (SHORT
# now runs 6 steps, before the spike; the lower lr keeps the margin).
MODE_ARGS = {"mela": ["--optimizer.param-groups.0.optimizer-kwargs.lr", "1e-3"]}
# The grafts' compiled blocks are held to eager in tests/test_memory_llama.py and tests/test_mone.py
# (a block-level torch.compile, what torchtitan's per-block compile does), their full AC there too.


@pytest.mark.parametrize("family", sorted(AC_MODES))
def test_compile_and_activation_checkpointing_modes_agree(family, tokenizer_dir, seed_cache, tmp_path):
    seeded_folder(family, tmp_path / "seed", seed_cache)
    runs = {}
    for name, extra in AC_MODES[family].items():
        folder = tmp_path / name
        shutil.copytree(tmp_path / "seed", folder)
        runs[name] = train((CONFIGS | GRAFTS)[family] + SHORT + MODE_ARGS.get(family, []) + ["--dump_folder", str(folder)]
                           + extra)
        assert runs[name].returncode == 0, runs[name]
    reference, *others = runs
    for name in others:
        assert relative_gap(runs[reference].losses, runs[name].losses) < MODE_TOLERANCE, name


# Compiled and recomputed paths round differently from eager (1e-6 at step 2). A wrong
# compiled or recomputed path shows gaps of 1e-2 and more.
MODE_TOLERANCE = 1e-4


def test_non_finite_loss_stops_with_one_line_and_keeps_the_last_checkpoint(tokenizer_dir, tmp_path):
    """With no skips allowed (`--training.max_nonfinite_skips 0`) the first non-finite step
    stops the run (exit 3); the skip-and-continue guard is tested in test_faults.py."""
    run = train(["--module", "nan_configs", "--config", "transformer_diverging", "--training.steps", "30",
                 "--checkpoint.interval", "1", "--training.max_nonfinite_skips", "0", "--validator.no-enable",
                 "--dump_folder", str(tmp_path)])
    assert run.returncode == 3, run.output[-2000:]
    assert "not finite at step" in run.output and "Checkpoints written" in run.output
    failed_at = max(run.losses) + 1 if run.losses else 1
    saved = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "checkpoint").glob("step-*"))
    assert saved and max(saved) < failed_at and all((tmp_path / "checkpoint" / f"step-{s}" / ".metadata").exists() for s in saved)
