"""Predict the peak accelerator memory of one training step, before any memory is spent.

The breakdown (bytes per rank):
- parameters: fp32 master weights, / R under FSDP over R ranks;
- buffers: the model's persistent buffers (e.g. RoPE tables), on every rank;
- gradients: fp32, one per parameter, / R;
- optimizer: AdamW's two fp32 states per parameter, / R;
- activations: the peak, over one forward + backward, of the bytes held by tensors the step
  creates (saved for backward, the chunked loss's logits, backward temporaries; parameter
  gradients excluded), with and without the memory's `checkpoint_chunks` (and with the
  config's torchtitan activation checkpointing, when `budget_of_job` is given one);
- fast-weight state: each neural memory's live state, weights + momentum per batch row and
  head in fp32 (B x H x sum(in x out) x 2 x 4 bytes per memory module). It is part of the
  activations figure already (informational; the copies kept per chunk for backward are
  activations too).

The predicted peak = buffers + (parameters + optimizer) / R + max over the step of (activations(t) +
gradients live(t) / R); the optimizer step itself (parameters, gradients, states; fused AdamW
has no temporaries) is the other candidate for the peak.

Method (measured, not modelled by hand): the model is built on the meta device (no memory,
no compute) and one training step runs there with the project's loss pattern (hidden states,
then the output head and cross-entropy chunk by chunk as torchtitan's `ChunkedLossWrapper`),
under a `TorchDispatchMode` that adds the bytes of every new tensor storage and subtracts
them when the storage is freed (weak references), so the peak is that of the step's real
tensor lifetimes. Attention runs through the flash kernel's saved-tensor pattern (q, k, v,
output, log-sum-exp: O(T)), as flash / memory-efficient SDPA on a GPU, not the meta device's
O(T^2) math fallback. In bf16 the model's parameters are cast to bf16 for the step (FSDP2's
`param_dtype`); the fast-weight state stays fp32 by the memory's own rule. To keep the
simulation short (its cost is per op, ~0.2 ms, not per byte), long sequences are simulated
at two shorter lengths (multiples of the model's chunk / window / recompute group) and deep
models at k and k + 1 blocks, then extrapolated linearly in T and in depth: every family's
activations grow linearly in T (chunked memories, windowed or chunked attention, flash
attention's O(T) saved tensors) and by the same bytes per identical block.

What is not counted: the CUDA context and caching allocator fragmentation (typically a few
hundred MiB to 1-2 GiB on a GPU: leave that headroom), FSDP's transient all-gather buffers
(one or two layers of bf16 parameters), compiled-graph workspace.

Checked on CPU (tests/test_memory_budget.py): the prediction against the peak of a real
forward + backward + fused AdamW step, measured from torch's CPU allocator events (the
profiler's `[memory]` records: every tensor allocation and free), within 15% for three debug
configs with `checkpoint_chunks` on and off; figures in docs/benchmarks.md. Not yet checked
against `torch.cuda.max_memory_allocated` on a GPU, nor in bf16. GradMem configs are not
supported (their rows need [context | query] positions and a second-order write).

`predict`, `simulate_step` and `measured_cpu_peak` need only torch; `budget_of_job`, `fits`
and `warning_line` read a torchtitan trainer config (preflight's entry points).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

GiB = 2**30
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DEFAULT_GROUPS = 4  # checkpoint_chunks shown beside "off" when the config has none
DEFAULT_SIM_TOKENS = 1024  # longest sequence simulated directly; longer ones are extrapolated


# ---------------------------------------------------------------- tracking live bytes


class LiveBytes(TorchDispatchMode):
    """Bytes held by storages created inside the mode: `act` (any tensor) and `grad` (those a
    parameter's `.grad` took, moved there by `mark_grad`). `trace` holds (act, grad) after
    every op; storages registered with `ignore` (parameters, buffers) are never counted."""

    def __init__(self):
        super().__init__()
        self.entries: dict[int, list] = {}  # storage cdata -> [weakref, nbytes, kind]
        self.ignored: set[int] = set()
        self.current = {"act": 0, "grad": 0}
        self.trace: list[tuple[int, int]] = []

    def ignore(self, tensors) -> None:
        for t in tensors:
            self.ignored.add(t.untyped_storage()._cdata)

    def _free(self, key: int, _ref) -> None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.current[entry[2]] -= entry[1]
            self.trace.append((self.current["act"], self.current["grad"]))

    def _add(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.ignored or key in self.entries:
            return
        nbytes = storage.nbytes()
        self.entries[key] = [weakref.ref(storage, lambda ref, key=key: self._free(key, ref)), nbytes, "act"]
        self.current["act"] += nbytes

    def mark_grad(self, t: torch.Tensor) -> None:
        entry = self.entries.get(t.untyped_storage()._cdata)
        if entry is not None and entry[2] == "act":
            entry[2] = "grad"
            self.current["act"] -= entry[1]
            self.current["grad"] += entry[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t)
        self.trace.append((self.current["act"], self.current["grad"]))
        return out


_sdpa = F.scaled_dot_product_attention


def _flash_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA with the flash kernel's memory (saves q, k, v, output, log-sum-exp) on the meta
    device, where torch would otherwise take the math path and keep T x T weights. The mask
    is dropped (causal), as flex attention's block masks cost next to nothing on a GPU."""
    if q.device.type != "meta":
        return _sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                     enable_gqa=enable_gqa)
    if k.shape[1] != q.shape[1]:
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, True, scale=scale)[0]


@contextlib.contextmanager
def flash_attention_on_meta():
    """Route `F.scaled_dot_product_attention` through `_flash_sdpa` inside the block, and skip
    the dense (B, 1, T, T) document masks of the CPU stand-in for torchtitan's attention
    (`llama3_cpu_attention`, when imported): a GPU's flex / varlen kernels build none."""
    cpu_attention = sys.modules.get("torchtitan_ext.training.llama3_cpu_attention")
    mask = getattr(cpu_attention, "document_causal_mask", None)
    F.scaled_dot_product_attention = _flash_sdpa
    if mask is not None:
        cpu_attention.document_causal_mask = lambda doc_ids: None
    try:
        yield
    finally:
        F.scaled_dot_product_attention = _sdpa
        if mask is not None:
            cpu_attention.document_causal_mask = mask


# ---------------------------------------------------------------- one training step


def training_step(model: nn.Module, tokens: torch.Tensor, loss_chunks: int = 8, extra: dict | None = None) -> None:
    """Forward + backward as the trainer runs it: hidden states (`_skip_lm_head`), then the
    output head and fp32 cross-entropy on `loss_chunks` pieces of the sequence, each backward
    at once (torchtitan's ChunkedLossWrapper), then backward through the decoder.
    tokens (B, T + 1) int64: inputs tokens[:, :-1], labels tokens[:, 1:]; `extra`: keyword
    inputs of the model's forward (torchtitan's attention metadata)."""
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    model._skip_lm_head = True
    try:
        out = model(inputs, **(extra or {}))
    finally:
        model._skip_lm_head = False
    hidden = out[0] if isinstance(out, tuple) else out
    detached = hidden.detach().requires_grad_(True)
    n = labels.numel()
    for h, y in zip(detached.chunk(loss_chunks, dim=1), labels.chunk(loss_chunks, dim=1)):
        logits = model.lm_head(h)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum") / n
        loss.backward()
        del logits, loss
    hidden.backward(detached.grad)


def _persistent(model: nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


@dataclass
class StepTrace:
    """(act, grad) bytes after every op of a simulated step; `grad_total`: all gradients."""

    trace: list[tuple[int, int]]
    grad_total: int

    def peak(self, ranks: int = 1, grad_scale: float = 1.0) -> tuple[int, int]:
        """(activations, gradients live) at the step's peak of act + grad x scale / ranks."""
        act, grad = max(self.trace, key=lambda ag: ag[0] + ag[1] * grad_scale / ranks)
        return act, grad


def simulate_step(model: nn.Module, batch: int, seq_len: int, loss_chunks: int = 8,
                  extra: Callable | None = None) -> StepTrace:
    """One training step of a meta-device `model` at (batch, seq_len) under `LiveBytes`;
    `extra(batch, seq_len, device)` -> the forward's extra keyword inputs."""
    tracker = LiveBytes()
    tracker.ignore(_persistent(model))
    handles = [p.register_post_accumulate_grad_hook(lambda p: tracker.mark_grad(p.grad))
               for p in model.parameters() if p.requires_grad]
    tokens = torch.zeros(batch, seq_len + 1, dtype=torch.long, device="meta")
    try:
        with flash_attention_on_meta(), tracker:
            training_step(model, tokens, loss_chunks, extra(batch, seq_len, "meta") if extra else None)
    finally:
        for h in handles:
            h.remove()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return StepTrace(tracker.trace or [(0, 0)], _storage_bytes(grads))


# ---------------------------------------------------------------- the budget


def memory_configs(model: nn.Module):
    """The neural-memory configs of a model's memory modules (anything whose `cfg` has `layer_shapes`)."""
    for module in model.modules():
        cfg = getattr(module, "cfg", None)
        if cfg is not None and hasattr(cfg, "layer_shapes") and hasattr(cfg, "checkpoint_chunks"):
            yield cfg


def fast_state_bytes(model: nn.Module, batch: int) -> int:
    """fp32 weights + momentum of every memory module, per batch row and head."""
    return sum(batch * cfg.n_heads * sum(i * o for i, o in cfg.layer_shapes()) * 2 * 4 for cfg in memory_configs(model))


def with_checkpoint_chunks(config, groups: int):
    """A copy of a (nested) dataclass config with every memory config's checkpoint_chunks = groups."""
    if not dataclasses.is_dataclass(config):
        return config
    changes = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            changes[f.name] = with_checkpoint_chunks(value, groups)
    if any(f.name == "checkpoint_chunks" for f in dataclasses.fields(config)) and hasattr(config, "layer_shapes"):
        changes["checkpoint_chunks"] = groups
    return dataclasses.replace(config, **changes)


def granularity(config) -> int:
    """The shortest sequence step of a (plain) model config: lcm of its windows, chunks and
    recompute groups (simulated lengths are multiples of it)."""
    g = 1
    def visit(c):
        nonlocal g
        for name in ("window", "chunk_tokens", "segment"):
            value = getattr(c, name, None)
            if isinstance(value, int) and value > 0:
                g = math.lcm(g, value)
        if hasattr(c, "layer_shapes") and getattr(c, "chunk_size", None):
            g = math.lcm(g, c.chunk_size * max(1, c.checkpoint_chunks))
        if dataclasses.is_dataclass(c):
            for f in dataclasses.fields(c):
                value = getattr(c, f.name)
                if dataclasses.is_dataclass(value):
                    visit(value)
    visit(config)
    return g


def simulated_lengths(seq_len: int, step: int, max_tokens: int = DEFAULT_SIM_TOKENS) -> tuple[int, ...]:
    """(seq_len,) when it is short enough to simulate, else two multiples of `step` to extrapolate from."""
    if seq_len <= max(max_tokens, 2 * step):
        return (seq_len,)
    k2 = max(2, max_tokens // step)
    return (step * (k2 // 2), step * k2)


@dataclass
class Budget:
    """Predicted bytes per rank (module docstring); `activations` at the peak, `activations_by_mode`
    the same under each recompute setting simulated, `peak` the prediction."""

    params: int
    buffers: int
    grads: int
    optimizer: int
    activations: int
    grads_at_peak: int
    fast_state: int
    peak: int
    activations_by_mode: dict[str, int] = field(default_factory=dict)
    batch: int = 0
    seq_len: int = 0
    dtype: str = "fp32"
    ranks: int = 1
    simulated: tuple[int, ...] = ()
    simulated_depths: tuple = ()

    def lines(self) -> list[str]:
        gib = lambda b: f"{b / GiB:9.3f} GiB"
        out = [f"batch {self.batch} x seq_len {self.seq_len}, {self.dtype}, FSDP over {self.ranks} rank(s)"
               + (f"; simulated at T = {', '.join(map(str, self.simulated))}" if self.simulated != (self.seq_len,) else "")
               + (f", {' and '.join(map(str, self.simulated_depths))} block(s)" if None not in self.simulated_depths else "")
               + (", extrapolated linearly" if self.simulated != (self.seq_len,) or None not in self.simulated_depths else ""),
               f"  parameters (fp32)           {gib(self.params)}",
               f"  buffers                     {gib(self.buffers)}",
               f"  gradients (fp32)            {gib(self.grads)}",
               f"  optimizer (AdamW, 2 x fp32) {gib(self.optimizer)}",
               f"  activations at the peak     {gib(self.activations)}",
               f"    of which fast-weight state (fp32) {gib(self.fast_state)}"]
        for mode, value in self.activations_by_mode.items():
            out.append(f"  activations, {mode:<22}{gib(value)}")
        out.append(f"  predicted peak              {gib(self.peak)}")
        return out


def shallow_depths(build: Callable[..., nn.Module], groups: int | None, depth: int | None) -> tuple:
    """(k, k + 1) blocks for the smallest k the model builds with (Mela's MemStack needs
    H - 1 decoder layers), or (None,) (the full model) when that is not shallower than `depth`."""
    for k in range(1, (depth or 0) - 1):
        try:
            build(groups, k), build(groups, k + 1)
        except ValueError:
            continue
        return (k, k + 1)
    return (None,)


def predict(build: Callable[..., nn.Module], *, batch: int, seq_len: int, dtype: str = "fp32",
            ranks: int = 1, loss_chunks: int = 8, checkpoint_chunks: int | None = None, step: int = 1,
            depth: int | None = None, max_sim_tokens: int = DEFAULT_SIM_TOKENS,
            other_modes: dict[str, int | None] | None = None, extra: Callable | None = None) -> Budget:
    """The budget of one training step (module docstring). `build(groups, layers)` returns the
    model on the meta device with every memory's checkpoint_chunks = groups (None: as
    configured) and `layers` blocks (None: all `depth` of them); `checkpoint_chunks` picks the
    setting predicted, `other_modes` ({label: groups}) adds activations under other settings;
    `step`: the model's sequence granularity; `extra`: as in `simulate_step`.

    Simulated: lengths `simulated_lengths(seq_len, step)` x depths `shallow_depths` (else the
    full model), each point's (activations, gradients live) at its peak, then
    extrapolated linearly in T and in the number of blocks (identical blocks each keep the
    same bytes; what is outside them is the intercept)."""
    lengths = simulated_lengths(seq_len, step, max_sim_tokens)
    depths = shallow_depths(build, checkpoint_chunks, depth)
    grad_scale = 2.0 if dtype == "bf16" else 1.0  # gradients simulated in bf16 are fp32 under FSDP2

    def simulate(groups):
        grid = {}
        for layers in depths:
            for t in lengths:
                model = build(groups, layers)
                if dtype == "bf16":
                    model.to(torch.bfloat16)
                grid[layers, t] = simulate_step(model, batch, t, loss_chunks, extra)
        return grid

    def line(x1, y1, x2, y2, x):
        return y2 + (y2 - y1) * (x - x2) / (x2 - x1)

    def extrapolate(grid) -> tuple[int, int]:
        def at_length(layers):
            points = [(t, *grid[layers, t].peak(ranks, grad_scale)) for t in lengths]
            if len(points) == 1:
                return points[0][1:]
            (t1, a1, g1), (t2, a2, g2) = points
            return line(t1, a1, t2, a2, seq_len), line(t1, g1, t2, g2, seq_len)
        if depths == (None,):
            act, grad = at_length(None)
        else:
            (k1, k2), ((a1, g1), (a2, g2)) = depths, (at_length(depths[0]), at_length(depths[1]))
            act, grad = line(k1, a1, k2, a2, depth), line(k1, g1, k2, g2, depth)
        return int(act), int(grad * grad_scale / ranks)

    full = build(checkpoint_chunks, None)
    params, buffers = _storage_bytes(full.parameters()), _storage_bytes(full.buffers())  # fp32 master weights
    grads, optimizer = params, 2 * params
    act, grads_at_peak = extrapolate(simulate(checkpoint_chunks))
    peak = buffers + max((params + optimizer) // ranks + act + grads_at_peak, (params + grads + optimizer) // ranks)
    by_mode = {label: act if groups == checkpoint_chunks else extrapolate(simulate(groups))[0]
               for label, groups in (other_modes or {}).items()}
    return Budget(params=params // ranks, buffers=buffers, grads=grads // ranks, optimizer=optimizer // ranks,
                  activations=act, grads_at_peak=grads_at_peak, fast_state=fast_state_bytes(full, batch), peak=peak,
                  activations_by_mode=by_mode, batch=batch, seq_len=seq_len, dtype=dtype, ranks=ranks,
                  simulated=lengths, simulated_depths=depths)


# ---------------------------------------------------------------- measured on CPU


def measured_cpu_peak(model: nn.Module, batch: int, seq_len: int, loss_chunks: int = 8, steps: int = 2,
                      lr: float = 1e-4, extra: Callable | None = None) -> int:
    """The peak bytes of torch CPU tensors during the last of `steps` real training steps
    (forward + backward + fused AdamW, gradients set to None between steps), from the CPU
    allocator's events (torch.profiler's `[memory]` records: every allocation and free): the
    bytes live at the step's start (parameters, buffers, optimizer states) plus the largest
    running sum of the events. Not the process RSS: the Python heap, the allocator's cached
    pages and the interpreter are left out, as the accelerator prediction leaves them out."""
    from torch.profiler import ProfilerActivity, profile

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    tokens = torch.randint(0, model.lm_head.out_features, (batch, seq_len + 1))

    def step():
        training_step(model, tokens, loss_chunks, extra(batch, seq_len, "cpu") if extra else None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(steps - 1):
        step()
    states = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    start = _storage_bytes(_persistent(model) + states)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    running = top = 0
    for e in events:
        running += e.nbytes()
        top = max(top, running)
    return start + top


# ---------------------------------------------------------------- from a trainer config


def job_model(job_config, groups: int | None = None, ac: bool = True, device="meta", layers: int | None = None) -> nn.Module:
    """A trainer config's model on `device` (meta: no memory), every memory's checkpoint_chunks
    = groups (None: as configured), its first `layers` blocks (None: all), with the config's
    torchtitan activation checkpointing on its blocks when `ac`; real devices get the model's
    own initialisation."""
    config = job_config.model_spec.model
    if groups is not None and hasattr(config, "model"):
        config = dataclasses.replace(config, model=with_checkpoint_chunks(config.model, groups))
    if layers is not None and hasattr(config, "model"):
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, n_layers=layers))
    elif layers is not None:
        config = dataclasses.replace(config, layers=list(config.layers[:layers]))
    with torch.device(device):
        model = config.build()
    if str(device) != "meta" and hasattr(model, "init_states"):
        model.init_states()
    if ac and _ac_mode(job_config) != "none":
        job_config.activation_checkpoint.build(dump_folder="").apply(model)
    return model


def _plain_builder(job_config, ac: bool):
    """build(groups, layers) of `predict` for a trainer config's model."""
    return lambda groups, layers=None: job_model(job_config, groups, ac, layers=layers)


def depth_of(job_config) -> int:
    """The number of blocks of a trainer config's model (`n_layers`, or torchtitan's layer list)."""
    config = job_config.model_spec.model
    return config.model.n_layers if hasattr(config, "model") else len(config.layers)


def attention_metadata(job_config) -> Callable | None:
    """`extra` for a torchtitan decoder (no plain config inside its spec): varlen metadata of
    one document per row, as torchtitan's trainer passes it; None for the plain families."""
    if hasattr(job_config.model_spec.model, "model"):
        return None
    from torchtitan.models.common.attention import VarlenMetadata

    def extra(batch: int, seq_len: int, device) -> dict:
        cu = torch.arange(0, batch * seq_len + 1, seq_len, dtype=torch.int32, device=device)
        return {"attention_masks": VarlenMetadata(cu, cu, seq_len, seq_len)}

    return extra


def configured_groups(job_config) -> int:
    """The largest checkpoint_chunks among a trainer config's memory configs (0: none recompute)."""
    plain = getattr(job_config.model_spec.model, "model", None)
    groups = [c.checkpoint_chunks for c in _nested(plain) if hasattr(c, "layer_shapes")]
    return max(groups, default=0)


def _nested(config):
    if dataclasses.is_dataclass(config):
        yield config
        for f in dataclasses.fields(config):
            yield from _nested(getattr(config, f.name))


def _ac_mode(job_config) -> str:
    name = type(job_config.activation_checkpoint).__qualname__.split(".")[0]
    return {"FullAC": "full", "SelectiveAC": "selective", "MemoryBudgetAC": "memory_budget"}.get(name, "none")


def budget_of_job(job_config, *, local_batch: int | None = None, seq_len: int | None = None,
                  dtype: str | None = None, ranks: int = 1, checkpoint_chunks: int | None = None,
                  max_sim_tokens: int = DEFAULT_SIM_TOKENS, compare: bool = True) -> Budget:
    """The budget of a torchtitan trainer config (`train_configs` function's result). Defaults:
    the config's local batch, seq_len and parameter dtype; `checkpoint_chunks` None keeps the
    config's memory recompute (groups of that many chunks; 0 turns it off). The
    prediction uses the config's activation checkpointing mode; the breakdown also lists
    activations with recompute off and on and with AC off (`compare`; each one more simulation)."""
    training = job_config.training
    batch = local_batch or training.local_batch_size
    seq_len = seq_len or training.seq_len
    dtype = dtype or ("bf16" if training.mixed_precision_param == "bfloat16" else "fp32")
    loss_chunks = getattr(job_config.loss, "num_chunks", 1)
    configured = configured_groups(job_config)
    groups = configured if checkpoint_chunks is None else checkpoint_chunks
    other = groups or configured or DEFAULT_GROUPS
    ac = _ac_mode(job_config)
    plain = getattr(job_config.model_spec.model, "model", job_config.model_spec.model)
    kwargs = dict(batch=batch, seq_len=seq_len, dtype=dtype, ranks=ranks, loss_chunks=loss_chunks,
                  step=granularity(plain), max_sim_tokens=max_sim_tokens, extra=attention_metadata(job_config),
                  depth=depth_of(job_config))
    has_memory = configured or any(hasattr(c, "layer_shapes") for c in _nested(plain))
    modes = {}
    if has_memory and compare:
        modes = {"checkpoint_chunks off": 0, f"checkpoint_chunks {other}": other}
    budget = predict(_plain_builder(job_config, ac != "none"), checkpoint_chunks=groups, other_modes=modes, **kwargs)
    if ac != "none" and compare:
        no_ac = predict(_plain_builder(job_config, False), checkpoint_chunks=groups, **kwargs)
        budget.activations_by_mode[f"without {ac} AC"] = no_ac.activations
        budget.activations_by_mode = {f"{k} ({ac} AC)" if "checkpoint" in k else k: v
                                      for k, v in budget.activations_by_mode.items()}
    return budget


def fits(job_config, device_bytes: int, **kwargs) -> tuple[int, Budget]:
    """(predicted peak bytes, Budget) of a trainer config; compare the first with `device_bytes`."""
    budget = budget_of_job(job_config, **kwargs)
    return budget.peak, budget


def warning_line(job_config, device_bytes: int, headroom: float = 0.9, budget: Budget | None = None,
                 **kwargs) -> str | None:
    """One line when the predicted peak exceeds `headroom` x the device's memory, else None
    (`budget`: one already computed; else `kwargs` go to `budget_of_job`, e.g. ranks=world size)."""
    if budget is None:
        try:
            budget = budget_of_job(job_config, compare=False, **kwargs)
        except Exception as e:  # a model the simulation cannot step: say so, do not stop the run
            return f"warning: no memory prediction for this model ({type(e).__name__}: {e})"
    peak = budget.peak
    if peak <= headroom * device_bytes:
        return None
    advice = "lower --training.local_batch_size"
    if budget.activations_by_mode and not configured_groups(job_config):
        advice += " or set the memory's checkpoint_chunks"
    return (f"warning: predicted peak memory {peak / GiB:.1f} GiB (activations {budget.activations / GiB:.1f} GiB) "
            f"exceeds {headroom:.0%} of the device's {device_bytes / GiB:.1f} GiB: {advice} "
            "(python scripts/memory_budget.py for the breakdown)")
