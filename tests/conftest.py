"""Shared test helpers: the offline tokenizer, launching training through scripts/train.sh, and
loading a command-line script of scripts/ as a module (scripts/ is on no import path)."""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run in the interpreter on CPU. Set before anything imports triton
    # (torchtitan does): triton reads it when each kernel is defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]

from torchtitan_ext.data.default_tokenizer import build  # noqa: E402

from torchtitan_ext.paths import default_tokenizer_dir  # noqa: E402
from torchtitan_ext.training.run_log import parse_steps  # noqa: E402


@functools.cache
def load_script(name: str):
    """scripts/<name>.py loaded as a module, once per session, for the tests that call a
    script's main or its helpers (scripts/ is on no import path: library code lives in the
    packages)."""
    spec = importlib.util.spec_from_file_location(f"scripts.{name}", REPO / "scripts" / f"{name}.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


QUIET = ["--metrics.no-enable-wandb", "--metrics.log_freq", "1", "--metrics.disable_color_printing"]


def exit_code(main, argv) -> int:
    """main(argv) (a script's or module's `main`) run in this process: its exit code, 0 when it returns."""
    try:
        main(list(argv))
    except SystemExit as exited:
        return exited.code
    return 0


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    build(default_tokenizer_dir(), 4096)
    return default_tokenizer_dir()


@pytest.fixture(scope="session")
def seed_cache(tmp_path_factory) -> Path:
    """A folder the session's xdist workers share (the parent of each worker's temporary root;
    the root itself without xdist), holding one seed checkpoint per family
    (tests/training_runs.py `seeded_folder`)."""
    root = tmp_path_factory.getbasetemp()
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


class Run:
    def __init__(self, proc: subprocess.CompletedProcess):
        self.returncode = proc.returncode
        self.output = proc.stdout + proc.stderr
        self.losses = {step: entry["loss"] for step, entry in parse_steps(self.output).items()}

    def __repr__(self) -> str:
        return f"Run(rc={self.returncode}, tail={self.output[-3000:]!r})"


def train_env(nproc: int = 1, env: dict | None = None, preflight: bool = False) -> dict:
    """The environment of a test's `scripts/train.sh` run (CPU, SKIP_SETUP, NPROC_PER_NODE).
    `preflight`: run the launcher's checks (10 s a call; the ranks run them again anyway),
    for the tests of its exit 2; scripts/test.sh builds the default tokenizer beforehand, the
    only thing the launcher's checks would otherwise build before the ranks start."""
    return {**os.environ, "SKIP_SETUP": "1", "SKIP_PREFLIGHT": str(int(not preflight)), "NPROC_PER_NODE": str(nproc),
            "PYTHONPATH": f"{REPO}:{REPO / 'tests'}", **(env or {})}


def train_command(args: list[str]) -> list[str]:
    return ["bash", str(REPO / "scripts" / "train.sh"), *QUIET, *args]  # a tyro subcommand may end ARGS


def train(args: list[str], nproc: int = 1, timeout: int = 600, env: dict | None = None, preflight: bool = False) -> Run:
    """Run `bash scripts/train.sh ARGS` (`train_env`) and collect its logged losses."""
    proc = subprocess.run(train_command(args), cwd=REPO, env=train_env(nproc, env, preflight), capture_output=True,
                          text=True, timeout=timeout)
    return Run(proc)


@pytest.fixture
def float64():
    """float64 as the default dtype for one test (exactness checks)."""
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


def streamed(model, tokens: torch.Tensor, splits: list[int]) -> torch.Tensor:
    """The model's outputs for tokens read call by call in segments of `splits` tokens,
    the stream state carried (no gradients)."""
    outputs, state, start = [], None, 0
    with torch.no_grad():
        for length in splits:
            out, state = model.stream(tokens[:, start : start + length], state)
            outputs.append(out)
            start += length
    return torch.cat(outputs, 1)


def pytest_collection_modifyitems(items):
    """Slow (end-to-end) tests first: on scripts/test.sh's two workers the longest files start
    early instead of leaving one worker alone at the end (otherwise the order is kept)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
