"""Train the debug configs under the pinned torch and under another torch (a side environment
such as .venv-torch2.11, made by scripts/check_torch_compat.sh) from one seed checkpoint, and
compare every step's loss and grad_norm.

    python scripts/check_torch_compat.py --side-python .venv-torch2.11/bin/python [--label 2.11] \\
        [--steps 10] [--configs transformer_debug,mela_debug] [--ranks 1,2] [--modes eager,compiled] [--dry-run]

Per config, the pinned torch makes one seed checkpoint (`--checkpoint.create-seed-checkpoint`,
step-0); every case (ranks x eager/compiled) then trains twice, pinned and side, each from its
own copy of the seed folder (`--training.steps N --validator.no-enable --debug.seed 0
--training.global_batch_size 4 --metrics.log_freq 1`, through scripts/train.sh with PYTHON set to
the environment's interpreter). One line per case:

    transformer_debug 2 ranks compiled: equal (10 steps; max relative gap loss 0.0e+00, grad_norm 0.0e+00)
    mela_debug 1 rank eager: DIFFERENT (10 steps; max relative gap loss 3.1e-03 at step 9, grad_norm ...)
    mela_debug 2 ranks compiled: FAILED (2.11: <last line of its output>)

"equal": at every step |side - pinned| <= TOLERANCE (1e-4) * |pinned|, for the loss and the
grad_norm, or the two differ by at most one unit of the last printed digit (torchtitan prints the
loss to 5 decimals and grad_norm to 4, so a printed grad_norm below 1 cannot resolve 1e-4).
The gaps printed are relative (|side - pinned| / |pinned|), their maximum over the steps.
mela_debug trains at lr 1e-3 instead of its 3e-3: over 10 steps at 3e-3 a loss spike at steps
8-10 amplifies rounding differences past 1e-4.

Writes the run folder outputs/torch_compat/<date-time>/: results.txt (the versions and the
lines), results.json (every step's values), <config>/seed, <config>/<case>-<env>/ (dump folders)
and <config>/<case>-<env>.log (each run's output). Exit 0 only when every case is equal.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from any directory

from torchtitan_ext.training.run_log import last_line, parse_steps  # noqa: E402

CONFIGS = {
    "transformer_debug": ["--module", "train_configs.transformer", "--config", "transformer_debug"],
    "mela_debug": ["--module", "train_configs.mela", "--config", "mela_debug",
                   "--optimizer.param-groups.0.optimizer-kwargs.lr", "1e-3"],
}
MODES = {"eager": [], "compiled": ["--compile.enable"]}
COMMON = ["--metrics.no-enable-wandb", "--metrics.log_freq", "1", "--metrics.disable_color_printing",
          "--validator.no-enable", "--debug.seed", "0", "--training.global_batch_size", "4"]
TOLERANCE = 1e-4
PRINTED_UNIT = {"loss": 1e-5, "grad_norm": 1e-4}  # torchtitan's step line: loss %8.5f, grad_norm %7.4f
METRICS = ("loss", "grad_norm")
VERSIONS = "import torch, torchtitan; print('torch', torch.__version__, 'torchtitan', torchtitan.__version__)"


@dataclass
class Comparison:
    status: str  # "equal", "DIFFERENT" or "FAILED"
    detail: str
    gaps: dict = field(default_factory=dict)  # metric -> max relative gap

    @property
    def ok(self) -> bool:
        return self.status == "equal"


def relative_gap(pinned: float, side: float) -> float:
    """|side - pinned| / |pinned| (0 for equal values, nan included; inf for a zero or
    non-finite reference that the other value does not match)."""
    if pinned == side or (math.isnan(pinned) and math.isnan(side)):
        return 0.0
    if not (math.isfinite(pinned) and math.isfinite(side)) or pinned == 0:
        return math.inf
    return abs(side - pinned) / abs(pinned)


def within(metric: str, pinned: float, side: float) -> bool:
    """The "equal" criterion for one value (module docstring)."""
    gap = relative_gap(pinned, side)
    return gap <= TOLERANCE or (math.isfinite(gap) and abs(side - pinned) <= PRINTED_UNIT[metric] * (1 + 1e-6))


def compare(runs: dict[str, tuple[int, dict, str]], steps: int, side_label: str) -> Comparison:
    """`runs`: {"pinned": (returncode, parse_steps(output, grad_norm=True), last_line(output)),
    side_label: (...)}, pinned first."""
    for env, (code, logged, tail) in runs.items():
        if code != 0:
            return Comparison("FAILED", f"{env}: exit {code}: {tail}")
        missing = [s for s in range(1, steps + 1) if s not in logged or any(m not in logged[s] for m in METRICS)]
        if missing:
            return Comparison("FAILED", f"{env}: step {missing[0]} not logged with loss and grad_norm "
                                        f"({len(logged)} of {steps} steps): {tail}")
    (_, pinned, _), (_, side, _) = runs["pinned"], runs[side_label]
    gaps, worst, equal = {}, {}, True
    for metric in METRICS:
        per_step = {s: relative_gap(pinned[s][metric], side[s][metric]) for s in range(1, steps + 1)}
        worst[metric] = max(per_step, key=lambda s: per_step[s])
        gaps[metric] = per_step[worst[metric]]
        equal &= all(within(metric, pinned[s][metric], side[s][metric]) for s in per_step)
    text = ", ".join(f"{m} {gaps[m]:.1e}" + ("" if equal else f" at step {worst[m]}") for m in METRICS)
    return Comparison("equal" if equal else "DIFFERENT", f"{steps} steps; max relative gap {text}", gaps)


def case_name(config: str, ranks: int, mode: str) -> str:
    return f"{config} {ranks} rank{'s' if ranks != 1 else ''} {mode}"


def result_line(name: str, result: Comparison) -> str:
    return f"{name}: {result.status} ({result.detail})"


def train_command(python: str, args: list[str], ranks: int, log_dir: Path) -> tuple[dict, list[str]]:
    """(environment overrides, argv) of one `scripts/train.sh` run under `python`."""
    env = {"PYTHON": python, "SKIP_PREFLIGHT": "1", "NPROC_PER_NODE": str(ranks),
           "LOG_DIR": str(log_dir), "WANDB_MODE": "offline"}
    return env, ["bash", str(REPO / "scripts" / "train.sh"), *COMMON, *args]


def shown(env: dict, argv: list[str]) -> str:
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), *map(shlex.quote, argv)])


def run(env: dict, argv: list[str], log: Path, timeout: int) -> tuple[int, str]:
    """Run one command (output to `log` as well); (returncode, output). A timeout is exit 124."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        try:
            code = subprocess.run(argv, cwd=REPO, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
                                  text=True, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            out.write(f"\ncheck_torch_compat: timed out after {timeout} s\n")
            code = 124
    return code, log.read_text(errors="replace")


def versions(python: str) -> str:
    proc = subprocess.run([python, "-c", VERSIONS], capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else f"unusable ({last_line(proc.stderr)})"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--side-python", required=True, help="the other environment's interpreter")
    parser.add_argument("--pinned-python", default=str(REPO / ".venv" / "bin" / "python"))
    parser.add_argument("--label", help="the side environment's name in the lines [its torch version]")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--configs", default=",".join(CONFIGS), type=lambda s: s.split(","))
    parser.add_argument("--ranks", default="1,2", type=lambda s: [int(r) for r in s.split(",")])
    parser.add_argument("--modes", default=",".join(MODES), type=lambda s: s.split(","))
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per training run")
    parser.add_argument("--out", type=Path, help="run folder [outputs/torch_compat/<date-time>]")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(argv)
    for name, chosen, known in (("config", args.configs, CONFIGS), ("mode", args.modes, MODES)):
        if unknown := [c for c in chosen if c not in known]:
            parser.error(f"unknown {name}(s) {', '.join(unknown)}: choose from {', '.join(known)}")
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out or REPO / "outputs" / "torch_compat" / time.strftime("%Y%m%d-%H%M%S")
    pythons = {"pinned": args.pinned_python}
    header = []
    if args.dry_run:
        for python in (args.pinned_python, args.side_python):
            print(shlex.join([python, "-c", VERSIONS]))
        label = args.label or "side"
    else:
        found = {env: versions(python) for env, python in [("pinned", args.pinned_python), ("side", args.side_python)]}
        label = args.label or (found["side"].split()[1].split("+")[0] if found["side"].startswith("torch") else "side")
        header = [f"pinned ({args.pinned_python}): {found['pinned']}", f"{label} ({args.side_python}): {found['side']}",
                  f"equal: relative gap <= {TOLERANCE:.0e} at every step, loss and grad_norm "
                  f"(or within one printed digit: loss 1e-5, grad_norm 1e-4); {args.steps} steps"]
        print("\n".join(header), flush=True)
        out.mkdir(parents=True, exist_ok=True)
    pythons[label] = args.side_python

    build = [args.pinned_python, str(REPO / "scripts" / "build_tokenizer.py")]
    if args.dry_run:
        print(shlex.join(build))
    else:
        subprocess.run(build, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, check=True, stdout=subprocess.DEVNULL)

    lines, details, started = [], {}, time.time()
    for config in args.configs:
        seed = out / config / "seed"
        steps = ["--training.steps", str(args.steps)]
        env, argv = train_command(args.pinned_python, CONFIGS[config] + steps + ["--dump_folder", str(seed),
                                                                                 "--checkpoint.create-seed-checkpoint"],
                                  1, out / config / "logs" / "seed")
        seed_failure = None
        if args.dry_run:
            print(shown(env, argv))
        else:
            code, output = run(env, argv, out / config / "seed.log", args.timeout)
            if code != 0 or not (seed / "checkpoint" / "step-0" / ".metadata").exists():
                seed_failure = f"seed checkpoint: exit {code}: {last_line(output)}"
        for ranks in args.ranks:
            for mode in args.modes:
                name, case = case_name(config, ranks, mode), f"{ranks}r-{mode}"
                runs = {}
                for env_name, python in pythons.items():
                    folder = out / config / f"{case}-{env_name}"
                    env, argv = train_command(python, CONFIGS[config] + steps + MODES[mode] + ["--dump_folder", str(folder)],
                                              ranks, out / config / "logs" / f"{case}-{env_name}")
                    if args.dry_run:
                        print(f"cp -r {shlex.quote(str(seed))} {shlex.quote(str(folder))}")
                        print(shown(env, argv))
                        continue
                    if seed_failure:
                        break
                    shutil.copytree(seed, folder)
                    t0 = time.time()
                    code, output = run(env, argv, out / config / f"{case}-{env_name}.log", args.timeout)
                    runs[env_name] = (code, parse_steps(output, grad_norm=True), last_line(output))
                    print(f"  ({name}, {env_name}: exit {code} in {time.time() - t0:.0f} s)", flush=True)
                if args.dry_run:
                    continue
                result = Comparison("FAILED", seed_failure) if seed_failure else compare(runs, args.steps, label)
                lines.append(result_line(name, result))
                details[name] = {"status": result.status, "gaps": result.gaps,
                                 "steps": {env: logged for env, (_, logged, _) in runs.items()}}
                print(lines[-1], flush=True)
                (out / "results.txt").write_text("\n".join(header + lines) + "\n")
                (out / "results.json").write_text(json.dumps(details, indent=1))
    if args.dry_run:
        return 0
    failed = sum(d["status"] != "equal" for d in details.values())
    print(f"check_torch_compat: {len(lines) - failed} of {len(lines)} cases equal in {time.time() - started:.0f} s; "
          f"results in {out / 'results.txt'}")
    return 0 if lines and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
