"""torchtitan_ext/step_cost/ and scripts/step_cost.py: one training step recorded on the meta
device and costed on an H100 (issue 39). Debug flavors at short sequences: seconds in all."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from conftest import load_script
from torchtitan_ext import step_cost
from torchtitan_ext.step_cost import CLASSES, Hardware, parse_config, predict, record_step


class Product(nn.Module):
    """loss = sum(X @ W) with X (m, k) and W (k, n) both parameters: a pure matmul step."""

    def __init__(self, m: int, k: int, n: int, device="meta"):
        super().__init__()
        self.x = nn.Parameter(torch.empty(m, k, device=device))
        self.w = nn.Parameter(torch.empty(k, n, device=device))

    def forward(self) -> torch.Tensor:
        return self.x @ self.w


def matmul_step(m, k, n, **options):
    return record_step(Product(m, k, n), lambda model: model().float().sum(), **options)


@pytest.fixture(scope="module")
def titans_short():
    return predict("titans_mac_debug", seq_len=64, batch=2)


@pytest.fixture(scope="module")
def titans_long():
    return predict("titans_mac_debug", seq_len=128, batch=2)


def test_parse_config():
    assert parse_config("titans_mac_400m") == ("titans_mac", "400m")
    assert parse_config("transformer_400m") == ("transformer", "400m")
    assert parse_config("mela_400m") == ("mela", "400m")
    assert parse_config("transformer_mela_400m_peer") == ("transformer", "mela_400m_peer")
    assert parse_config("mela:debug") == ("mela", "debug")
    with pytest.raises(ValueError, match="no <family>"):
        parse_config("titans_xyz_400m")


def test_classes_sum_to_the_total(titans_short):
    cost = titans_short.cost
    assert tuple(cost.classes) == CLASSES
    total = cost.total
    for field in ("launches", "flops", "bytes", "compute_s", "launch_s"):
        by_class = sum(getattr(c, field) for c in cost.classes.values())
        by_op = sum(getattr(c, field) for c in cost.ops.values())
        by_function = sum(getattr(c, field) for c in cost.functions.values())
        assert by_class == pytest.approx(getattr(total, field))
        assert by_op == pytest.approx(by_class) and by_function == pytest.approx(by_class)
    assert cost.step_s == pytest.approx(total.seconds + cost.syncs * cost.hardware.sync_s)
    for name in ("attention", "memory update", "memory read", "decoder matmuls", "elementwise", "optimizer"):
        assert cost.classes[name].launches > 0, name  # MAC exercises every class
    assert cost.tokens_per_s == pytest.approx(2 * 64 / cost.step_s)
    assert cost.syncs == 0  # the training step never waits on the host


def test_matmul_flops_are_6mnk():
    """Forward X W (2mnk) and backward dX, dW (2mnk each): 6 m n k, every one a decoder matmul."""
    m, k, n = 256, 512, 384
    for bf16 in (True, False):
        cost = matmul_step(m, k, n, bf16=bf16)
        assert cost.total.flops == pytest.approx(6 * m * n * k, rel=0.01)
        assert cost.classes["decoder matmuls"].flops == pytest.approx(6 * m * n * k, rel=0.01)
        assert cost.classes["decoder matmuls"].launches == 3
        # bf16 autocast puts them on the bf16 peak; without it they run at the fp32 (no tensor core) peak
        assert cost.fp32_matmul.flops == (0 if bf16 else pytest.approx(6 * m * n * k))
    fp32, tf32 = matmul_step(4096, 4096, 4096, bf16=False), matmul_step(4096, 4096, 4096, bf16=False,
                                                                         hardware=Hardware(tf32=True))
    assert fp32.fp32_matmul.compute_s == pytest.approx(6 * 4096**3 / step_cost.FP32_PEAK)
    assert tf32.fp32_matmul.compute_s == pytest.approx(6 * 4096**3 / step_cost.TF32_PEAK)


def test_time_is_the_roofline_plus_the_launch_floor():
    m = k = n = 8192
    cost = matmul_step(m, k, n, bf16=True)
    mm = cost.ops[("decoder matmuls", "mm")]
    assert mm.launches == 3 and mm.launch_s == pytest.approx(3 * step_cost.LAUNCH_FLOOR_S)
    assert mm.compute_s == pytest.approx(6 * m * n * k / step_cost.BF16_PEAK)  # compute-bound at this size
    tiny = matmul_step(8, 8, 8, bf16=True)
    assert tiny.ops[("decoder matmuls", "mm")].compute_s < 1e-8  # bytes / bandwidth: the floor dominates


def test_the_meta_device_holds_no_memory():
    """80 GB of parameters (and as much state) record in well under a second: meta tensors."""
    m = k = n = 100_000
    model = Product(m, k, n)
    assert all(p.device.type == "meta" for p in model.parameters())
    cost = record_step(model, lambda mod: mod().sum(), bf16=True)
    assert cost.device == "meta"
    assert cost.total.flops == pytest.approx(6 * m * n * k, rel=0.01)
    with pytest.raises(ValueError, match="meta device"):
        record_step(Product(4, 4, 4, device="cpu"), lambda mod: mod().sum())


def test_family_models_are_built_on_meta(titans_short):
    assert titans_short.params > 0
    assert titans_short.cost.device == "meta" and titans_short.seq_len == 64


def test_memory_layer_launches_grow_with_the_sequence(titans_short, titans_long):
    """The per-chunk path launches a memory layer's kernels chunk by chunk: twice the tokens,
    about twice the launches (a whole-sequence path would keep them flat)."""
    short = sum(titans_short.cost.memory_layers["layers.0.memory"])
    long = sum(titans_long.cost.memory_layers["layers.0.memory"])
    assert long > 1.7 * short
    assert set(titans_short.cost.memory_layers) == {"layers.0.memory", "layers.1.memory"}


def test_host_syncs_are_counted():
    class Syncing(Product):
        def forward(self):
            out = self.x @ self.w
            return out * (2.0 if out.sum().item() > 0 else 1.0)

    cost = record_step(Syncing(8, 8, 8), lambda mod: mod().sum())
    assert cost.syncs == 1 and cost.sync_ops == {"_local_scalar_dense": 1}
    assert cost.step_s == pytest.approx(cost.total.seconds + step_cost.HOST_SYNC_S)


def test_cuda_paths_are_recorded(titans_short):
    """bf16 autocast but the fast-weight state update (fp32, under kernels.full_precision);
    Titans' attention as eager flex attention (scores materialised); the transformer's SDPA
    as flash attention; fused AdamW."""
    cost = titans_short.cost
    assert cost.fp32_matmul.launches > 0
    assert set(cost.fp32_functions) == {"chunk_write.py:token_scan_update"}  # every fp32 matmul: the state mix
    assert "attention.py:masked_attention (eager flex)" in cost.functions
    import kernels
    import models.layers.attention
    import models.lms.titans
    import models.memory.chunk_write

    # the CUDA switches are undone after the step
    assert models.lms.titans.masked_attention is models.layers.attention.masked_attention
    assert models.layers.attention.masked_attention.__module__ == "models.layers.attention"
    assert models.memory.chunk_write.full_precision is kernels.full_precision
    assert kernels.full_precision.__module__ == "kernels.token_step"
    transformer = predict("transformer_debug", seq_len=64).cost
    assert transformer.fp32_matmul.launches == 0
    assert {name for _, name in transformer.ops} >= {"_scaled_dot_product_flash_attention",
                                                      "_scaled_dot_product_flash_attention_backward", "_fused_adamw_"}


def test_compiled_fuses_elementwise_runs():
    eager = predict("transformer_debug", seq_len=64).cost
    compiled = predict("transformer_debug", seq_len=64, mode="compiled").cost
    assert compiled.total.flops == pytest.approx(eager.total.flops)
    # traced, q/k/v run as one matmul (`Attention.project`): 2 fewer forward, 4 fewer backward per layer
    layers = 4
    assert compiled.classes["decoder matmuls"].launches == eager.classes["decoder matmuls"].launches - 6 * layers
    assert compiled.classes["elementwise"].launches < eager.classes["elementwise"].launches / 2
    assert compiled.step_s < eager.step_s


def test_mela_records():
    p = predict("mela_debug", seq_len=64)
    assert p.cost.classes["memory update"].launches > 0 and p.cost.classes["memory read"].launches > 0
    assert math.isfinite(p.cost.tokens_per_s) and p.cost.tokens_per_s > 0


def test_script_prints_the_tables(capsys):
    assert load_script("step_cost").main(["--config", "titans_mac_debug", "--seq-len", "64"]) == 0
    out = capsys.readouterr().out
    for text in ("memory update", "memory read", "predicted step", "tokens/s", "launches per memory layer",
                 "layers.0.memory", "top ops", "top model functions", "total"):
        assert text in out
    assert load_script("step_cost").main(["--config", "nope_400m"]) == 2


def test_mode_shorthands_are_the_modes():
    parse = load_script("step_cost").parser().parse_args
    assert parse(["--config", "x"]).mode == "eager"
    assert parse(["--config", "x", "--compiled", "--whole-sequence"]).mode == "compiled"
    assert parse(["--config", "x", "--graphs"]).mode == "graphs"
    assert parse(["--config", "x", "--mode", "graphs"]).mode == "graphs"
    with pytest.raises(SystemExit):  # one mode, not two that disagree
        parse(["--config", "x", "--compiled", "--mode", "graphs"])


def test_whole_sequence_kernels_are_costed_once_per_call():
    """`whole_sequence=True` (titans_mag: one memory call per layer): each memory layer runs one
    forward and one backward whole-sequence launch, booked as memory update with the FLOPs of
    `kernels.whole_sequence.kernel_cost` at the occupancy of batch x heads programs (bf16
    products: the step is recorded under bf16 autocast), and the
    layer's launches do not grow with T where the chunk loop's do."""
    from kernels.whole_sequence import kernel_cost

    short, long = (predict("titans_mag_debug", seq_len=t, batch=2, whole_sequence=True).cost for t in (128, 256))
    loop_short, loop_long = (predict("titans_mag_debug", seq_len=t, batch=2).cost for t in (128, 256))
    fwd = short.ops[("memory update", "whole_sequence_fwd")]
    bwd = short.ops[("memory update", "whole_sequence_bwd")]
    layers = len(short.memory_layers)
    assert fwd.launches == bwd.launches == layers
    assert sum(short.memory_layers["layers.0.memory"]) == sum(long.memory_layers["layers.0.memory"])
    assert sum(loop_long.memory_layers["layers.0.memory"]) > 1.7 * sum(loop_short.memory_layers["layers.0.memory"])
    with torch.device("meta"):
        from torchtitan_ext.plain_step import build

        _, cfg, _ = build("titans_mag", "debug")
    m = cfg.memory.filled_by("titans", dim=cfg.dim, n_heads=cfg.n_heads, head_dim=cfg.dim // cfg.n_heads)
    hidden = m.expansion * m.head_dim
    flops, _ = kernel_cost(2, m.n_heads, 128 // m.chunk_size, m.chunk_size, m.head_dim, hidden, 0,
                           max(m.checkpoint_chunks, 1), backward=False)
    assert fwd.flops == pytest.approx(layers * flops)
    hw, programs = short.hardware, 2 * m.n_heads
    assert hw.kernel_tensor_cores and hw.kernel_measured  # the default: wgmma on Hopper, at the lease's rate
    assert fwd.compute_s >= fwd.flops / hw.program_flops(programs, bf16=True) - 1e-12
    assert bwd.compute_s >= bwd.flops / hw.program_flops(programs, bf16=True, backward=True) - 1e-12
    measured = step_cost.hardware.KERNEL_PROGRAM_FLOPS
    assert hw.program_flops(programs, bf16=True) == measured["forward"] * programs
    assert hw.program_flops(programs, bf16=True, backward=True) == measured["backward"] * programs
    assert hw.program_flops(10 * hw.sms, bf16=True) == measured["forward"] * hw.sms  # one program per SM at a time
    roofline = dataclasses.replace(hw, kernel_measured=False)  # the peak's share alone
    assert roofline.program_flops(programs, bf16=True) == hw.bf16_flops * programs / hw.sms
    assert roofline.program_flops(programs, bf16=False) == hw.fp32_flops * programs / hw.sms
    fma = dataclasses.replace(roofline, kernel_tensor_cores=False)  # no ptxas >= 13.3: the FMA units
    assert fma.program_flops(programs, bf16=True) == hw.fp32_flops * programs / hw.sms
    slow = dataclasses.replace(hw, fp32_flops=hw.fp32_flops / 100, kernel_tensor_cores=False)  # below the measured rate
    assert slow.program_flops(programs, bf16=True) == slow.fp32_flops * programs / hw.sms
    with pytest.raises(ValueError, match="no neural memory"):
        predict("transformer_debug", seq_len=64, whole_sequence=True)


def test_compiled_mode_compiles_what_training_compiles():
    """Mode "compiled" fuses only the modules the family's training compiles: Mela's decoder
    blocks (torchtitan's per-block compile of `layers`) and HMM L- and H-modules fuse, the
    output fusion after them keeps every eager launch; "graphs" runs the same kernels at the
    graph's cost."""
    from torchtitan_ext.families import family_and_overrides

    eager, compiled, graphs = (predict("mela_debug", seq_len=64, mode=mode) for mode in ("eager", "compiled", "graphs"))
    assert compiled.compiled_modules == (*(f"layers.{i}" for i in range(4)), "hmm.l_module", "hmm.h_module")
    for function in ("mela.py:MemoryBlock.forward", "mela.py:MemoryModule.forward"):
        assert compiled.cost.functions[function].launches < eager.cost.functions[function].launches / 2
    assert compiled.cost.classes["memory update"].launches < eager.cost.classes["memory update"].launches
    fusion = "mela.py:OutputFusion.forward"
    assert compiled.cost.functions[fusion].launches == eager.cost.functions[fusion].launches
    decoder_norm = "decoder.py:RMSNorm.forward"  # in the decoder blocks only (the HMM's norms are nn.RMSNorm)
    assert compiled.cost.functions[decoder_norm].launches < eager.cost.functions[decoder_norm].launches / 2
    assert graphs.cost.total.launches == compiled.cost.total.launches
    assert graphs.cost.total.launch_s == pytest.approx(compiled.cost.total.launches * step_cost.LAUNCH_S["graphs"])
    assert compiled.cost.hardware.launch_s == step_cost.LAUNCH_S["compiled"] > step_cost.LAUNCH_S["graphs"]
    titans = predict("titans_mag_debug", seq_len=128, mode="compiled", whole_sequence=True)
    assert titans.compiled_modules == ("layers.0", "layers.1")  # whole-sequence blocks compile whole
    loop = predict("titans_mag_debug", seq_len=128, mode="compiled")
    family = family_and_overrides("titans_mag")[0]
    assert loop.compiled_modules[:3] == ("layers.0.attention", "layers.0.gate", "layers.0.feed_forward")
    assert family.compiled_modules is not None
    with pytest.raises(ValueError, match="unknown mode"):
        predict("transformer_debug", seq_len=64, mode="fast")


def test_script_prints_the_transformer_beside(capsys):
    assert load_script("step_cost").main(["--config", "titans_mag_debug", "--seq-len", "128", "--graphs",
                                          "--crude-launches"]) == 0
    out = capsys.readouterr().out
    assert "beside transformer debug (same mode and shape)" in out and "replayed as a CUDA graph" in out
    assert "compiled regions (6): layers.0.attention" in out
