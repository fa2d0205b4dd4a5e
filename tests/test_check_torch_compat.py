"""scripts/check_torch_compat.{sh,py}: the comparison and its one line per case on synthetic
logs, the grad_norm the parser reads for it, and the commands of a dry run (no side torch,
no training)."""

from __future__ import annotations

import os
import subprocess

import pytest

from conftest import load_script, REPO
from torchtitan_ext.training.run_log import parse_steps

compat = load_script("check_torch_compat")


def log(losses: list[float], norms: list[float]) -> str:
    """Step lines as torchtitan 0.3.0 prints them (colour codes included)."""
    return "".join(f"[titan] 2026-11-26 10:00:0{i % 10},000 - root - INFO - \x1b[31mstep: {i:2}  \x1b[32mloss: {loss:8.5f}  "
                   f"\x1b[38;2;237;212;0mgrad_norm: {norm:7.4f}  \x1b[36mmemory:  0.00GiB(0.00%)  \x1b[34mtps: 1,234  "
                   f"\x1b[36mtflops: 0.01  \x1b[35mmfu: N/A\x1b[39m\n"
                   for i, (loss, norm) in enumerate(zip(losses, norms), 1))


LOSSES = [8.4, 8.1, 7.9, 7.6, 7.2, 6.9, 6.5, 6.2, 6.0, 5.8]
NORMS = [2.5, 2.1, 1.8, 1.5, 1.2, 0.9, 0.8, 0.6, 0.5, 0.41]


def runs(pinned: str, side: str, codes=(0, 0)) -> dict:
    return {"pinned": (codes[0], parse_steps(pinned, grad_norm=True), "pinned tail"),
            "2.11": (codes[1], parse_steps(side, grad_norm=True), "Error: boom")}


def line(result) -> str:
    return compat.result_line(compat.case_name("transformer_debug", 2, "compiled"), result)


def test_grad_norm_is_parsed_on_request_and_the_default_entries_keep_their_keys():
    text = log(LOSSES, NORMS)
    assert parse_steps(text, grad_norm=True)[10] == {"loss": 5.8, "grad_norm": 0.41, "tps": 1234, "tflops": 0.01,
                                                     "mfu": pytest.approx(float("nan"), nan_ok=True)}
    assert "grad_norm" not in parse_steps(text)[10]
    assert parse_steps("step:  3  loss:  7.00000  grad_norm:     nan  tps: 9", grad_norm=True)[3]["grad_norm"] != 0


def test_identical_runs_are_one_equal_line():
    text = log(LOSSES, NORMS)
    result = compat.compare(runs(text, text), 10, "2.11")
    assert result.ok
    assert line(result) == ("transformer_debug 2 ranks compiled: equal "
                            "(10 steps; max relative gap loss 0.0e+00, grad_norm 0.0e+00)")
    assert compat.case_name("mela_debug", 1, "eager") == "mela_debug 1 rank eager"


def test_gaps_within_the_tolerance_or_the_last_printed_digit_are_equal():
    # loss 5e-5 relative; grad_norm 0.41 -> 0.4101: 2.4e-4 relative but one unit of the 4 printed decimals
    side = log([x * (1 + 5e-5) for x in LOSSES], NORMS[:-1] + [0.4101])
    result = compat.compare(runs(log(LOSSES, NORMS), side), 10, "2.11")
    assert result.ok, result
    assert result.gaps["grad_norm"] == pytest.approx(1e-4 / 0.41, rel=1e-3)
    assert line(result).endswith("grad_norm 2.4e-04)")


def test_a_larger_gap_is_different_and_names_its_step():
    side = log(LOSSES[:8] + [6.01, 5.85], NORMS[:6] + [0.81] + NORMS[7:])
    result = compat.compare(runs(log(LOSSES, NORMS), side), 10, "2.11")
    assert not result.ok
    assert line(result) == ("transformer_debug 2 ranks compiled: DIFFERENT "
                            "(10 steps; max relative gap loss 8.6e-03 at step 10, grad_norm 1.3e-02 at step 7)")


def test_a_failed_or_short_run_is_failed_with_its_last_line():
    text = log(LOSSES, NORMS)
    assert line(compat.compare(runs(text, text, codes=(0, 1)), 10, "2.11")) == \
        "transformer_debug 2 ranks compiled: FAILED (2.11: exit 1: Error: boom)"
    short = compat.compare(runs(text, log(LOSSES[:7], NORMS[:7])), 10, "2.11")
    assert short.status == "FAILED" and short.detail == "2.11: step 8 not logged with loss and grad_norm (7 of 10 steps): Error: boom"


def test_non_finite_values_are_not_equal_unless_both_match():
    assert compat.relative_gap(float("nan"), float("nan")) == 0
    assert compat.relative_gap(7.0, float("nan")) == float("inf")
    assert not compat.within("loss", 7.0, float("inf"))


def test_unknown_config_is_refused(capsys):
    with pytest.raises(SystemExit) as stop:
        compat.parse_args(["--side-python", "x", "--configs", "transformer_debug,warp"])
    assert stop.value.code == 2 and "unknown config(s) warp" in capsys.readouterr().err


def test_the_shell_script_dry_run_prints_its_commands_and_builds_nothing(tmp_path):
    version = "0.0.1"  # no such environment: the dry run prints its build too
    proc = subprocess.run(["bash", str(REPO / "scripts" / "check_torch_compat.sh"), version, "--dry-run", "--steps", "3",
                           "--out", str(tmp_path / "run")], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "SKIP_SETUP": "1"}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"'python3' '-m' 'venv' '.venv-torch{version}'" in out and f"'torch=={version}'" in out
    assert f"-c' '.venv-torch{version}/constraints.txt' 'torchtitan==0.3.0'" in out and "'torch==2.13.0'" not in out
    trains = [row for row in out.splitlines() if "scripts/train.sh" in row]
    assert len(trains) == 2 * (1 + 2 * 2 * 2)  # per config: the seed, then (1, 2 ranks) x (eager, compiled) x 2 torches
    assert sum("--checkpoint.create-seed-checkpoint" in row for row in trains) == 2
    assert sum("--compile.enable" in row for row in trains) == 8 and sum("NPROC_PER_NODE=2" in row for row in trains) == 8
    assert sum(f"PYTHON={REPO}/.venv-torch{version}/bin/python" in row for row in trains) == 8
    assert all("--training.steps 3" in row and "--metrics.log_freq 1" in row for row in trains)
    assert out.count("cp -r ") == 16
    assert not (REPO / f".venv-torch{version}").exists() and not (tmp_path / "run").exists()


def test_the_shell_script_wants_a_version():
    proc = subprocess.run(["bash", str(REPO / "scripts" / "check_torch_compat.sh"), "--dry-run"], capture_output=True,
                          text=True)
    assert proc.returncode == 2 and "usage:" in proc.stderr
