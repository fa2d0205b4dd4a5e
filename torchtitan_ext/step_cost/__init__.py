"""Where a training step's time goes on an H100, predicted without a GPU (issue 39, item 1).

One training step (forward, backward, optimizer step) of a family's model is recorded on the
meta device (shapes and dtypes only: no memory, no compute) at the flavor's real shape, with
the loop of scripts/bench_models.py: random tokens (B, T + 1), bf16 autocast with fp32
parameters, cross-entropy (plus a model's own loss term), fused AdamW. Every aten op the step
executes is seen by a TorchDispatchMode and costed on an H100:

    time(op) = max(FLOPs / peak, bytes / HBM_BYTES_PER_S) + LAUNCH_FLOOR_S     (one launch)
    step     = sum over ops + HOST_SYNC_S x host syncs

The ops run back to back (no overlap of host and device); the launch floor (`LAUNCH_S` of the
mode) stands for the whole per-op cost outside the roofline: an eager step whose kernels are
tiny is bound by the host (Python, dispatcher, autograd per op). `report` prints, beside a
lease measurement, the per-launch cost at which the measured step fits (`--launch-floor-us`
sets it), and the Transformer++ of the same flavor in the same mode beside the model.

- FLOPs: torch's own formulas (`torch.utils.flop_counter.flop_registry`: mm, addmm, bmm,
  baddbmm, convolutions and their backward); fused attention kernels 4 B H Lq Lk D forward and
  10 B H Lq Lk D backward (flash attention recomputes the scores), halved when causal. Other
  ops count no FLOPs (their time is the bytes they move). The peak is the matmul's input
  dtype's: bf16 989e12 (dense), fp32 67e12 (no tensor cores: torch's default
  `allow_tf32=False` for matmuls, which bench_models.py leaves), TF32 494e12 with `tf32=True`.
- Bytes (the approximation): the sum of the op's distinct input tensors' and its outputs'
  sizes in their dtypes, a broadcast (stride 0) dimension counted once; an in-place op's
  tensor counts as read and written. No cache reuse between ops, no partial reads.
- Launches: one per op that runs a kernel; views, `detach`, `empty*` and other metadata ops
  run none. A multi-tensor op (`_foreach_*`, `_fused_adamw_`) counts one launch per
  MULTI_TENSOR_LIST tensors (or per MULTI_TENSOR_ELEMENTS elements, whichever is more).
- Host syncs: `aten._local_scalar_dense` (`.item()`, `bool(tensor)`), `nonzero`,
  `masked_select`, `equal`, and copies from the device to the CPU. On meta they cannot run:
  each is counted and answered with a placeholder (0, an empty result), so a step whose
  control flow depends on such a value is recorded along one path only.

The recording follows what the same code does on CUDA where the meta device would take
another branch (each switch is undone after the step):
- bf16 autocast is emulated (meta has no autocast) by a TorchFunctionMode: torch's CUDA
  lower-precision list (linear, matmul, mm, bmm, baddbmm, addmm, conv, SDPA, ...) casts its
  fp32 inputs to bf16, a leaf parameter once per forward (autocast's weight cache), and the
  fp32 list (softmax, log_softmax, cross_entropy, exp, log, pow, sum, ...) lifts bf16 inputs
  to fp32 (sum, cumsum, prod, softmax, log_softmax through their dtype argument, as autocast
  does), leaving nn.RMSNorm in its input's dtype; `kernels.full_precision` (autocast off around the fast-weight state update) turns
  the emulation off as it turns autocast off on CUDA, and `models.layers.autocast_weights`
  sees the emulated dtype (Mela's HMM weights cast once a forward, as on CUDA). Inside a checkpointed region's
  recompute autocast is on, as torch's checkpoint restores it; elsewhere in backward off.
- SDPA runs as the CUDA kernels would: flash attention (`_scaled_dot_product_flash_attention`,
  GQA native) without a mask, memory-efficient attention with one (meta would run SDPA's
  unfused math path). F.rms_norm (nn.RMSNorm) runs as `_fused_rms_norm`, torch's one-kernel
  CUDA RMSNorm.
- `models.layers.attention.masked_attention` (Titans' attention) takes its CUDA branch,
  eager flex attention, which torch runs unfused: `create_block_mask` evaluated densely
  (once per shape where the model builds it once: `flex_block_mask` builds on meta too), then torch's own `math_attention` (scores materialised in fp32, where-mask, logsumexp,
  softmax, @ v), differentiated by autograd (torch's eager backward recomputes the scores
  instead: the op count is close, the saved bytes differ). Its FLOPs are the dense matmuls'
  (no block skipping), its matmuls autocast to bf16 (the flex HOP falls through the
  autocast key, so the ops of its dense implementation are autocast as any other; assumed,
  not measured).
- `kernels` backend "auto" resolves to "compiled" on CUDA (`kernels/auto_table.py`), so the
  chunk rule's update (`memory_update_reference`, `newton_schulz_reference`: Mela) runs
  through torch.compile even in an eager model; its ops are costed as a compiled region.
  The per-token rule's chunk step (Titans) stays eager ("auto" never picks a fused step).
- The optimizer step is torch's fused AdamW (bench_models.py on CUDA) called directly:
  `_foreach_add_` on the step counters, then `_fused_adamw_` (AdamW refuses meta tensors).

Modes (`predict(mode=...)`, `LAUNCH_S` the per-launch cost of each, with its source):
- "eager": every op one launch.
- "compiled": the modules the family's training compiles (`Family.compiled_module_names`:
  torchtitan's per-block compile of `layers`, each block with fullgraph=True; Titans' regions,
  `compile_regions`, and with the chunk loop its chunk step) are compiled regions, every
  other module and the loss run eager, as in training. Inside a compiled region, a crude model
  stated plainly: every run of consecutive non-matmul ops (between two matmul or attention
  ops, in execution order) is one fused kernel: one launch, moving the bytes of the largest
  op of the run. Matmuls keep their cost. Compiled flex attention is one fused kernel (costed
  as flash attention whose FLOPs are scaled by the mask's density).
- "graphs": compiled so, and the whole step captured once and replayed as a CUDA graph: the
  same kernels, each at the graph's per-node cost.

Classes (each op in exactly one; they sum to the total):
- optimizer: every op of the optimizer step.
- attention: fused attention kernels, and every op of the eager flex path (block mask,
  scores, softmax, the two matmuls) and of their backward.
- memory update / memory read: the ops of a neural memory module (any module of
  `models/memory/`, run through its forward or one of its methods called directly, such as
  MAC's `retrieve`), read when they run under `retrieve`, `_output` (the read's norm, gate
  and projection) or `mlp_forward` (the fast-weight MLP applied to queries; in the chunk
  step the same matmul also applies it to the chunk's keys for the write), update otherwise
  (q/k/v projections and conv, gates, chunk gates, per-token gradients, state mix,
  Newton-Schulz, stacking of the state).
- decoder matmuls: every other matmul (projections, SwiGLU, output head, Mela's fusion MLPs).
- elementwise: every other op (norms, activations, residual adds, RoPE, casts, copies,
  embedding, loss).
Backward ops take the class of the forward op that made their autograd node: each node made
under the TorchFunctionMode is tagged with the forward context (module, memory, read or
update, attention, compiled region) and a pre-hook makes the tag current when the node runs;
an untagged node's ops (made inside a composite function) keep the tag of the node run just
before them. Recomputed forward ops (checkpointed chunks) are classed by their own frames.
Each op is also booked under the innermost model function (models/, kernels/) on the Python
stack when its forward op ran ("chunk_write.py:associative_grads"); the report's table of
top functions says which code the launches come from.

Recording time grows with the ops: on a shared 2-core CPU transformer_400m at T 4096 takes
~1 s, mela_400m ~30 s, titans_mac_400m ~90 s (247k launches: the per-chunk loop).
"""

from torchtitan_ext.step_cost.hardware import (BF16_PEAK, CLASSES, FP32_PEAK, HOST_SYNC_S, LAUNCH_FLOOR_S, LAUNCH_S,
                                               MODES, TF32_PEAK, Cost, Hardware, StepCost)
from torchtitan_ext.step_cost.prediction import Prediction, baseline_of, parse_config, predict, report
from torchtitan_ext.step_cost.recorder import record_step

__all__ = ["BF16_PEAK", "CLASSES", "FP32_PEAK", "HOST_SYNC_S", "LAUNCH_FLOOR_S", "LAUNCH_S", "MODES", "TF32_PEAK", "Cost",
           "Hardware", "StepCost", "Prediction", "baseline_of", "parse_config", "predict", "report", "record_step"]
