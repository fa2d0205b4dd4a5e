"""The first command to run on a GPU machine: does every path that only runs on a GPU work?

    bash scripts/gpu_check.sh [--only NAME[,NAME]] [--steps 20] [--list] [--device cuda]

Checks (each prints one PASS/FAIL line with its measured figure; exit 1 if any fails):
  families    every model family (Titans MAC/MAG/MAL/LMM, Mela, MLP-FFN LM, Transformer++)
              forward + backward in fp32 and bf16, eager and torch.compile'd: finite loss
              and gradients; compiled vs eager fp32 logits within 1e-3 relative (max |diff| /
              max |logit|).
  attention   flex-attention block masks (CUDA path of models/layers/attention.py) vs dense SDPA with
              the same mask (Titans' sliding-window and MAC masks, document masks): 1e-3 rel.
  kernels     Triton Newton-Schulz (per matrix, blocked), the fused memory update and the
              fused per-token chunk step (output, new state and every input's gradient) vs
              the torch references, fp32 (1e-3 rel) and bf16 (3e-2 rel); then every backend
              timed (forward + backward, fp32) at one shape per class of kernels/auto_table.py
              (the token step at chunks 16 and 32, summed), and the table "auto" would read
              printed as Python, to paste there.
  drift       the Titans MAC debug model in bf16 (fast weights stay fp32) vs fp32: logits
              within 5e-2 relative.
  train       20 steps of each debug config through scripts/train.sh: the loss falls.
  throughput  tokens/s and MFU of titans_mac_170m and mela_400m at local batch 1, seq 4096,
              10 steps (reported; fails only if the run fails).
Without CUDA it prints one line and exits 0 (`--device cpu` runs the in-process checks on
the CPU instead, as the tests do). It needs no torchtitan outside `train`, `throughput` and
the transformer family, so it runs on images whose torch (2.11 and up) is older than the pin.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from torchtitan_ext.paths import default_tokenizer_dir
from torchtitan_ext.timing import median_seconds
from torchtitan_ext.training.run_log import last_line, parse_steps

REPO = Path(__file__).resolve().parents[1]
VOCAB, LENGTH = 256, 128


@dataclass
class Result:
    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'}  {self.name}: {self.detail}"


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| in float32 (0 for two zero tensors)."""
    got, want = got.detach().float(), want.detach().float()
    scale = want.abs().max().item()
    return (got - want).abs().max().item() / scale if scale else (got - want).abs().max().item()


def compare(name: str, got: torch.Tensor, want: torch.Tensor, tolerance: float) -> Result:
    """PASS when the shapes agree, both are finite and the relative error is within tolerance."""
    if got.shape != want.shape:
        return Result(name, False, f"shape {tuple(got.shape)} vs {tuple(want.shape)}")
    if not (torch.isfinite(got).all() and torch.isfinite(want).all()):
        return Result(name, False, "non-finite values")
    error = relative_error(got, want)
    return Result(name, error <= tolerance, f"relative error {error:.2e} (tolerance {tolerance:.0e})")


# ---- model families -------------------------------------------------------------------

def build_family(family: str) -> tuple[torch.nn.Module, callable]:
    """(small model of the family, logits(model, tokens))."""
    from models.lms.mela import Mela, MelaConfig, mela_memory
    from models.lms.mlp_lm import MLPLM, MLPLMConfig
    from models.memory.neural_memory import NeuralMemoryConfig
    from models.lms.titans import TitansConfig, TitansLM

    torch.manual_seed(0)
    if family.startswith("titans_"):
        model = TitansLM(TitansConfig(variant=family.split("_")[1], vocab_size=VOCAB, dim=64, n_layers=2, n_heads=2,
                                      window=32, memory=NeuralMemoryConfig(chunk_size=8)))
        return model, lambda m, t: m(t)
    if family == "mela":
        return Mela(MelaConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=2, memory_heads=2, patch_size=4,
                               chunk_size=8, memory=mela_memory(expansion=2))), lambda m, t: m(t)
    if family == "mlp_lm":
        return MLPLM(MLPLMConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128)), \
            lambda m, t: m(t)
    if family == "transformer":
        from torchtitan.models.common.attention import create_varlen_metadata_for_document

        from torchtitan_ext.families import transformer

        model = transformer.model_config("debug").build()
        model.init_weights(buffer_device=None)

        def logits(m, t):
            positions = torch.arange(t.shape[1], device=t.device).expand_as(t)
            return m(t, positions=positions, attention_masks=create_varlen_metadata_for_document(positions))

        return model, logits
    raise ValueError(f"unknown family '{family}'")


FAMILIES = ("titans_mac", "titans_mag", "titans_mal", "titans_lmm", "mela", "mlp_lm", "transformer")


def check_family(family: str, device: str, compiled: bool = True) -> list[Result]:
    """Forward + backward in fp32 and bf16 (finite loss and gradients), and compiled vs eager."""
    results = []
    tokens = torch.randint(0, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(1)).to(device)
    eager_fp32 = None
    for dtype in (torch.float32, torch.bfloat16):
        model, logits_of = build_family(family)
        model = model.to(device, dtype)
        logits = logits_of(model, tokens)
        loss = logits.float().logsumexp(-1).mean()
        loss.backward()
        finite = torch.isfinite(loss).item() and all(torch.isfinite(p.grad).all().item()
                                                      for p in model.parameters() if p.grad is not None)
        results.append(Result(f"{family} {str(dtype)[6:]} fwd+bwd", finite, f"loss {loss.item():.4f}"))
        if dtype == torch.float32:
            eager_fp32 = (model, logits.detach(), logits_of)
    if compiled:
        model, eager, logits_of = eager_fp32
        with torch.no_grad():
            results.append(compare(f"{family} compiled vs eager", logits_of(torch.compile(model), tokens), eager, 1e-3))
    return results


def check_families(device: str) -> list[Result]:
    return [r for family in FAMILIES for r in check_family(family, device)]


# ---- attention, kernels, drift ---------------------------------------------------------

def dense_reference(q, k, v, mask_mod):
    idx_q = torch.arange(q.shape[2], device=q.device)[:, None]
    idx_k = torch.arange(k.shape[2], device=q.device)[None, :]
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask_mod(idx_q, idx_k))


def check_attention(device: str) -> list[Result]:
    from models.layers.attention import document_causal_attention, document_causal_mask, document_ids, masked_attention
    from models.lms.titans import mac_mask, prefix_window_mask

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 4, 256, 64, generator=g).to(device) for _ in range(3))
    results = []
    for name, mask_mod, keys in (("sliding window + prefix", prefix_window_mask(4, 64), 256),
                                 ("MAC segment", mac_mask(4, 126), 256)):
        results.append(compare(f"attention {name}", masked_attention(q, k[:, :, :keys], v[:, :, :keys], mask_mod),
                               dense_reference(q, k[:, :, :keys], v[:, :, :keys], mask_mod), 1e-3))
    positions = torch.cat([torch.arange(100), torch.arange(156)]).expand(2, -1).to(device)
    mask = document_causal_mask(document_ids(positions))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    results.append(compare("attention documents", document_causal_attention(q, k, v, positions), want, 1e-3))
    return results


def check_kernels(device: str) -> list[Result]:
    from kernels import memory_update, newton_schulz

    g = torch.Generator().manual_seed(3)
    results = []
    for dtype, tolerance in ((torch.float32, 1e-3), (torch.bfloat16, 3e-2)):
        x = torch.randn(8, 64, 256, generator=g).to(device, dtype)
        want = newton_schulz(x, 5, backend="torch")
        for backend in ("triton", "triton_blocked"):
            results.append(compare(f"newton_schulz {backend} {str(dtype)[6:]}", newton_schulz(x, 5, backend=backend),
                                   want, tolerance))
        weight, momentum, grad = (torch.randn(8, 64, 256, generator=g).to(device, dtype) for _ in range(3))
        eta, alpha = torch.rand(8, generator=g).to(device), torch.rand(8, generator=g).to(device) * 0.1
        got = memory_update(weight, momentum, grad, eta, alpha, 5, backend="triton")
        want = memory_update(weight, momentum, grad, eta, alpha, 5, backend="torch")
        results += [compare(f"memory_update triton {part} {str(dtype)[6:]}", a, b, tolerance)
                    for part, a, b in zip(("weight", "momentum"), got, want)]
        results += check_token_step(device, dtype, tolerance)
    return results + check_auto_table(device)


def token_step_inputs(batch: tuple[int, int], dim: int, hidden: int, chunk: int, device: str,
                      dtype=torch.float32, seed: int = 5):
    """(state, q, k, v, token_weights, mix) of one depth-2 per-token chunk step
    (`kernels.token_chunk_step`): fp32 state [M; S] of W_1 (dim, hidden) and W_2 (hidden, dim)
    per (batch, head); q, k, v, token_weights in `dtype`; each a leaf that takes a gradient."""
    g = torch.Generator().manual_seed(seed)
    state = tuple((torch.randn(*batch, 2, rows, cols, generator=g) * rows ** -0.5).to(device)
                  for rows, cols in ((dim, hidden), (hidden, dim)))
    q, k, v = (torch.randn(*batch, chunk, dim, generator=g).to(device, dtype) for _ in range(3))
    token_weights = (0.01 * torch.rand(*batch, chunk, 2, generator=g)).to(device, dtype)
    mix = torch.rand(*batch, 2, 2, generator=g).to(device)
    return tuple(x.requires_grad_() for x in (*state, q, k, v, token_weights, mix))


def token_step_output_weights(inputs: tuple) -> list[torch.Tensor]:
    """Fixed random weights of the step's outputs (y, new W1, new W2: the shapes of q and the
    state), drawn once so that the timed step draws nothing."""
    s1, s2, q = inputs[:3]
    g = torch.Generator().manual_seed(6)
    return [torch.randn(x.shape, generator=g).to(x.device) for x in (q, s1, s2)]


def token_step_outputs(backend: str, inputs: tuple, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """The step's output, new state and every input's gradient under the outputs' weighting
    `weights` (`token_step_output_weights`: each gradient depends on every output)."""
    from kernels import token_chunk_step

    s1, s2, q, k, v, token_weights, mix = inputs
    y, new = token_chunk_step((s1, s2), q, k, v, token_weights, mix, backend=backend)
    outputs = [y, *new]
    loss = sum((o.float() * w).sum() for o, w in zip(outputs, weights))
    grads = torch.autograd.grad(loss, inputs)
    return [o.detach() for o in outputs] + list(grads)


TOKEN_STEP_PARTS = ("y", "new W1", "new W2", "grad W1", "grad W2", "grad q", "grad k", "grad v",
                    "grad token_weights", "grad mix")


def check_token_step(device: str, dtype: torch.dtype, tolerance: float) -> list[Result]:
    """The Triton per-token chunk step vs the torch reference (autograd through the plain
    forward) at head_dim 64, hidden 256, TOKEN_STEP_CHUNKS: one result per output and gradient."""
    results = []
    for chunk in TOKEN_STEP_CHUNKS:
        inputs = token_step_inputs((2, 4), 64, 256, chunk, device, dtype)
        name, weights = f"token_step triton C{chunk} {str(dtype)[6:]}", token_step_output_weights(inputs)
        try:
            got = token_step_outputs("triton", inputs, weights)
        except Exception as e:  # a kernel that does not build here (e.g. out of shared memory) is a FAIL line
            results.append(Result(name, False, f"{type(e).__name__}: {str(e).splitlines()[0]}"))
            continue
        want = token_step_outputs("torch", inputs, weights)
        results += [compare(f"{name} {part}", a, b, tolerance) for part, a, b in zip(TOKEN_STEP_PARTS, got, want)]
    return results


# ---- the auto table (kernels/auto_table.py) --------------------------------------------

MARGIN = 0.05  # a backend replaces the device's default only when faster by more than this share
# shape class -> (matrices per call, the matrix shapes timed, summed): fast weights of a depth-2
# memory with head_dim 64, expansion 4 ("tile"), and with head_dim 256 ("large")
TABLE_SHAPES = {"tile-few": ((4, 4), ((64, 256), (256, 64))), "tile-many": ((16, 16), ((64, 256), (256, 64))),
                "large-few": ((4, 4), ((256, 1024), (1024, 256))),
                "large-many": ((16, 16), ((256, 1024), (1024, 256)))}
# the per-token chunk step is timed at (head_dim, hidden) = the class's first matrix shape, per
# (batch, head) of the class's batch (its state's class: (batch, heads, 2, head_dim, hidden)),
# at these chunk sizes, summed (a backend that cannot take one of them is left out): the
# Triton kernel's largest chunk at head_dim 64, hidden 256 is 32 (kernels/token_step.py)
TOKEN_STEP_CHUNKS = (16, 32)


def time_backends(device: str, backends: tuple[str, ...], shapes: dict = TABLE_SHAPES, repeats: int = 10):
    """{(op, shape class): {backend: ms}}: median milliseconds of one forward + backward, fp32,
    5 Newton-Schulz steps, summed over the class's matrix shapes (the per-token chunk step:
    over TOKEN_STEP_CHUNKS); a backend that cannot take the class (`kernels.can_run`,
    `kernels.token_step_refusal`) or the op is left out."""
    from kernels import BACKENDS, MEMORY_UPDATE_BACKENDS, can_run, memory_update, newton_schulz

    timings = {}
    for cls, (batch, matrix_shapes) in shapes.items():
        for op, choices in (("newton_schulz", BACKENDS), ("memory_update", MEMORY_UPDATE_BACKENDS)):
            row = {}
            for shape in matrix_shapes:
                g = torch.Generator().manual_seed(5)
                w, s, grad = (torch.randn(*batch, *shape, generator=g).to(device).requires_grad_() for _ in range(3))
                eta, alpha = (torch.rand(batch, generator=g).to(device).requires_grad_() for _ in range(2))

                def step(backend, w=w, s=s, grad=grad, eta=eta, alpha=alpha, op=op):
                    if op == "newton_schulz":
                        newton_schulz(s, 5, backend).sum().backward()
                    else:
                        new_w, new_s = memory_update(w, s, grad, eta, alpha, 5, backend)
                        (new_w.sum() + new_s.sum()).backward()

                for backend in backends:
                    if can_run(backend, s, choices):
                        row[backend] = row.get(backend, 0.0) + 1e3 * median_seconds(lambda b=backend: step(b), repeats, device)
            timings[op, cls] = row
        timings["token_step", cls] = time_token_step(device, backends, batch, *matrix_shapes[0], repeats)
    return timings


def time_token_step(device: str, backends: tuple[str, ...], batch: tuple[int, int], dim: int, hidden: int,
                    repeats: int) -> dict[str, float]:
    """{backend: ms} of one per-token chunk step forward + backward (`token_step_outputs`),
    summed over TOKEN_STEP_CHUNKS; a backend that refuses a chunk (`kernels.token_step_refusal`)
    or raises (said in one printed line) is left out."""
    from kernels import TOKEN_STEP_BACKENDS, token_step_refusal

    totals = {backend: 0.0 for backend in backends if backend in TOKEN_STEP_BACKENDS}
    for chunk in TOKEN_STEP_CHUNKS:
        inputs = token_step_inputs(batch, dim, hidden, chunk, device)
        weights = token_step_output_weights(inputs)
        for backend in list(totals):
            if token_step_refusal(backend, inputs[:2], *inputs[2:]) is not None:
                del totals[backend]
                continue
            try:
                totals[backend] += 1e3 * median_seconds(lambda: token_step_outputs(backend, inputs, weights), repeats, device)
            except Exception as e:
                print(f"token_step {backend} {batch} C{chunk}: {type(e).__name__}: {str(e).splitlines()[0]}")
                del totals[backend]
    return totals


def table_entry(ms: dict[str, float], default: str) -> str:
    """The backend for one (op, shape class) from its timings {backend: ms}: the fastest,
    unless `default` was timed and the fastest beats it by no more than MARGIN."""
    best = min(ms, key=ms.get)
    return default if default in ms and ms[best] >= (1 - MARGIN) * ms[default] else best


def auto_table_source(kind: str, timings: dict, measured_on: str) -> str:
    """The AUTO_TABLE that kernels/auto_table.py would hold for device kind `kind` from
    `timings` ({(op, shape class): {backend: ms}}), as Python, each entry's timings in its comment."""
    from kernels.auto_table import DEVICE_DEFAULTS

    default = DEVICE_DEFAULTS.get(kind, "torch")
    lines = [f"# measured on {measured_on}; classes not listed run DEVICE_DEFAULTS ({kind}: {default})",
             "AUTO_TABLE = {"]
    for (op, cls), ms in sorted(timings.items()):
        figures = ", ".join(f"{backend} {t:.2f}" for backend, t in ms.items())
        lines.append(f'    ("{kind}", "{op}", "{cls}"): "{table_entry(ms, default)}",  # ms: {figures}')
    return "\n".join(lines + ["}"])


def check_auto_table(device: str) -> list[Result]:
    """Times the backends (`time_backends`) and prints the table "auto" would read; one
    result per (op, class) with its timings (fails only if timing fails)."""
    kind = torch.device(device).type
    backends = ("torch", "compiled", "fused_torch") + (("triton", "triton_blocked") if kind == "cuda" else ())
    timings = time_backends(device, backends)
    name = torch.cuda.get_device_name(device) if kind == "cuda" else kind
    print(auto_table_source(kind, timings, f"{name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"))
    return [Result(f"timing {op} {cls}", True, ", ".join(f"{b} {t:.2f} ms" for b, t in ms.items()))
            for (op, cls), ms in timings.items()]


def check_drift(device: str) -> list[Result]:
    model, logits_of = build_family("titans_mac")
    tokens = torch.randint(0, VOCAB, (2, 4 * LENGTH), generator=torch.Generator().manual_seed(4)).to(device)
    with torch.no_grad():
        full = logits_of(model.to(device), tokens)
        half = logits_of(model.to(torch.bfloat16), tokens)
    return [compare("bf16 vs fp32 (Titans MAC, 64 memory chunks)", half, full, 5e-2)]


# ---- runs through scripts/train.sh -----------------------------------------------------

DEBUG_CONFIGS = {"transformer_debug": "train_configs.transformer", "mlp_lm_debug": "train_configs.mlp_lm",
                 "mela_debug": "train_configs.mela"} | {
    f"titans_{v}_debug": "train_configs.titans" for v in ("mac", "mag", "mal", "lmm")}


def train_run(module: str, config: str, extra: list[str]) -> tuple[int, dict, str]:
    """(exit code, parsed step metrics, last output line) of one run through scripts/train.sh."""
    args = ["bash", str(REPO / "scripts" / "train.sh"), "--module", module, "--config", config,
            "--metrics.no-enable-wandb", "--metrics.log_freq", "1", "--validator.no-enable",
            "--checkpoint.no-enable", "--dump_folder", str(REPO / "outputs" / "gpu_check" / config), *extra]
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True)
    output = proc.stdout + proc.stderr
    return proc.returncode, parse_steps(output), last_line(output)


def loss_falls(name: str, returncode: int, steps: dict, last: str) -> Result:
    if returncode or len(steps) < 2:
        return Result(name, False, f"exit code {returncode}, {len(steps)} steps logged: {last}")
    first, last = steps[min(steps)]["loss"], steps[max(steps)]["loss"]
    return Result(name, last < first, f"loss {first:.3f} -> {last:.3f}")


def check_train(device: str, steps: int = 20) -> list[Result]:
    return [loss_falls(f"train {config} ({steps} steps)", *train_run(module, config, ["--training.steps", str(steps)]))
            for config, module in DEBUG_CONFIGS.items()]


def check_throughput(device: str) -> list[Result]:
    results = []
    for config, module in (("titans_mac_170m", "train_configs.titans"), ("mela_400m", "train_configs.mela")):
        code, steps, last = train_run(module, config, ["--training.steps", "10", "--training.local_batch_size", "1",
                                                 "--training.global_batch_size", "1", "--training.seq_len", "4096",
                                                 "--dataloader.dataset", "embedded", "--hf_assets_path",
                                                 str(default_tokenizer_dir())])
        later = [s for n, s in steps.items() if n > 2] or list(steps.values())
        if code or not later:
            results.append(Result(f"throughput {config}", False, f"exit code {code}: {last}"))
            continue
        tps = sorted(s["tps"] for s in later)[len(later) // 2]
        mfu = sorted(s["mfu"] for s in later)[len(later) // 2]
        results.append(Result(f"throughput {config}", True, f"median {tps:,.0f} tokens/s, MFU {mfu:.1f}%"))
    return results


CHECKS = {"families": check_families, "attention": check_attention, "kernels": check_kernels,
          "drift": check_drift, "train": check_train, "throughput": check_throughput}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated subset of {', '.join(CHECKS)}")
    parser.add_argument("--steps", type=int, default=20, help="training steps of each debug config (check 'train')")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--list", action="store_true", help="list the checks and exit")
    args = parser.parse_args(argv)
    args.only = [name for name in args.only.split(",") if name]
    unknown = [name for name in args.only if name not in CHECKS]
    if unknown:
        parser.exit(2, f"error: unknown check(s) {', '.join(unknown)}: choose from {', '.join(CHECKS)}\n")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        for name in CHECKS:
            print(name)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: skipped: no CUDA device (torch.cuda.is_available() is False)")
        return 0
    results = []
    for name in args.only:
        check = CHECKS[name]
        for result in (check(args.device, args.steps) if name == "train" else check(args.device)):
            print(result.line(), flush=True)
            results.append(result)
    failed = [r for r in results if not r.ok]
    print(f"gpu_check: {len(results) - len(failed)} of {len(results)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
