"""scripts/gpu_check.sh: the parts checkable without a GPU (skip line, arguments, the
comparisons and log parsing its checks rest on, a family check run on the CPU)."""

from __future__ import annotations

import subprocess

import pytest
import torch

from conftest import load_script, REPO
from torchtitan_ext.training.run_log import last_line, parse_steps

gpu_check = load_script("gpu_check")

SAMPLE_LOG = ("[titan] 2026-11-22 10:00:09,067 - root - INFO - \x1b[31mstep:  3  \x1b[32mloss:  7.12345  "
              "\x1b[33mgrad_norm:  1.2000  \x1b[34mmemory:  1.20GiB(2.00%)  \x1b[34mtps: 12,345  "
              "\x1b[36mtflops: 3.21  \x1b[35mmfu: 41.50%\x1b[39m\n"
              "[titan] ... step:  4  loss:  7.00000  grad_norm:  1.1  memory:  1.20GiB(2.00%)  tps: 999  "
              "tflops: 0.10  mfu: N/A\n")


def test_without_cuda_it_skips_with_one_line():
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                          env={"SKIP_SETUP": "1", "PATH": "/usr/bin:/bin"}, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines() == ["gpu_check: skipped: no CUDA device (torch.cuda.is_available() is False)"]


def test_unknown_check_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as stop:
        gpu_check.parse_args(["--only", "kernels,warp"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip() == ("error: unknown check(s) warp: choose from families, attention, "
                                               "kernels, drift, train, throughput")
    assert gpu_check.parse_args(["--only", "kernels,drift"]).only == ["kernels", "drift"]


def test_compare_passes_agreement_and_fails_errors():
    want = torch.randn(4, 8)
    assert gpu_check.compare("same", want + 1e-5, want, 1e-3).ok
    assert not gpu_check.compare("off", want + 0.1 * want.abs().max(), want, 1e-3).ok
    assert not gpu_check.compare("shape", want[:2], want, 1e-3).ok
    assert not gpu_check.compare("nan", torch.full_like(want, float("nan")), want, 1e-3).ok


def test_step_lines_give_loss_throughput_and_mfu():
    steps = parse_steps(SAMPLE_LOG)
    assert steps[3] == {"loss": 7.12345, "tps": 12345.0, "tflops": 3.21, "mfu": 41.5}
    assert steps[4]["tps"] == 999.0 and steps[4]["mfu"] != steps[4]["mfu"]  # N/A -> nan
    assert gpu_check.loss_falls("run", 0, steps, "").ok
    assert not gpu_check.loss_falls("run", 0, {1: {"loss": 5.0}, 2: {"loss": 6.0}}, "").ok
    assert "Error: boom" in gpu_check.loss_falls("run", 1, steps, "Error: boom").detail
    assert last_line("step 1\n\x1b[31mError: boom\x1b[0m\n\n") == "Error: boom"


def test_family_check_runs_on_the_cpu():
    results = gpu_check.check_family("titans_mag", "cpu", compiled=False)
    assert [r.name for r in results] == ["titans_mag float32 fwd+bwd", "titans_mag bfloat16 fwd+bwd"]
    assert all(r.ok for r in results), results
