"""The GPU lease script (scripts/gpu_session.sh / .py) on the CPU: its dry run parses every
command it would run on the H100, and it reads torchtitan's logs into the figures it reports.
(`--debug` runs its sections end to end on the CPU; by hand, 2-4 minutes a model.)"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from conftest import REPO, load_script

from kernels import ptxas

gpu_session = load_script("gpu_session")

LOG = """\
[titan] 2026-11-26 17:28:04,286 - root - INFO - Training starts at step 1
[titan] 2026-11-26 17:28:50,664 - root - INFO - \x1b[31mstep:  1  \x1b[32mloss: 10.47437  grad_norm: 52.9876  memory: 13.15GiB(16.61%)  tps: 166  tflops: 0.40  mfu: 0.04%
[titan] 2026-11-26 17:28:58,352 - root - INFO - validate step:  1  loss:  9.3415  memory: 13.99GiB(17.67%)  tps: 2,131
[titan] 2026-11-26 17:29:01,695 - root - INFO - step:  2  loss:  9.47334  grad_norm: 42.8280  memory: 14.16GiB(17.88%)  tps: 2,451  tflops: 5.95  mfu: 0.60%
"""


def test_dry_run_checks_every_lease_command_and_exits_0():
    run = subprocess.run(["bash", "scripts/gpu_session.sh", "--dry-run"], cwd=REPO, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    checked = [line for line in run.stdout.splitlines() if line.startswith(("ok ", "FAIL "))]
    # 3 models x (train, resume, hf export, perf compiled / graph-replayed / eager); the 2 memory models also
    # perf on the whole-sequence kernels (the same three) and the kernels' check: all parsed
    assert len(checked) == 3 * 6 + 2 * 4 and all(line.startswith("ok ") for line in checked), run.stdout
    assert sum("bench_whole_sequence.py" in line for line in checked) == 2
    graphs = [line for line in checked if "--cuda-graphs" in line]
    assert len(graphs) == 5 and all("--compile" in line and "--steps 10" in line for line in graphs)
    for config in ("transformer_400m", "mela_400m", "titans_mac_400m"):
        trains = [line for line in checked if f"--config {config} " in line and "train.sh" in line]
        assert [("--training.steps 6" in t, "--training.steps 7" in t) for t in trains] == [(True, False), (False, True)]
    assert all("--training.seq_len 4096" in line for line in checked if "train.sh" in line)


def test_dry_run_of_a_bad_section_is_one_line_exit_2():
    run = subprocess.run(["bash", "scripts/gpu_session.sh", "--dry-run", "--only", "speed"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "--only: unknown ['speed']" in run.stderr


def test_dry_run_names_a_flag_the_script_does_not_take(monkeypatch, capsys):
    perf_args = gpu_session.perf_args
    monkeypatch.setattr(gpu_session, "perf_args", lambda *a: [*perf_args(*a), "--bogus"])
    with pytest.raises(SystemExit) as stop:
        gpu_session.main(["--dry-run", "--only", "perf", "--models", "mela"])
    out = capsys.readouterr().out
    assert stop.value.code == 1 and out.count("FAIL") == 6 and "unknown flags ['--bogus']" in out


def test_figures_read_from_a_training_log():
    figures = gpu_session.step_figures(LOG, tokens_per_step=8192)
    assert figures["steps"] == [1, 2] and figures["loss"] == [10.47437, 9.47334]
    assert figures["tokens_per_s"] == 2451 and figures["mfu_percent"] == 0.6 and figures["tflops"] == 5.95
    assert figures["peak_memory_gib"] == 14.16  # the largest of every line, validation included
    assert abs(figures["first_step_s"] - 46.378) < 1e-9  # "Training starts" -> the step-1 line
    assert abs(figures["later_step_s"] - 8192 / 2451) < 1e-9
    assert gpu_session.step_figures("no steps here", 8192) == {}
    assert figures["steady_tokens_per_s"] is None and figures["steady_steps"] == 0  # no step after the capture


def test_steady_state_is_the_mean_of_the_steps_after_the_cuda_graph_capture():
    later = "".join(f"[titan] 2026-11-26 17:29:0{s},695 - root - INFO - step:  {s}  loss:  9.0  memory: 14.16GiB(17.88%)  "
                    f"tps: {tps:,}  tflops: 5.95  mfu: 0.60%\n" for s, tps in ((3, 9000), (4, 10000), (5, 11000), (6, 10000)))
    figures = gpu_session.step_figures(LOG + later, tokens_per_step=8192)
    assert figures["steps"] == [1, 2, 3, 4, 5, 6] and figures["tokens_per_s"] == 10000
    assert figures["steady_tokens_per_s"] == 10000 and figures["steady_steps"] == 4  # 2,451 of the capture step left out


def test_resume_arguments_change_only_the_step_count():
    args = gpu_session.train_args("mela", gpu_session.LEASE, REPO / "work", 2, REPO / "tok")
    resumed = gpu_session.with_steps(args, 3)
    changed = [(a, b) for a, b in zip(args, resumed) if a != b]
    assert changed == [("2", "3")] and len(args) == len(resumed)
    assert args[args.index("--training.steps") + 1] == "2"


def session(tmp_path, **fields):
    import argparse

    args = argparse.Namespace(out=tmp_path / "out", work=tmp_path / "work", steps=2, budget_s=600, debug=False,
                              tokenizer=tmp_path / "tok", only=["main", "perf"], models=["mela"],
                              **{"perf_modes": list(gpu_session.PERF_MODES), **fields})
    args.out.mkdir()
    return gpu_session.Session(args)


def test_perf_rows_with_an_empty_error_are_ok_and_a_command_without_time_is_skipped(tmp_path, monkeypatch):
    s = session(tmp_path)
    row = '{"name": "mela", "tokens_per_s": 4874.0, "error": "", "mfu_percent": 1.2, "peak_memory_gib": 20.6}'
    monkeypatch.setattr(s, "run", lambda *a, **k: (0, f"table line\nJSON {row}\n"))
    outcome = s.perf_section("mela")
    assert outcome.status == "ok" and outcome.figures["compiled"]["tokens_per_s"] == 4874.0
    assert "| perf eager | mela | ok | 4,874 |" in gpu_session.table([outcome])
    monkeypatch.setattr(s, "run", lambda *a, **k: ("no time left", ""))
    outcome = s.perf_section("mela")
    assert outcome.status == ("failed: compiled, compiled_graphs, whole_sequence_compiled, "
                              "whole_sequence_compiled_graphs, eager, whole_sequence")
    assert outcome.figures["eager"]["error"] == "skipped: no time left for eager"


def test_perf_runs_the_chosen_modes_and_compares_a_replay_with_the_same_steps_unreplayed(tmp_path, monkeypatch):
    s = session(tmp_path, perf_modes=["compiled", "compiled_graphs"])
    ran = []

    def run(command, *a, **k):
        replayed = "--cuda-graphs" in command
        ran.append(replayed)
        # unreplayed: steps 0..3 (step 0 the warmup); replayed: replays 1, 2 train steps 1, 2
        losses = [2.0, 1.1] if replayed else [3.0, 2.0, 1.0, 0.5]
        return 0, "JSON " + json.dumps({"tokens_per_s": 1.0, "error": "", "losses": losses}) + "\n"

    monkeypatch.setattr(s, "run", run)
    outcome = s.perf_section("mela")
    assert ran == [False, True] and list(outcome.figures) == ["compiled", "compiled_graphs"]
    limits = []
    monkeypatch.setattr(s, "run", lambda command, log, timeout, env=None: limits.append(timeout) or run(command))
    s.perf_section("mela")
    s.perf_section("titans_mac")
    # Mela's compiled step compiles its HMM modules about ten times: more time than the others' rows
    assert limits == [gpu_session.PERF_TIMEOUT_S["mela"]] * 2 + [gpu_session.TIMEOUT_S["perf"]] * 2
    assert gpu_session.PERF_TIMEOUT_S["mela"] > gpu_session.TIMEOUT_S["perf"]
    assert outcome.figures["compiled_graphs"]["replay_drift"] == pytest.approx(0.1)
    assert "compiled_graphs" not in outcome.figures["compiled"]
    assert "max rel diff 1.0e-01" in gpu_session.table([outcome])
    assert gpu_session.replay_drift({"losses": [3.0]}, {"losses": [2.0]}) is None


def test_an_unknown_perf_mode_is_one_line_exit_2(capsys):
    with pytest.raises(SystemExit) as stop:
        gpu_session.main(["--dry-run", "--perf-modes", "compiled,turbo"])
    assert stop.value.code == 2 and "--perf-modes: unknown ['turbo']" in capsys.readouterr().err


def test_kernels_section_reads_the_check_and_skips_a_model_without_memory(tmp_path, monkeypatch):
    s = session(tmp_path)
    row = ('{"rule": "newton_schulz", "max_relative_error": 2e-06, "equal": true, "whole_sequence_ms": 10.0, '
           '"chunk_loop_ms": 80.0, "speedup": 8.0, "tokens_per_s": 819200.0}')
    commands = []
    monkeypatch.setattr(s, "run", lambda command, *a, **k: commands.append(command) or (0, f"JSON {row}\n"))
    outcome = s.kernels_section("mela")
    assert outcome.status == "ok" and outcome.figures["speedup"] == 8.0
    assert commands[0][1:4] == ["scripts/bench_whole_sequence.py", "--rules", "newton_schulz"]
    assert "| kernels newton_schulz | mela | ok | 819,200 |" in gpu_session.table([outcome])
    assert s.kernels_section("transformer").status == "skipped: no neural memory"
    monkeypatch.setattr(s, "run", lambda *a, **k: (1, "NOT equal\n"))
    assert s.kernels_section("titans_mac").status.startswith("failed")


def test_main_section_trains_resumes_and_exports_from_a_fresh_work_folder(tmp_path, monkeypatch):
    s = session(tmp_path)
    stale = tmp_path / "work" / "mela_400m" / "checkpoint" / "step-3"
    stale.mkdir(parents=True)  # a previous run's checkpoint on a warm machine: must not be resumed from
    calls = []

    def run(command, log, timeout, env=None):
        calls.append(command)
        if len(calls) == 1:
            assert not stale.exists()
            step = tmp_path / "work" / "mela_400m" / "checkpoint" / "step-2"
            step.mkdir(parents=True)
            (step / ".metadata").write_text("")
            return 0, LOG + "validate step:  2  loss: 9.0\n"
        if len(calls) == 2:
            return 0, "[titan] 2026-11-26 17:30:12,869 - root - INFO - Training starts at step 3\n" \
                      "[titan] 2026-11-26 17:30:22,729 - root - INFO - step:  3  loss:  8.67828  tps: 528\n"
        return 0, "PASS  hf_export mela_400m: ...\n"

    monkeypatch.setattr(s, "run", run)
    outcome = s.main_section("mela")
    assert outcome.status == "ok", outcome
    assert [c[1] for c in calls] == ["scripts/train.sh", "scripts/train.sh", "scripts/check_hf_export.py"]
    assert outcome.figures["resume"]["steps"] == [3] and abs(outcome.figures["resume"]["first_step_s"] - 9.86) < 1e-9
    assert outcome.figures["hf_export"].startswith("PASS")


def test_the_kernels_check_tries_wgmma_then_mma_then_fma_and_later_commands_keep_the_first_that_passes(
        tmp_path, monkeypatch):
    """Commands before any check run the FMA units. With FIXED_PTXAS (a ptxas >= 13.3): wgmma
    (Triton's knobs at it) is tried first; it fails here, so it runs once more under memcheck and
    mma.sync is tried (Triton's own ptxas), passes, and is what the commands after it (perf, a
    second model's check) run with. Without a usable FIXED_PTXAS the tries start at mma.sync; all
    failing ends at the FMA units, the mode named `fma`."""
    fixed = tmp_path / "ptxas"
    fixed.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.5, V13.5.37'\n")
    fixed.chmod(0o755)
    monkeypatch.setenv("FIXED_PTXAS", str(fixed))
    s = session(tmp_path, perf_modes=["compiled"])
    envs = []
    row = '{"rule": "newton_schulz", "max_relative_error": 2e-06, "equal": true, "whole_sequence_ms": 10.0, ' \
          '"chunk_loop_ms": 80.0, "speedup": 8.0, "tokens_per_s": 819200.0}'

    def run(command, log, timeout, env=None):
        envs.append(dict(env or {}))
        mode = (env or {}).get(ptxas.TENSOR_CORES_ENV)
        return (1, "illegal memory access\n") if mode == "wgmma" else (0, f"JSON {row}\n")

    monkeypatch.setattr(s, "run", run)
    sanitized = []
    monkeypatch.setattr(s, "sanitize", lambda model, env: sanitized.append(env) or "memcheck exit 1: Invalid __shared__ read")
    wgmma = {**{name: str(fixed) for name in ptxas.ENVS}, ptxas.TENSOR_CORES_ENV: "wgmma"}
    mma, fma = {ptxas.TENSOR_CORES_ENV: "mma"}, {ptxas.TENSOR_CORES_ENV: "fma"}
    s.perf_section("mela")
    outcome = s.kernels_section("mela")
    s.perf_section("mela")
    s.kernels_section("titans_mac")
    assert envs == [fma, wgmma, mma, mma, mma] and sanitized == [wgmma]
    assert outcome.status == "ok" and outcome.figures["tried"] == ["wgmma: failed: check exit 1: illegal memory access",
                                                                   "mma: ok"]
    assert outcome.figures["sanitizer"].startswith("memcheck exit 1") and "mma: ok" in gpu_session.table([outcome])
    monkeypatch.setenv("FIXED_PTXAS", str(tmp_path / "missing"))  # not a usable ptxas: no wgmma try
    (tmp_path / "plain").mkdir()
    plain = session(tmp_path / "plain")
    monkeypatch.setattr(plain, "run", lambda command, log, timeout, env=None: envs.append(dict(env or {})) or (1, "NOT equal\n"))
    monkeypatch.setattr(plain, "sanitize", lambda model, env: "memcheck exit 0: ")
    failed = plain.kernels_section("mela")
    assert envs[-2:] == [mma, fma] and plain.products_env == fma
    assert failed.status.startswith("failed") and failed.figures["tried"][-1].startswith("fma: failed")
    skipped = plain.kernels_section("transformer")
    assert "| kernels  | transformer | skipped: no neural memory |" in gpu_session.table([skipped])


def test_products_starts_every_command_at_a_form_an_earlier_check_passed(tmp_path, monkeypatch):
    """A second invocation (say --only perf after --only kernels) starts at the form named; one
    this machine cannot run (wgmma without FIXED_PTXAS) is one line naming the choices."""
    monkeypatch.delenv("FIXED_PTXAS", raising=False)
    s = session(tmp_path, products="mma")
    assert s.products_env == {ptxas.TENSOR_CORES_ENV: "mma"} and s.candidates[s.next_try] == s.products_env
    (tmp_path / "other").mkdir()
    with pytest.raises(SystemExit, match="--products wgmma is not available here .choose from mma, fma; wgmma needs"):
        session(tmp_path / "other", products="wgmma")


def test_sanitize_runs_the_small_check_under_memcheck_and_keeps_its_first_errors(tmp_path, monkeypatch):
    s = session(tmp_path)
    tool = tmp_path / "compute-sanitizer"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    commands = []
    out = ("========= COMPUTE-SANITIZER\n========= Invalid __shared__ read of size 16 bytes\n"
           "=========     at whole_sequence_fwd+0x1a0\nok line\n========= ERROR SUMMARY: 1 error\n")
    monkeypatch.setattr(s, "run", lambda command, *a, **k: commands.append(command) or (1, out))
    assert s.sanitize("mela", {}) == "memcheck exit 1: Invalid __shared__ read of size 16 bytes | ERROR SUMMARY: 1 error"
    assert commands[0][:4] == [str(tool), "--tool", "memcheck", "--print-limit"] and "--seq-len" in commands[0]
