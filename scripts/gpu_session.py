"""The one prepared script of a GPU lease (run through scripts/gpu_session.sh; <= 9 minutes on one H100).

    bash scripts/gpu_session.sh [--only main,kernels,perf] [--models transformer,mela,titans_mac] [--steps 6]
        [--perf-modes compiled,compiled_graphs,...] [--products wgmma|mma|fma] [--budget-s 510] [--out DIR]
        [--dry-run] [--debug]

Sections (`--only` picks some, so that a rerun fits what is left of a lease):
  main  the main job, end to end through scripts/train.sh (torchtitan's Trainer: FSDP2 on one
        rank, bf16 parameters, compile and activation checkpointing as the recipe says), for
        transformer_400m, mela_400m and titans_mac_400m in that order (riskiest last): `--steps`
        steps at seq 4096, batch 2, on the embedded corpus with the offline tokenizer (the model
        keeps the paper's 32,000-entry vocabulary; no download), one validation pass on the
        last step (the tied-embedding path of Mela), a DCP checkpoint there; then a second
        launch resumes and trains one more step; then that checkpoint is converted to Hugging
        Face and loaded with transformers, whose logits must equal ours
        (scripts/check_hf_export.py). Reported: tokens/s and MFU of the last step, the mean
        tokens/s of the steps after torchtitan's CUDA-graph warmup and capture (steps 3 on), peak memory,
        the first step's wall time (compilation included) against a later step's.
  perf  scripts/bench_models.py (a plain loop, no torchtitan) at seq 4096, batch 2, bf16
        autocast, fp32 fast weights: the same three models compiled, compiled and replayed as a
        CUDA graph (`--cuda-graphs`, 10 timed replays), and eager; the memory models also on the
        whole-sequence kernels (`--whole-sequence`, the same three ways), in that order (`--perf-modes`
        picks some): tokens/s, MFU, peak memory and the first step's time, the profiler's top 10
        CUDA kernels of one step of each (`--profile`), and for a graph-replayed mode run after
        its unreplayed one, the largest relative difference between their losses step for step.
  kernels  scripts/bench_whole_sequence.py: the whole-sequence kernels against the torch
        reference on CUDA and one memory layer's step against the chunk loop, at head_dim 64,
        hidden 256, chunk 64, seq 4096 (titans_mac: the per-token rule; mela: Newton-Schulz).
        The bf16 products are tried in order (kernels/ptxas.py, WHOLE_SEQUENCE_TENSOR_CORES):
        wgmma with FIXED_PTXAS (a ptxas >= 13.3; gpu_session.sh unpacks the one gpu_wheels.sh
        packs; the form the default `auto` takes on Hopper), then mma.sync, then the FMA units
        (`fma`, what `auto` falls back to without a fixed ptxas); the first that passes is kept
        for every later command and the table lists each try. The first failed tensor-core mode
        runs once more, small, under compute-sanitizer's memcheck where the image has it (its
        first errors in the table, the whole output in kernels_sanitizer.log).
Every command runs under the time left of `--budget-s` (each is cut at it; what does not start
in time is reported as skipped). Results: one markdown table (`gpu_session.md`) and a JSON
(`gpu_session.json`) under `--out`, beside one log per model of main and one of perf; checkpoints and
exports go to `--work` (large: about 5 GB per 400m model).
`--dry-run` prints every command and checks that each parses (the training commands through
the launcher's own checks), without running any. `--debug` runs the same sections on the CPU
with the debug configs at seq 256 (tests/test_gpu_session.py: the pipeline end to end).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

from kernels import ptxas
from torchtitan_ext.training.run_log import ANSI, last_line, parse_steps

REPO = Path(__file__).resolve().parents[1]
MODELS = {  # name -> config module; the order runs cheapest and safest first
    "transformer": "train_configs.transformer",
    "mela": "train_configs.mela",
    "titans_mac": "train_configs.titans",
}
SECTIONS = ("main", "kernels", "perf")  # kernels first: its Triton compiles are cached for perf
# in the order a cut budget should keep them: compiled and graph-replayed first (issue 47's goals)
PERF_MODES = {"compiled": ["--compile"], "compiled_graphs": ["--compile", "--cuda-graphs"],
              "whole_sequence_compiled": ["--whole-sequence", "--compile"],
              "whole_sequence_compiled_graphs": ["--whole-sequence", "--compile", "--cuda-graphs"],
              "eager": [], "whole_sequence": ["--whole-sequence"]}
GRAPH_REPLAYS = 10  # timed replays of a captured step (its first replay untimed)
STEADY_AFTER = 2  # torchtitan's CUDA-graph step: step 1 eager (warmup), step 2 the capture, then replays
KERNEL_RULES = {"titans_mac": "token", "mela": "newton_schulz"}  # the memory models' write rules
BATCH = 2


@dataclass(frozen=True)
class Shape:
    """Where the sections run: the lease's (400m flavors, seq 4096, CUDA) or `--debug`'s."""
    flavor: str
    seq_len: int
    device: str

    def config(self, model: str) -> tuple[str, str]:
        """(config module, config function) of `model` at this shape."""
        return MODELS[model], f"{model}_{self.flavor}"


LEASE, DEBUG = Shape("400m", 4096, "cuda"), Shape("debug", 256, "cpu")
# seconds per command, before the budget's cut; kernels: four Triton compiles (fp32 and bf16, forward and
# backward: up to 268 s for the Newton-Schulz backward on a loaded 2-core CPU)
TIMEOUT_S = {"train": 240, "resume": 150, "hf": 120, "perf": 150, "kernels": 300, "sanitizer": 90}
# Mela's compiled step compiles its HMM's L- and H-module about ten times (grad on and off, inputs that
# do and do not require grad, fresh and carried states: `compile_hmm`): its compiled perf rows did not
# finish warmup and capture in 150 s nor in 225 s on an H200 (2026-11-28), where MAC's took 84 s
PERF_TIMEOUT_S = {"mela": 450}
# the kernels check again under compute-sanitizer's memcheck, small (memcheck slows a kernel 10-100x)
SANITIZED = ["--seq-len", "256", "--batch", "1", "--heads", "2", "--steps", "1"]
TIMESTAMP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")
MEMORY = re.compile(r"memory:\s*([0-9.]+)GiB")


@dataclass
class Outcome:
    """One model's results in one section."""
    model: str
    section: str
    status: str = "skipped"  # ok / failed: <why> / skipped: <why>
    figures: dict = field(default_factory=dict)


def train_args(model: str, shape: Shape, work: Path, steps: int, tokenizer: Path) -> list[str]:
    """scripts/train.sh arguments of the main section's first launch (the resume adds steps)."""
    module, config = shape.config(model)
    return ["--module", module, "--config", config, "--dump_folder", str(work / config),
            "--hf_assets_path", str(tokenizer), "--dataloader.dataset", "embedded",
            "--training.seq_len", str(shape.seq_len), "--training.global_batch_size", str(BATCH),
            "--training.local_batch_size", str(BATCH), "--training.steps", str(steps),
            "--lr_scheduler.warmup_steps", "1", "--checkpoint.interval", str(steps),
            "--validator.freq", str(steps), "--validator.steps", "2",
            "--validator.dataloader.dataset", "embedded_validation",
            "--metrics.log_freq", "1", "--metrics.no-enable-wandb"]


def with_steps(args: list[str], steps: int) -> list[str]:
    """`args` with --training.steps set to `steps`."""
    i = args.index("--training.steps")
    return [*args[: i + 1], str(steps), *args[i + 2:]]


def hf_args(model: str, shape: Shape, work: Path, step: int) -> list[str]:
    module, config = shape.config(model)
    return ["--module", module, "--config", config, "--checkpoint", str(work / config / "checkpoint" / f"step-{step}"),
            "--out", str(work / f"{config}_hf"), "--device", shape.device, "--length", str(min(1024, shape.seq_len))]


def perf_modes(model: str, shape: Shape, chosen: list[str]) -> list[str]:
    """The bench_models modes of `model` among `chosen`: compiled, graph-replayed (CUDA only),
    eager; the memory models also on the whole-sequence kernels."""
    return [m for m in PERF_MODES if m in chosen and (model in KERNEL_RULES or not m.startswith("whole_sequence"))
            and (shape.device == "cuda" or not m.endswith("graphs"))]


def replay_drift(stepped: dict, replayed: dict, warmup: int = 1) -> float | None:
    """The largest relative difference between a graph-replayed run's losses and those of the
    same steps run without graphs (bench_models: replay k trains step warmup + k - 1), or None
    when either run has no losses."""
    ours, theirs = stepped.get("losses") or [], replayed.get("losses") or []
    pairs = list(zip(ours[warmup:], theirs))
    if not pairs:
        return None
    return max(abs(a - b) / max(abs(a), 1e-12) for a, b in pairs)


def perf_args(model: str, shape: Shape, mode: str) -> list[str]:
    steps = GRAPH_REPLAYS if mode.endswith("graphs") else 3
    return ["--models", f"{model}:{shape.flavor}", "--seq-len", str(shape.seq_len), "--batch", str(BATCH),
            "--steps", str(steps), "--warmup", "1", "--device", shape.device, "--profile", "--json",
            *PERF_MODES[mode]]


def kernels_args(model: str, shape: Shape) -> list[str]:
    """bench_whole_sequence.py's arguments: the paper memory shape on the lease, tiny under --debug."""
    sizes = ["--seq-len", str(shape.seq_len)] if shape is LEASE else ["--dry-run"]
    return ["--rules", KERNEL_RULES[model], "--device", shape.device, "--json", *sizes]


def seconds_between(log: str, first: str, then: re.Pattern) -> float | None:
    """Seconds from the log line containing `first` to the next line matching `then`."""
    start = None
    for line in ANSI.sub("", log).splitlines():
        stamp = TIMESTAMP.search(line)
        if not stamp:
            continue
        moment = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f")
        if start is None and first in line:
            start = moment
        elif start is not None and then.search(line):
            return (moment - start).total_seconds()
    return None


def step_figures(log: str, tokens_per_step: int) -> dict:
    """Figures of a training launch's log: last step's tokens/s, TFLOP/s and MFU, the mean
    tokens/s of the steps after the CUDA-graph capture (`STEADY_AFTER`; None without such a
    step), the peak memory, the first step's seconds (compilation included) and a later step's."""
    steps = parse_steps(log)
    if not steps:
        return {}
    last = steps[max(steps)]
    plain = ANSI.sub("", log)
    memory = [float(m) for m in MEMORY.findall(plain)]
    figures = {"steps": sorted(steps), "loss": [steps[s]["loss"] for s in sorted(steps)],
               "tokens_per_s": last.get("tps"), "tflops": last.get("tflops"), "mfu_percent": last.get("mfu"),
               "peak_memory_gib": max(memory) if memory else None,
               "first_step_s": seconds_between(log, "Training starts at step", re.compile(r"(?<!validate )step:\s*1\s"))}
    steady = [steps[s]["tps"] for s in sorted(steps) if s > STEADY_AFTER and steps[s].get("tps")]
    figures["steady_tokens_per_s"] = round(sum(steady) / len(steady)) if steady else None
    figures["steady_steps"] = len(steady)
    if last.get("tps"):
        figures["later_step_s"] = tokens_per_step / last["tps"]
    return figures


def skipped_or_failed(code: int | str, what: str, text: str) -> str:
    """A command's status line: skipped when the budget left no time to start it."""
    if code == "no time left":
        return f"skipped: no time left for {what}"
    return f"failed: {what} exit {code}: {last_line(text)[:160]}"


class Session:
    def __init__(self, args):
        self.args = args
        self.deadline = time.monotonic() + args.budget_s
        self.python = os.environ.get("PYTHON", sys.executable)
        self.shape = DEBUG if args.debug else LEASE
        # The whole-sequence kernels' products to try, in order (kernels/ptxas.py): wgmma with FIXED_PTXAS
        # (gpu_session.sh: a ptxas >= 13.3), mma.sync (Triton's own ptxas), the FMA units (`fma`, named
        # so that an outer setting cannot leak in). Every command runs the FMA units
        # until a kernels check passes with a tensor-core form; then the commands after it run that form
        # (`products_env`), and the next check starts from it (`next_try`).
        fixed = os.environ.get("FIXED_PTXAS")
        version, driver = ptxas.version_of(fixed) if fixed else None, ptxas.driver_major()
        usable = version is not None and version >= ptxas.WGMMA_FIXED and (driver is None or version[0] <= driver)
        wgmma = [{**{name: fixed for name in ptxas.ENVS}, ptxas.TENSOR_CORES_ENV: "wgmma"}] if usable else []
        self.candidates = [*wgmma, {ptxas.TENSOR_CORES_ENV: "mma"}, {ptxas.TENSOR_CORES_ENV: "fma"}]
        self.products_env, self.next_try, self.sanitized = self.candidates[-1], 0, False
        chosen = getattr(args, "products", None)  # a form an earlier run's kernels check passed: from the start
        if chosen:
            modes = [env[ptxas.TENSOR_CORES_ENV] for env in self.candidates]
            if chosen not in modes:
                raise SystemExit(f"gpu_session: --products {chosen} is not available here (choose from "
                                 f"{', '.join(modes)}; wgmma needs FIXED_PTXAS, a ptxas >= 13.3 the driver takes)")
            self.next_try = modes.index(chosen)
            self.products_env = self.candidates[self.next_try]

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, command: list[str], log: Path, timeout: float, env: dict | None = None) -> tuple[int | str, str]:
        """Run `command` (output appended to `log`) under min(timeout, the budget left).
        Returns (exit code or "timeout" / "no time left", its output)."""
        limit = min(timeout, self.left())
        if limit < 20:
            return "no time left", ""
        print(f"$ {shlex.join(command)}   (limit {limit:.0f} s)", flush=True)
        start = time.monotonic()
        with log.open("a") as out:
            out.write(f"\n$ {shlex.join(command)}\n")
            out.flush()
            # Its own process group: at the limit the whole group goes (torchrun and its ranks
            # too, which would otherwise hold the GPU into the next command).
            proc = subprocess.Popen(command, cwd=REPO, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, start_new_session=True)
            try:
                text, _ = proc.communicate(timeout=limit)
                code = proc.returncode
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                text, _ = proc.communicate()
                code = "timeout"
            out.write(text)
            out.write(f"\n# exit {code} after {time.monotonic() - start:.0f} s\n")
        print(f"  -> {code} after {time.monotonic() - start:.0f} s: {last_line(text)[:200]}", flush=True)
        return code, text

    def train_command(self, args: list[str]) -> list[str]:
        return ["bash", "scripts/train.sh", *args]

    def main_section(self, model: str) -> Outcome:
        outcome, work, steps, shape = Outcome(model, "main"), self.args.work, self.args.steps, self.shape
        log = self.args.out / f"main_{model}.log"
        config = shape.config(model)[1]
        for stale in (work / config, work / f"{config}_hf"):  # a rerun on a warm machine starts afresh
            shutil.rmtree(stale, ignore_errors=True)
        first = train_args(model, shape, work, steps, self.args.tokenizer)
        env = {"PYTHON": self.python, "WANDB_MODE": "disabled", **self.products_env}
        code, text = self.run(self.train_command(first), log, TIMEOUT_S["train"], env)
        outcome.figures = step_figures(text, shape.seq_len * BATCH)
        if code != 0:
            outcome.status = skipped_or_failed(code, "train", text)
            return outcome
        checkpoint = work / config / "checkpoint" / f"step-{steps}" / ".metadata"
        validated = "validate step:" in ANSI.sub("", text)
        code, text = self.run(self.train_command(with_steps(first, steps + 1)), log, TIMEOUT_S["resume"], env)
        resumed = parse_steps(text)
        outcome.figures["resume"] = {"steps": sorted(resumed), "loss": [resumed[s]["loss"] for s in sorted(resumed)],
                                     "first_step_s": seconds_between(text, "Training starts at step",
                                                                     re.compile(r"(?<!validate )step:\s*\d+\s"))}
        # A resumed launch trains step steps+1 only: it loaded the checkpoint instead of starting over.
        resume_ok = code == 0 and sorted(resumed) == [steps + 1] and checkpoint.exists()
        if not resume_ok:
            outcome.status = skipped_or_failed(code, f"resume (steps {sorted(resumed)})", text)
            return outcome
        code, text = self.run([self.python, "scripts/check_hf_export.py", *hf_args(model, shape, work, steps + 1)], log,
                              TIMEOUT_S["hf"])
        outcome.figures["hf_export"] = last_line(text)
        outcome.figures["validated"] = validated
        outcome.status = "ok" if code == 0 and validated else \
            skipped_or_failed(code, f"hf export (validated: {validated})", text)
        return outcome

    def perf_section(self, model: str) -> Outcome:
        outcome = Outcome(model, "perf")
        log = self.args.out / "perf.log"
        for mode in perf_modes(model, self.shape, self.args.perf_modes):
            timeout = PERF_TIMEOUT_S.get(model, TIMEOUT_S["perf"]) if "compiled" in mode else TIMEOUT_S["perf"]
            code, text = self.run([self.python, "scripts/bench_models.py", *perf_args(model, self.shape, mode)], log,
                                  timeout, self.products_env)
            rows = [json.loads(line[len("JSON "):]) for line in text.splitlines() if line.startswith("JSON ")]
            outcome.figures[mode] = rows[0] if rows and code == 0 else {"error": skipped_or_failed(code, mode, text)}
            if mode.endswith("_graphs") and (stepped := outcome.figures.get(mode.removesuffix("_graphs"))):
                outcome.figures[mode]["replay_drift"] = replay_drift(stepped, outcome.figures[mode])
        failed = [m for m, f in outcome.figures.items() if f.get("error")]
        outcome.status = "ok" if not failed else f"failed: {', '.join(failed)}"
        return outcome

    def kernels_section(self, model: str) -> Outcome:
        outcome = Outcome(model, "kernels")
        if model not in KERNEL_RULES:
            outcome.status = "skipped: no neural memory"
            return outcome
        interpreted = {"TRITON_INTERPRET": "1"} if self.shape.device == "cpu" else {}
        tried, sanitizer = [], {}
        for index in range(self.next_try, len(self.candidates)):  # from the form kept so far on, until one passes
            env = self.candidates[index]
            code, text = self.run([self.python, "scripts/bench_whole_sequence.py", *kernels_args(model, self.shape)],
                                  self.args.out / "kernels.log", TIMEOUT_S["kernels"], {**interpreted, **env})
            rows = [json.loads(line[len("JSON "):]) for line in text.splitlines() if line.startswith("JSON ")]
            passed = code == 0 and bool(rows)
            tried.append(f"{env[ptxas.TENSOR_CORES_ENV]}: "
                         f"{'ok' if passed else skipped_or_failed(code, 'check', text)}")
            outcome.figures = {**(rows[0] if rows else {}), "tried": tried}
            outcome.status = "ok" if passed else skipped_or_failed(code, "whole-sequence kernels", text)
            if passed:
                self.products_env, self.next_try = env, index
                break
            # the first failed tensor-core form, under memcheck
            if env[ptxas.TENSOR_CORES_ENV] != "fma" and not self.sanitized:
                self.sanitized = True
                sanitizer = {"sanitizer": self.sanitize(model, {**interpreted, **env})}
        else:  # none passed: the later commands run the FMA products
            self.products_env, self.next_try = self.candidates[-1], len(self.candidates) - 1
        outcome.figures.update(sanitizer)
        return outcome

    def sanitize(self, model: str, env: dict) -> str:
        """The failed kernels check once more, small, under compute-sanitizer's memcheck (where the
        image has it): its first error lines, which name the kernel and the access."""
        tool = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
        if not os.path.exists(tool):
            return "no compute-sanitizer on this image"
        code, text = self.run([tool, "--tool", "memcheck", "--print-limit", "3", self.python,
                               "scripts/bench_whole_sequence.py", "--rules", KERNEL_RULES[model], "--device",
                               self.shape.device, "--json", *SANITIZED],
                              self.args.out / "kernels_sanitizer.log", TIMEOUT_S["sanitizer"], env)
        errors = [line.strip("= ") for line in text.splitlines()
                  if line.startswith("=========") and ("Invalid" in line or "Error" in line or "error" in line)]
        return f"memcheck exit {code}: " + " | ".join(errors[:3])


def table(outcomes: list[Outcome]) -> str:
    """The markdown table of every outcome."""
    lines = ["| section | model | status | tokens/s | MFU % | peak GiB | first step s | detail |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]

    def fmt(x, spec=",.0f"):
        return "-" if x is None else format(x, spec)

    for o in outcomes:
        f = o.figures
        if o.section == "main":
            detail = (f"steady {fmt(f.get('steady_tokens_per_s'))} tokens/s over {f.get('steady_steps', 0)} steps after "
                      f"the capture; loss {f.get('loss')}; resume {f.get('resume', {}).get('steps')}; "
                      f"{f.get('hf_export', '')}")
            lines.append(f"| main | {o.model} | {o.status} | {fmt(f.get('tokens_per_s'))} | {fmt(f.get('mfu_percent'), '.1f')} "
                         f"| {fmt(f.get('peak_memory_gib'), '.1f')} | {fmt(f.get('first_step_s'), '.0f')} | {detail} |")
        elif o.section == "kernels":
            detail = (f"vs reference {f['max_relative_error']:.1e} fp32, {f.get('bf16_relative_error', float('nan')):.1e} "
                      f"bf16 on the {f.get('bf16_product_units')} (ptxas {f.get('ptxas')}; torch under autocast "
                      f"{f.get('autocast_relative_error', float('nan')):.1e}); tried {f.get('tried')}; "
                      f"layer {f['whole_sequence_ms']:.1f} ms vs chunk loop "
                      f"{f['chunk_loop_ms']:.1f} ms ({f['speedup']:.2f}x)") if "max_relative_error" in f \
                else f"tried {f['tried']}; {f.get('sanitizer', '')}" if "tried" in f else ""
            lines.append(f"| kernels {f.get('rule', '')} | {o.model} | {o.status} | {fmt(f.get('tokens_per_s'))} "
                         f"| - | - | - | {detail} |")
        else:
            for mode in [m for m in PERF_MODES if m in f]:
                r = f.get(mode, {})
                drift = f"losses vs unreplayed: max rel diff {fmt(r['replay_drift'], '.1e')}; " \
                    if "replay_drift" in r else ""
                lines.append(f"| perf {mode} | {o.model} | {r.get('error') or o.status} | {fmt(r.get('tokens_per_s'))} "
                             f"| {fmt(r.get('mfu_percent'), '.1f')} | {fmt(r.get('peak_memory_gib'), '.1f')} "
                             f"| {fmt(r.get('first_step_s'), '.0f')} | {drift}top kernels: {r.get('top_kernels', [])[:3]} |")
    return "\n".join(lines)


def script_flags(python: str, script: str) -> set[str]:
    """The flags `script --help` lists (scripts import no other script, so it is asked, not imported)."""
    text = subprocess.run([python, script, "--help"], cwd=REPO, capture_output=True, text=True, timeout=300).stdout
    return set(re.findall(r"--[a-z][a-z0-9-]*", text))


def dry_run(session: Session) -> int:
    """Print every command and check it: the training launches through the launcher's own
    checks (config parsed, model built on the meta device, data and tokenizer found), the other
    scripts' flags against their --help. 0 when all pass."""
    from torchtitan_ext.errors import UserError
    from torchtitan_ext.training import cli, preflight

    a, shape, failures = session.args, session.shape, 0
    scripts = {"hf": "scripts/check_hf_export.py", "perf": "scripts/bench_models.py",
               "kernels": "scripts/bench_whole_sequence.py"}
    needed = {"hf"} if "main" in a.only else set()
    needed |= {section for section in ("perf", "kernels") if section in a.only}
    flags = {kind: script_flags(session.python, scripts[kind]) for kind in needed}
    for model in a.models:
        commands = []
        if "main" in a.only:
            first = train_args(model, shape, a.work, a.steps, a.tokenizer)
            commands += [("train", first), ("train", with_steps(first, a.steps + 1)),
                         ("hf", hf_args(model, shape, a.work, a.steps + 1))]
        if "perf" in a.only:
            commands += [("perf", perf_args(model, shape, mode)) for mode in perf_modes(model, shape, a.perf_modes)]
        if "kernels" in a.only and model in KERNEL_RULES:
            commands.append(("kernels", kernels_args(model, shape)))
        for kind, args in commands:
            if kind == "train":
                shown = session.train_command(args)
                try:
                    preflight.check(cli.parse(args), explicit_local_batch=True)
                    problem = None
                except (UserError, SystemExit) as e:
                    problem = str(e)
            else:
                shown = ["python", scripts[kind], *args]
                unknown = [arg for arg in args if arg.startswith("--") and arg not in flags[kind]]
                problem = f"unknown flags {unknown}" if unknown else None
            failures += problem is not None
            print(f"ok     {shlex.join(shown)}" if problem is None else f"FAIL   {shlex.join(shown)}: {problem}")
    return int(failures > 0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(SECTIONS), help=f"sections, comma-separated: {', '.join(SECTIONS)}")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated: {', '.join(MODELS)}")
    p.add_argument("--steps", type=int, default=6, help="training steps of the main section's first launch (6: four "
                   "after torchtitan's CUDA-graph warmup and capture)")
    p.add_argument("--perf-modes", default=",".join(PERF_MODES),
                   help=f"perf's bench_models modes, comma-separated: {', '.join(PERF_MODES)}")
    p.add_argument("--budget-s", type=float, default=510, help="wall-clock seconds for everything")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or REPO / "outputs" / "gpu_session"))
    p.add_argument("--work", type=Path, default=Path("/tmp/gpu_session"), help="checkpoints and exports")
    p.add_argument("--dry-run", action="store_true", help="print every command, check each parses, run none")
    p.add_argument("--debug", action="store_true", help="debug configs at seq 256 on the CPU")
    p.add_argument("--products", choices=("wgmma", "mma", "fma"), help="the whole-sequence kernels' bf16 products "
                   "for every command from the start: a form an earlier run's kernels check passed (default: the FMA "
                   "units until this run's check passes a tensor-core form)")
    args = p.parse_args(argv)
    args.only = args.only.split(",")
    args.models = args.models.split(",")
    args.perf_modes = args.perf_modes.split(",")
    for value, allowed, flag in ((args.only, SECTIONS, "--only"), (args.models, MODELS, "--models"),
                                 (args.perf_modes, PERF_MODES, "--perf-modes")):
        if unknown := [v for v in value if v not in allowed]:
            p.error(f"{flag}: unknown {unknown}; choose from {', '.join(allowed)}")
    from torchtitan_ext.paths import default_tokenizer_dir

    args.tokenizer = default_tokenizer_dir()
    session = Session(args)
    if args.dry_run:
        sys.exit(dry_run(session))
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    versions = {"date": datetime.now().strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__,
                "cuda": torch.version.cuda, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        versions["triton"] = None
    fixed = os.environ.get("FIXED_PTXAS")
    versions["fixed_ptxas"] = fixed and ".".join(map(str, ptxas.version_of(fixed) or ()))
    print(f"gpu_session: {versions}", flush=True)
    outcomes = []
    for section in args.only:
        for model in args.models:
            outcome = getattr(session, f"{section}_section")(model) if session.left() > 20 else \
                Outcome(model, section, "skipped: budget spent")
            outcomes.append(outcome)
            print(f"{section} {model}: {outcome.status}", flush=True)
            (args.out / "gpu_session.json").write_text(json.dumps(
                {"versions": versions, "outcomes": [asdict(o) for o in outcomes]}, indent=1))
    text = f"GPU session {versions}\n\n{table(outcomes)}\n"
    (args.out / "gpu_session.md").write_text(text)
    print(text, flush=True)
    sys.exit(0 if all(o.status == "ok" for o in outcomes) else 1)


if __name__ == "__main__":
    main()
