"""Read torchtitan's console step lines (one parser for the demo, gpu_check and the tests)."""

from __future__ import annotations

import math
import re

ANSI = re.compile(r"\x1b\[[0-9;]*m")
STEP = re.compile(r"(?<!validate )step:\s*(\d+)\s+loss:\s*([0-9.eE+-]+|nan|inf)")  # training steps, not validation
TPS = re.compile(r"tps:\s*([0-9,]+)")
MFU = re.compile(r"mfu:\s*([0-9.]+%|N/A)")
TFLOPS = re.compile(r"tflops:\s*([0-9.]+)")
GRAD_NORM = re.compile(r"grad_norm:\s*([0-9.eE+-]+|nan|inf)")


def parse_steps(text: str, grad_norm: bool = False) -> dict[int, dict[str, float]]:
    """Log text -> {step: {"loss", and "tps", "tflops", "mfu" (percent; nan when N/A) where logged}}.
    `grad_norm`: also "grad_norm" where logged (opt-in, so the entries the callers compare whole
    keep their keys; scripts/check_torch_compat.py compares it step by step)."""
    steps = {}
    for line in ANSI.sub("", text).splitlines():
        match = STEP.search(line)
        if not match:
            continue
        entry = {"loss": float(match.group(2))}
        if grad_norm and (norm := GRAD_NORM.search(line)):
            entry["grad_norm"] = float(norm.group(1))
        if tps := TPS.search(line):
            entry["tps"] = float(tps.group(1).replace(",", ""))
        if tflops := TFLOPS.search(line):
            entry["tflops"] = float(tflops.group(1))
        if mfu := MFU.search(line):
            entry["mfu"] = float(mfu.group(1)[:-1]) if mfu.group(1).endswith("%") else math.nan
        steps[int(match.group(1))] = entry
    return steps


def last_line(text: str) -> str:
    """The last non-empty line of a run's output (its error, when it failed)."""
    lines = [line for line in ANSI.sub("", text).splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no output)"
