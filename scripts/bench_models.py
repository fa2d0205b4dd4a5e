"""Training throughput (tokens/s, MFU) of every model family's paper flavor, without torchtitan.

    python scripts/bench_models.py [--models titans_mac:400m,mela:400m] [--batch 2] [--seq-len 4096]
        [--steps 10] [--warmup 3] [--compile] [--cuda-graphs] [--whole-sequence] [--device cuda]
    python scripts/bench_models.py --device cpu --dry-run     # every family at debug size, a few steps
    python scripts/bench_models.py --models titans_mac:400m --device cuda --profile --json   # + top kernels, JSON

A plain loop per model: the family's `models/` class built from its flavor's config, random
tokens, cross-entropy (plus a model's own auxiliary loss, e.g. GradMem's write loss), AdamW
(fused on CUDA), bf16 autocast on CUDA with fp32 parameters (each neural memory keeps its fast
weights in fp32 by its own rule), optionally compiled as the family's training compiles it
(`Family.compile`: torchtitan's per-block compile of `layers`, or the family's regions, Titans;
the rest of the model runs eager, as in training). Nothing here
imports torchtitan (the families' registry modules keep their torchtitan pieces, such as the
backbone's state-dict adapter and GradMem's loss, in modules of their own), so it runs on any
torch >= 2.11 with CUDA, where torchtitan 0.3.0 cannot.

MFU = tokens/s x the family's training FLOPs per token (`Family.flops_per_token`; the
Transformer++: 6 x non-embedding parameters + attention, torchtitan's count, written with
`torchtitan_ext.flops`) / the device's peak: dense bf16 from a table of known GPUs (H100 SXM
and H200: 989 TFLOP/s), else a measured matmul's FLOP/s (bf16 on CUDA, fp32 on CPU). Steps
before `--warmup` (compilation, allocator warm-up) are not timed. `--dry-run`: debug flavors,
fp32, batch 2, 3 steps, short sequences: proves every family builds, steps and reports.
The first step's wall time (compilation included) is reported beside the timed steps'.
`--whole-sequence` puts every neural memory on the whole-sequence kernels (kernels/whole_sequence.py).
`--cuda-graphs` (CUDA): after the warmup, one step is captured as a CUDA graph and the timed
steps are its replays (`capture_step`), the step's launch cost paid once on the host. Every
step's loss is reported: with `--warmup W`, replay k trains what step W + k - 1 of the same
run without graphs trains (same seed, same batch), so the two lists check a replay's arithmetic.
`--profile` runs one more step under torch.profiler and reports the 10 kernels (CUDA; CPU ops
on a CPU) with the most self time; `--json` adds one `JSON {...}` line per model
(scripts/gpu_session.py reads them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import traceback
from dataclasses import dataclass

import torch

from kernels.ptxas import arch_of, use_fixed_ptxas
from models.memory.neural_memory import use_whole_sequence
from torchtitan_ext.families import family_and_overrides
from torchtitan_ext.plain_step import build, fitted_length, inputs, loss_of
from torchtitan_ext.training.cpu import measured_matmul_flops

# Each family's paper-sized flavor and its CPU debug flavor ("<family>[_<variant>]": flavor).
PAPER = {"transformer": "400m", "mlp_lm": "600m", "titans_mac": "400m", "mela": "400m",
         "backbone": "llama3_2_1b", "gradmem": "kv"}
DEBUG = {"transformer": "debug", "mlp_lm": "debug", "titans_mac": "debug", "mela": "debug",
         "backbone": "llama_debug", "gradmem": "kv_debug"}
# Dense bf16 peak FLOP/s by device-name fragment (first match wins).
PEAK_BF16 = (("H200", 989e12), ("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12),
             ("A100", 312e12), ("L40S", 362e12))


@dataclass
class Result:
    name: str
    flavor: str
    params: int = 0
    tokens_per_s: float = 0.0
    flops_per_token: float = 0.0
    peak_memory: int = 0
    first_step_s: float = 0.0
    capture_s: float = 0.0  # --cuda-graphs: warmup and capture
    top_kernels: list = dataclasses.field(default_factory=list)  # [(name, self ms per step)], --profile
    losses: list = dataclasses.field(default_factory=list)  # each step's loss (--cuda-graphs: each replay's)
    error: str = ""


def device_peak(device: torch.device, bf16: bool) -> tuple[float, str]:
    """(peak FLOP/s, where it comes from)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for fragment, peak in PEAK_BF16:
            if fragment in name and bf16:
                return peak, f"{name}: dense bf16 {peak / 1e12:.0f} TFLOP/s (table)"
        peak = measured_matmul_flops(8192, device=device, dtype=torch.bfloat16 if bf16 else torch.float32)
        return peak, f"{name}: measured {'bf16' if bf16 else 'fp32'} 8192^3 matmul {peak / 1e12:.0f} TFLOP/s"
    peak = measured_matmul_flops(512, device=device)
    return peak, f"CPU: measured fp32 512^3 matmul {peak / 1e9:.1f} GFLOP/s"


def top_kernels(step, device: torch.device, count: int = 10) -> list[tuple[str, float]]:
    """[(kernel name, self milliseconds)] of the `count` kernels (CPU ops on a CPU) with the
    most self time in one call of `step`, under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        step()
        if cuda:
            torch.cuda.synchronize(device)
    events = [e for e in prof.key_averages() if (e.self_device_time_total if cuda else e.self_cpu_time_total) > 0]
    events.sort(key=lambda e: -(e.self_device_time_total if cuda else e.self_cpu_time_total))
    return [(e.key[:120], (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1e3) for e in events[:count]]


def bench(name: str, flavor: str, *, device: torch.device, batch: int, seq_len: int, steps: int, warmup: int,
          bf16: bool, compile_model: bool, profile_kernels: bool = False, whole_sequence: bool = False,
          cuda_graphs: bool = False) -> Result:
    """Train one flavor for warmup + steps steps; tokens/s over the timed steps (`cuda_graphs`:
    the warmup steps on a side stream, one step captured as a CUDA graph, the timed steps its
    replays; `capture_step`)."""
    result = Result(name, flavor)
    if cuda_graphs and device.type != "cuda":
        return Result(name, flavor, error="--cuda-graphs needs a CUDA device (--device cuda)")
    model, cfg, flops_per_token = build(name, flavor)
    if whole_sequence and not use_whole_sequence(model):
        return Result(name, flavor, error="--whole-sequence: this model has no neural memory")
    seq_len = fitted_length(cfg, seq_len)
    model = model.to(device)
    result.params = sum(p.numel() for p in model.parameters())
    result.flops_per_token = flops_per_token(seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda", capturable=cuda_graphs)
    if compile_model:  # as the family's training compiles it (`Family.compile`): by regions or per block
        family_and_overrides(name)[0].compile(model, "inductor")
    data = inputs(family_and_overrides(name)[0].name, batch, seq_len, cfg.vocab_size, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def train_step() -> torch.Tensor:
        # autocast's weight cache must be off under graph capture (torch's CUDA-graph notes)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16, cache_enabled=not cuda_graphs):
            loss = loss_of(model, data)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    if cuda_graphs:  # the warmup steps train, the capture does not: replay k trains step warmup + k
        train_step, result.capture_s = capture_step(train_step, optimizer, warmup)
        warmup = 1  # the first replay is not timed
    start, losses = time.perf_counter(), []
    for step in range(warmup + steps):
        if step == warmup:
            sync()
            start = time.perf_counter()
        loss = train_step()
        losses.append(loss.detach().clone())  # a replay overwrites its loss tensor; no host sync here
        if step == 0:
            sync()
            result.first_step_s = time.perf_counter() - start
            progress(f"first step done in {result.first_step_s:.1f} s")
    sync()
    result.tokens_per_s = steps * batch * seq_len / (time.perf_counter() - start)
    result.losses = [x.item() for x in losses]
    if profile_kernels:
        result.top_kernels = top_kernels(train_step, device)
    if not torch.isfinite(loss.detach()).item():  # checked once, after timing: no host sync per step
        result.error = f"loss {loss.item()} at the last step"
    if device.type == "cuda":
        result.peak_memory = torch.cuda.max_memory_allocated(device)
    return result


def progress(text: str) -> None:
    """One line on stderr as a step finishes, so that a run cut at a time limit (a lease's) shows
    how far it got (compilation, warmup, capture)."""
    print(f"bench_models: {text}", file=sys.stderr, flush=True)


def capture_step(train_step, optimizer, warmup: int):
    """(a function replaying one training step captured as a CUDA graph, seconds the warmup and
    capture took): `warmup` (>= 1) steps run on a side stream first, as torch's whole-network
    capture recipe does (lazy initialisation, compilation, allocator), then one step (forward,
    backward, optimizer step) is captured; each replay returns the captured step's loss
    (the same tensor, overwritten). The data and every buffer are static: a replay trains the
    same batch again, which is what a throughput benchmark needs."""
    start = time.perf_counter()
    progress("warmup starts (the first step compiles)")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for step in range(max(warmup, 1)):
            train_step()
            torch.cuda.synchronize()
            progress(f"warmup step {step + 1} done {time.perf_counter() - start:.1f} s after the start")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        loss = train_step()
    torch.cuda.synchronize()
    progress(f"step captured {time.perf_counter() - start:.1f} s after the start")

    def replay() -> torch.Tensor:
        graph.replay()
        return loss

    return replay, time.perf_counter() - start


def parse_models(text: str | None, dry_run: bool) -> list[tuple[str, str]]:
    """"name:flavor,name,..." (a bare name takes its paper or, dry run, debug flavor)."""
    defaults = DEBUG if dry_run else PAPER
    if not text:
        return list(defaults.items())
    out = []
    for item in text.split(","):
        name, _, flavor = item.strip().partition(":")
        out.append((name, flavor or defaults.get(name) or PAPER.get(name.split("_")[0], "")))
    return out


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=None, help="name[:flavor],... (default: every family's paper flavor)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=2, help="sequences per step (this loop has no activation "
                        "checkpointing: titans_mac 400m with its checkpoint_chunks 4 keeps ~0.8 GiB per block per 8 x 512 tokens)")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation)")
    parser.add_argument("--compile", action="store_true", help="compile as training does (per block or by regions)")
    parser.add_argument("--cuda-graphs", action="store_true", help="capture one step as a CUDA graph after the "
                        "warmup and time --steps replays (with or without --compile; CUDA only)")
    parser.add_argument("--fp32", action="store_true", help="no bf16 autocast (always so on CPU)")
    parser.add_argument("--whole-sequence", action="store_true", help="every neural memory on the whole-sequence "
                        "kernels (NeuralMemoryConfig.whole_sequence; a CUDA device)")
    parser.add_argument("--dry-run", action="store_true", help="debug flavors, fp32, batch 2, 3 steps, 64 tokens")
    parser.add_argument("--profile", action="store_true", help="one more step under torch.profiler: top 10 kernels")
    parser.add_argument("--json", action="store_true", help="one 'JSON {...}' line per model")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.dry_run:
        args.batch, args.seq_len, args.steps, args.warmup, args.fp32 = 2, 64, 2, 1, True
    device = torch.device(args.device)
    bf16 = device.type == "cuda" and not args.fp32
    if fixed := use_fixed_ptxas(arch_of(device)):
        print(f"Triton assembles Hopper kernels with {fixed} (kernels/ptxas.py)")
    torch.manual_seed(0)
    peak, source = device_peak(device, bf16)
    print(f"torch {torch.__version__}; {source}; {'bf16 autocast' if bf16 else 'fp32'}"
          f"{', torch.compile' if args.compile else ''}{', CUDA graph replays' if args.cuda_graphs else ''}; batch {args.batch}; seq_len {args.seq_len} "
          f"(raised to what a model needs); {args.steps} timed steps after {args.warmup}")
    print(f"{'model':<14} {'flavor':<12} {'params':>8} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>7} {'peak GiB':>9}")
    failed = False
    for name, flavor in parse_models(args.models, args.dry_run):
        try:
            r = bench(name, flavor, device=device, batch=args.batch, seq_len=args.seq_len, steps=args.steps,
                      warmup=args.warmup, bf16=bf16, compile_model=args.compile, profile_kernels=args.profile,
                      whole_sequence=args.whole_sequence, cuda_graphs=args.cuda_graphs)
        except torch.cuda.OutOfMemoryError:
            r = Result(name, flavor, error="out of memory: lower --batch or --seq-len")
            torch.cuda.empty_cache()
        except Exception as e:  # one model's failure is one row; the exit status says so; where: stderr
            traceback.print_exc()
            r = Result(name, flavor, error=f"failed: {type(e).__name__}: {e}")
        if r.error:
            failed = True
            print(f"{name:<14} {flavor:<12} {r.error}")
            continue
        achieved = r.tokens_per_s * r.flops_per_token
        memory = f"{r.peak_memory / 2**30:9.1f}" if r.peak_memory else f"{'-':>9}"
        print(f"{name:<14} {flavor:<12} {r.params / 1e6:7.1f}M {r.tokens_per_s:10,.0f} {achieved / 1e12:8.3f} "
              f"{achieved / peak:7.2%} {memory}   first step {r.first_step_s:.1f} s"
              f"{f', warmup and capture {r.capture_s:.1f} s' if r.capture_s else ''}")
        for kernel, ms in r.top_kernels:
            print(f"    {ms:9.2f} ms  {kernel}")
        if args.json:
            print("JSON " + json.dumps({**dataclasses.asdict(r), "mfu_percent": 100 * achieved / peak,
                                        "peak_memory_gib": r.peak_memory / 2**30}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
