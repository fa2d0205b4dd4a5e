"""scripts/bench_models.py: every family builds, trains a few steps and reports tokens/s and MFU
(a dry run on the CPU), and the loop runs where torchtitan cannot be imported."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import load_script, REPO

ROW = re.compile(r"^(\S+)\s+(\S+)\s+([\d.]+)M\s+([\d,]+)\s+([\d.]+)\s+([\d.]+)%")


def rows(out: str) -> dict[str, tuple[float, float]]:
    """{model: (tokens/s, MFU %)} of the table's measured rows."""
    found = {}
    for line in out.splitlines():
        match = ROW.match(line)
        if match:
            found[match[1]] = (float(match[4].replace(",", "")), float(match[6]))
    return found


def test_dry_run_trains_every_family(capsys):
    bench = load_script("bench_models")
    assert bench.main(["--device", "cpu", "--dry-run"]) == 0
    table = rows(capsys.readouterr().out)
    assert set(table) == set(bench.DEBUG)  # every family, none failed or skipped
    for tokens_per_s, mfu in table.values():
        assert tokens_per_s > 0 and mfu > 0  # (the CPU peak is one noisy matmul on a shared machine: no upper bound)


def test_runs_without_torchtitan():
    """torchtitan made unimportable (as on an image whose torch is older than the pin): every
    family still builds and trains, the backbone and GradMem (whose torchtitan pieces live in
    modules of their own) included."""
    code = ("import sys, runpy; sys.modules['torchtitan'] = None; "
            "sys.argv = ['bench_models.py', '--device', 'cpu', '--dry-run']; "
            "runpy.run_path('scripts/bench_models.py', run_name='__main__')")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    bench = load_script("bench_models")
    assert set(rows(out.stdout)) == set(bench.DEBUG), out.stdout


def test_whole_sequence_flag_switches_every_memory_and_names_a_model_without_one():
    """`--whole-sequence` on a model without a neural memory is an error row naming why; on a
    memory model it switches every memory layer (one per Titans block)."""
    bench = load_script("bench_models")
    result = bench.bench("transformer", "debug", device=bench.torch.device("cpu"), batch=1, seq_len=16, steps=1,
                         warmup=0, bf16=False, compile_model=False, whole_sequence=True)
    assert result.error == "--whole-sequence: this model has no neural memory"
    from models.memory.neural_memory import use_whole_sequence
    from torchtitan_ext.plain_step import build

    model, cfg, _ = build("titans_mac", "debug")
    assert use_whole_sequence(model) == cfg.n_layers
    assert all(m.cfg.whole_sequence for m in model.modules() if hasattr(m, "cfg") and hasattr(m.cfg, "whole_sequence"))


def test_cuda_graphs_flag_needs_a_cuda_device(capsys):
    """`--cuda-graphs` captures a step on a CUDA device (`capture_step`); elsewhere each model is
    an error row naming the device, and the exit status is 1."""
    bench = load_script("bench_models")
    assert bench.main(["--device", "cpu", "--dry-run", "--cuda-graphs", "--models", "transformer"]) == 1
    assert "--cuda-graphs needs a CUDA device (--device cuda)" in capsys.readouterr().out
