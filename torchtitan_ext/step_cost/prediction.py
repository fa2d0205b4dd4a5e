"""A config's step predicted (`predict`) and reported as text (`report`)."""

from __future__ import annotations


from dataclasses import dataclass

import torch

from models.memory.neural_memory import use_whole_sequence
from torchtitan_ext import plain_step
from torchtitan_ext.families import family_and_overrides
from torchtitan_ext.step_cost.hardware import Hardware, LAUNCH_S, MEASURED_H100, MEASURED_SHAPE, MODES, StepCost
from torchtitan_ext.step_cost.inductor_launches import LaunchCount, count_compiled
from torchtitan_ext.step_cost.ops import CHUNK_STEP_FUNCTIONS
from torchtitan_ext.step_cost.recorder import record_step


def parse_config(text: str) -> tuple[str, str]:
    """"titans_mac_400m" / "titans_mac:400m" -> ("titans_mac", "400m"): the longest model name
    (`<family>[_<variant>]`) whose family has the rest as a flavor."""
    if ":" in text:
        name, flavor = text.split(":", 1)
        return name, flavor
    parts = text.split("_")
    for cut in range(len(parts) - 1, 0, -1):
        name, flavor = "_".join(parts[:cut]), "_".join(parts[cut:])
        try:
            family, _ = family_and_overrides(name)
        except ValueError:
            continue
        if flavor in family.flavors:
            return name, flavor
    raise ValueError(f"config '{text}': no <family>[_<variant>]_<flavor> of the registry "
                     "(e.g. titans_mac_400m, transformer_400m, mela_400m)")


@dataclass
class Prediction:
    name: str
    flavor: str
    batch: int
    seq_len: int
    mode: str
    params: int
    flops_per_token: float
    cost: StepCost
    compiled_modules: tuple[str, ...] = ()  # what the recipe compiles (mode compiled or graphs)
    inductor: LaunchCount | None = None  # the compiled regions' launches as Inductor emits them (`count_compiled`)
    twin: dict | None = None  # the launch twin they were counted on

    @property
    def launches(self) -> int:
        """Launches of the step: with `inductor`, the compiled regions' as Inductor emits them and the
        rest as recorded; else as recorded (the crude fusion model inside compiled regions)."""
        if self.inductor is None:
            return self.cost.total.launches
        return self.cost.total.launches - self.cost.region_launches + self.inductor.total

    @property
    def step_s(self) -> float:
        """The predicted step: the recording's, plus the mode's launch floor for each launch Inductor
        emits beyond the crude model's count (their bytes and FLOPs are not costed)."""
        return self.cost.step_s + (self.launches - self.cost.total.launches) * self.cost.hardware.launch_s

    @property
    def tokens_per_s(self) -> float:
        return self.cost.tokens / self.step_s if self.step_s else 0.0

    @property
    def compiled(self) -> bool:
        return self.mode != "eager"

    @property
    def mfu(self) -> float:
        return self.tokens_per_s * self.flops_per_token / self.cost.hardware.bf16_flops


def predict(config: str, *, seq_len: int = 4096, batch: int = 2, mode: str = "eager",
            hardware: Hardware | None = None, whole_sequence: bool = False,
            inductor_launches: bool = False) -> Prediction:
    """Record one bench_models.py training step of CONFIG (e.g. "titans_mac_400m") on meta
    and cost it on an H100 (`whole_sequence`: every neural memory on the whole-sequence kernels).
    mode (`MODES`): "eager"; "compiled", as the family's training compiles (`Family.compiled_module_names`:
    torchtitan's per-block compile of `layers`, or the family's regions; Titans on the chunk
    loop also compiles its chunk step), every other module eager; "graphs", compiled so and the
    whole step replayed as one CUDA graph. `hardware` (default `Hardware.for_mode(mode)`).
    `inductor_launches` (compiled modes): also count the compiled regions' launches as Inductor's
    Triton scheduling emits them, on the config's launch twin (`inductor_launches.count_compiled`,
    minutes on a CPU), which then set the step's launches and launch floor (`Prediction.launches`)."""
    if mode not in LAUNCH_S:
        raise ValueError(f"unknown mode '{mode}': choose from {', '.join(MODES)}")
    name, flavor = parse_config(config)
    family = family_and_overrides(name)[0]
    with torch.device("meta"):
        model, cfg, flops_per_token = plain_step.build(name, flavor)
    if whole_sequence and not use_whole_sequence(model):
        raise ValueError(f"--whole-sequence: {config} has no neural memory")
    seq_len = plain_step.fitted_length(cfg, seq_len)
    hardware = hardware or Hardware.for_mode(mode)
    data = plain_step.inputs(family.name, batch, seq_len, cfg.vocab_size, "meta")
    compiled = mode != "eager"
    compile_modules = tuple(family.compiled_module_names(model)) if compiled else ()
    chunk_loop = family.name == "titans" and not whole_sequence  # its compile_regions compiles the chunk step
    model.train()
    cost = record_step(model, lambda m: plain_step.loss_of(m, data), tokens=batch * seq_len, bf16=True,
                       compiled=compiled, compile_modules=frozenset(compile_modules),
                       compile_functions=CHUNK_STEP_FUNCTIONS if chunk_loop else frozenset(), hardware=hardware)
    inductor = twin = None
    if inductor_launches and compiled:
        inductor, twin = count_compiled(name, flavor, seq_len=seq_len, batch=batch, whole_sequence=whole_sequence)
    return Prediction(name, flavor, batch, seq_len, mode, sum(p.numel() for p in model.parameters()),
                      flops_per_token(seq_len), cost, compile_modules, inductor, twin)


def baseline_of(p: Prediction) -> str | None:
    """The Transformer++ config a prediction is compared with: transformer_<flavor> where that
    flavor exists (transformer_400m beside titans_mac_400m), else None."""
    family = family_and_overrides("transformer")[0]
    return f"transformer_{p.flavor}" if p.name != "transformer" and p.flavor in family.flavors else None


MODE_TEXT = {"eager": "eager", "compiled": "compiled as its training compiles (crude fusion model)",
             "graphs": "compiled as its training compiles (crude fusion model), replayed as a CUDA graph"}


def report(p: Prediction, top: int = 12, baseline: Prediction | None = None) -> str:
    """The printed tables: by class, the step, launches per memory layer, top ops, the
    `baseline` (the Transformer++ in the same mode) beside it, and the lease's measurement
    where one exists for this shape."""
    c, hw = p.cost, p.cost.hardware
    fp32 = f"TF32 {hw.tf32_flops / 1e12:.0f}" if hw.tf32 else f"fp32 {hw.fp32_flops / 1e12:.0f} (allow_tf32=False)"
    lines = [
        f"{p.name} {p.flavor}: {p.params / 1e6:.1f}M params, batch {p.batch} x seq {p.seq_len}, bf16 autocast "
        f"(fp32 params), {MODE_TEXT[p.mode]}, fused AdamW; recorded on {c.device} in {c.record_s:.1f} s",
        f"H100 model: bf16 {hw.bf16_flops / 1e12:.0f} TFLOP/s, fp32 matmuls at {fp32} TFLOP/s, HBM "
        f"{hw.bytes_per_s / 1e12:.2f} TB/s, launch floor {hw.launch_s * 1e6:.1f} us, host sync "
        f"{hw.sync_s * 1e6:.0f} us; whole-sequence kernels' bf16 products on the "
        f"{'tensor cores (ptxas >= 13.3)' if hw.kernel_tensor_cores else 'FMA units'}"
        f"{', at most the lease-measured rate per program' if hw.kernel_measured else ''}",
        f"{'class':<16} {'launches':>9} {'GFLOPs':>10} {'GB moved':>9} {'roofline ms':>12} {'floor ms':>9} "
        f"{'pred ms':>9} {'share':>6}",
    ]
    total = c.total
    for name, cost in list(c.classes.items()) + [("total", total)]:
        share = cost.seconds / c.step_s if c.step_s else 0.0
        lines.append(f"{name:<16} {cost.launches:>9,} {cost.flops / 1e9:>10,.1f} {cost.bytes / 1e9:>9,.2f} "
                     f"{cost.compute_s * 1e3:>12,.2f} {cost.launch_s * 1e3:>9,.2f} {cost.seconds * 1e3:>9,.2f} "
                     f"{share:>6.1%}")
    syncs = ", ".join(f"{k} {v}" for k, v in sorted(c.sync_ops.items())) or "none"
    lines.append(f"host syncs: {c.syncs} ({syncs}) = {c.sync_s * 1e3:.2f} ms")
    where = ", ".join(f"{k} {v:,}" for k, v in sorted(c.fp32_functions.items(), key=lambda kv: -kv[1]))
    lines.append(f"fp32 matmuls: {c.fp32_matmul.launches:,} launches, {c.fp32_matmul.flops / 1e9:,.1f} GFLOPs, "
                 f"{c.fp32_matmul.compute_s * 1e3:.2f} ms roofline{f' ({where})' if where else ''}")
    lines.append(f"predicted step {c.step_s * 1e3:,.1f} ms -> {c.tokens_per_s:,.0f} tokens/s"
                 f"{f'; MFU {p.mfu:.1%}' if p.inductor is None else ''} (bench_models.py's FLOPs/token "
                 f"{p.flops_per_token / 1e9:.2f} G)")
    if p.inductor is not None:
        kinds = ", ".join(f"{k} {v:,}" for k, v in p.inductor.launches.most_common())
        lines.append(f"launches counted as Inductor emits them (launch twin: width {p.twin['width']}, seq "
                     f"{p.twin['seq_len']} = {p.seq_len} / {p.twin['factor']}, every layer, segment and chunk loop "
                     f"kept): compiled regions {p.inductor.total:,} in {p.inductor.calls:,} calls of "
                     f"{p.inductor.graphs} graphs ({kinds}) where the crude model counts {c.region_launches:,}; "
                     f"with the {total.launches - c.region_launches:,} outside them {p.launches:,} launches a step")
        lines.append(f"predicted step at Inductor's launches {p.step_s * 1e3:,.1f} ms -> {p.tokens_per_s:,.0f} "
                     f"tokens/s; MFU {p.mfu:.1%}")
    if c.memory_layers:
        layers = list(c.memory_layers.items())
        first, (fwd, bwd) = layers[0]
        mean = sum(f + b for f, b in c.memory_layers.values()) / len(layers)
        lines.append(f"launches per memory layer: {first}: {fwd + bwd:,} (forward {fwd:,}, backward {bwd:,} incl. "
                     f"recompute); mean over {len(layers)} memory modules {mean:,.0f}")
    lines.append("top ops by predicted time (class / aten op):")
    for (cls, name), cost in sorted(c.ops.items(), key=lambda kv: -kv[1].seconds)[:top]:
        lines.append(f"  {cls + ' / ' + name:<44} {cost.launches:>8,} launches {cost.flops / 1e9:>9,.1f} GFLOPs "
                     f"{cost.bytes / 1e9:>7,.2f} GB {cost.seconds * 1e3:>8,.2f} ms ({cost.launch_s * 1e3:,.2f} floor)")
    lines.append("top model functions by predicted time (forward op's function; backward ops take their node's):")
    for function, cost in sorted(c.functions.items(), key=lambda kv: -kv[1].seconds)[:top]:
        lines.append(f"  {function:<44} {cost.launches:>8,} launches {cost.flops / 1e9:>9,.1f} GFLOPs "
                     f"{cost.bytes / 1e9:>7,.2f} GB {cost.seconds * 1e3:>8,.2f} ms ({cost.launch_s * 1e3:,.2f} floor)")
    if p.compiled:
        lines.insert(2, f"compiled regions ({len(p.compiled_modules)}): {', '.join(p.compiled_modules[:4])}"
                        f"{', ...' if len(p.compiled_modules) > 4 else ''}; every other module eager")
    if baseline is not None:
        counted = " (Inductor's launches)" if baseline.inductor is not None else ""
        lines.append(f"beside {baseline.name} {baseline.flavor} (same mode and shape){counted}: {baseline.launches:,} "
                     f"launches, {baseline.tokens_per_s:,.0f} tokens/s; {p.name} / {baseline.name}: "
                     f"{p.launches / baseline.launches:.1f}x the launches, "
                     f"{p.tokens_per_s / baseline.tokens_per_s:.2f}x the tokens/s")
    measured = MEASURED_H100.get((p.name, p.flavor, p.mode))
    if measured and (p.batch, p.seq_len) == MEASURED_SHAPE:
        tokens_s, mfu = measured
        step = p.batch * p.seq_len / tokens_s
        per_launch = (step - c.total.compute_s - c.sync_s) / max(total.launches, 1)
        flop_s = sum(cost.compute_s for cost in c.ops.values() if cost.flops)
        room = step - (c.step_s - flop_s)
        efficiency = f"{flop_s / room:.0%}" if room > 0 else "none (the rest alone exceeds it)"
        lines.append(f"lease (H100, bench_models.py): {tokens_s:,} tokens/s = {step * 1e3:,.1f} ms/step"
                     f"{f', MFU {mfu}%' if mfu else ''}; predicted / measured {c.tokens_per_s / tokens_s:.2f}x")
        lines.append(f"  the measured step fits this model with {per_launch * 1e6:.1f} us per launch (FLOP-bearing "
                     f"ops at peak), or with the FLOP-bearing ops at {efficiency} of peak ({hw.launch_s * 1e6:.1f} us "
                     f"per launch)")
    return "\n".join(lines)
