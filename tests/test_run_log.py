"""The step-line parser shared by the demo, gpu_check and the tests; the demo's summary line."""

from __future__ import annotations

import pytest

from conftest import load_script
from torchtitan_ext.training.run_log import parse_steps

summary = load_script("summarize_run").summary

LOG = ("[titan] \x1b[31mstep:  1  \x1b[32mloss:  8.50000  grad_norm: 1.0  tps: 1,000  mfu: N/A\x1b[39m\n"
       "[titan] step:  2  loss:  7.25000  grad_norm: 1.0  tps: 3,000  mfu: 1.50%\n"
       "[titan] step:  3  loss:  6.00000  grad_norm: 1.0  tps: 2,000  tflops: 0.25  mfu: 1.40%\n")


def test_summary_is_one_line_with_loss_fall_throughput_and_checkpoint(tmp_path):
    (tmp_path / "run.log").write_text(LOG)
    (tmp_path / "dump" / "checkpoint" / "step-3").mkdir(parents=True)
    (tmp_path / "dump" / "checkpoint" / "step-10").mkdir()
    line = summary("toy_debug", tmp_path / "run.log", tmp_path / "dump")
    assert "\n" not in line
    assert line.startswith("toy_debug: loss 8.500 -> 6.000 (steps 1-3), 3,000 tokens/s")  # median of steps 2-3
    assert line.endswith("step-10")


def test_a_log_without_steps_names_its_last_line(tmp_path):
    (tmp_path / "run.log").write_text("starting\nerror: dataset path 'x' does not exist\n\n")
    with pytest.raises(SystemExit, match="toy_debug: no training step .* dataset path 'x' does not exist"):
        summary("toy_debug", tmp_path / "run.log", tmp_path)


def test_step_lines_parse_with_colours_and_optional_fields():
    steps = parse_steps(LOG)
    assert steps[1]["loss"] == 8.5 and steps[1]["tps"] == 1000 and steps[1]["mfu"] != steps[1]["mfu"]  # N/A: nan
    assert steps[3] == {"loss": 6.0, "tps": 2000, "tflops": 0.25, "mfu": 1.4}


def test_validation_lines_are_not_training_steps():
    log = LOG + "[titan] \x1b[33mvalidate step:  3  \x1b[32mloss:  9.00000  memory: 1GiB\n"
    assert {step: entry["loss"] for step, entry in parse_steps(log).items()} == {1: 8.5, 2: 7.25, 3: 6.0}
