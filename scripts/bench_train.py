"""Benchmark: training throughput of transformer_debug on this machine, compile off vs on.

Measures this machine's fp32 matmul FLOP/s first (the peak the ratios are taken
against), then trains `transformer_debug` through `scripts/train.sh` twice (eager,
compiled) and reports median tokens/s, achieved FLOP/s (torchtitan's 6N + attention
count) and their fraction of the measured matmul FLOP/s. Steps before `--skip`
(compilation, warm-up) are left out.

    python scripts/bench_train.py [--steps 40] [--skip 5] [--config transformer_debug]
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from torchtitan_ext.training.cpu import measured_matmul_flops
from torchtitan_ext.families import family_of_config_function
from torchtitan_ext.training.run_log import parse_steps


def run(config: str, steps: int, compiled: bool) -> list[tuple[int, float, float]]:
    module = family_of_config_function(config).config_module
    with tempfile.TemporaryDirectory() as dump:
        args = ["bash", "scripts/train.sh", "--module", module, "--config", config,
                "--training.steps", str(steps), "--metrics.log_freq", "1", "--metrics.no-enable-wandb",
                "--metrics.disable_color_printing", "--validator.no-enable", "--checkpoint.no-enable",
                "--dump_folder", dump] + (["--compile.enable"] if compiled else [])
        out = subprocess.run(args, cwd=REPO, capture_output=True, text=True, env={**os.environ, "SKIP_SETUP": "1"})
    if out.returncode != 0:
        sys.exit(f"error: training failed:\n{out.stderr[-2000:]}")
    return [(step, entry["tps"], entry["tflops"] * 1e12)
            for step, entry in parse_steps(out.stdout + out.stderr).items() if "tflops" in entry]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="transformer_debug")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip", type=int, default=5)
    args = parser.parse_args()
    peak = measured_matmul_flops()
    print(f"machine: {os.cpu_count()} cores, fp32 2048x2048 matmul {peak / 1e9:.1f} GFLOP/s")
    print(f"{'mode':<10} {'tokens/s':>10} {'GFLOP/s':>9} {'of matmul peak':>15}")
    results = {}
    for mode, compiled in (("eager", False), ("compiled", True)):
        steps = [r for r in run(args.config, args.steps, compiled) if r[0] > args.skip]
        tps = statistics.median(r[1] for r in steps)
        flops = statistics.median(r[2] for r in steps)
        results[mode] = tps
        print(f"{mode:<10} {tps:>10,.0f} {flops / 1e9:>9.1f} {flops / peak:>14.1%}")
    print(f"compiled / eager tokens/s: {results['compiled'] / results['eager']:.2f}x")


if __name__ == "__main__":
    main()
