"""The "auto" backend reads kernels/auto_table.py (device kind, op, shape class) -> backend,
and scripts/gpu_check.py writes that table from its timings. Decided on CPU: CUDA tensors
are stand-ins (device, dtype, shape), timings are made up."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import kernels
from conftest import load_script
from kernels import BACKENDS, MEMORY_UPDATE_BACKENDS, _resolve, memory_update, shape_class
from kernels.auto_table import AUTO_TABLE, DEVICE_DEFAULTS

gpu_check = load_script("gpu_check")
CHOICES = {"newton_schulz": BACKENDS, "memory_update": MEMORY_UPDATE_BACKENDS}


def cuda_stand_in(shape, dtype=torch.float32):
    return SimpleNamespace(device=torch.device("cuda"), is_cuda=True, dtype=dtype, shape=torch.Size(shape))


FAKE_TABLE = {
    ("cuda", "newton_schulz", "tile-few"): "triton",
    ("cuda", "newton_schulz", "large-many"): "triton_blocked",
    ("cuda", "newton_schulz", "large-few"): "triton",  # the per-matrix kernel cannot take large matrices
    ("cuda", "memory_update", "tile-many"): "torch",
    ("cuda", "memory_update", "large-few"): "triton_blocked",  # no blocked memory_update
}


@pytest.mark.parametrize("op,shape,dtype,expected", [
    ("newton_schulz", (4, 4, 64, 256), torch.float32, "triton"),
    ("newton_schulz", (4, 4, 256, 64), torch.bfloat16, "triton"),
    ("newton_schulz", (4, 4, 64, 256), torch.float64, "compiled"),  # Triton takes fp32 / bf16 only
    ("newton_schulz", (16, 16, 64, 256), torch.float32, "compiled"),  # tile-many: not in the table
    ("newton_schulz", (16, 16, 256, 1024), torch.float32, "triton_blocked"),
    ("newton_schulz", (2, 2, 256, 1024), torch.float32, "compiled"),
    ("memory_update", (16, 16, 256, 64), torch.float32, "torch"),
    ("memory_update", (4, 4, 64, 256), torch.float32, "compiled"),
    ("memory_update", (2, 2, 256, 1024), torch.float32, "compiled"),
], ids=str)
def test_auto_runs_the_table_entry_else_the_device_default(monkeypatch, op, shape, dtype, expected):
    monkeypatch.setattr(kernels, "AUTO_TABLE", FAKE_TABLE)
    assert _resolve(op, "auto", cuda_stand_in(shape, dtype), CHOICES[op]) == expected
    assert _resolve(op, "torch", cuda_stand_in(shape, dtype), CHOICES[op]) == "torch"  # a forced backend is kept


def test_off_cuda_and_without_the_triton_kernels_auto_is_the_torch_reference(monkeypatch):
    monkeypatch.setattr(kernels, "AUTO_TABLE", FAKE_TABLE)
    for device in ("cpu", "meta"):
        x = torch.empty(4, 4, 64, 256, device=device)
        assert _resolve("newton_schulz", "auto", x, BACKENDS) == "torch"
    monkeypatch.setattr(kernels, "TRITON_KERNELS", False)
    assert _resolve("newton_schulz", "auto", cuda_stand_in((4, 4, 64, 256)), BACKENDS) == "torch"


def test_the_shipped_table_runs_compiled_torch_on_cuda():
    """No kernel has been measured faster than compiled torch yet (docs/benchmarks.md): every
    class of the H100 lease's shapes and every untimed class resolves to "compiled"."""
    assert DEVICE_DEFAULTS["cuda"] == "compiled"
    for (kind, op, cls), backend in AUTO_TABLE.items():
        assert backend in CHOICES[op] and cls in gpu_check.TABLE_SHAPES and kind in DEVICE_DEFAULTS
    for op, choices in CHOICES.items():
        for batch, shapes in gpu_check.TABLE_SHAPES.values():
            for shape in shapes:
                assert _resolve(op, "auto", cuda_stand_in((*batch, *shape)), choices) == "compiled"


def test_gpu_check_times_one_shape_per_class():
    for cls, (batch, shapes) in gpu_check.TABLE_SHAPES.items():
        assert {shape_class(torch.empty(*batch, *shape, device="meta")) for shape in shapes} == {cls}


def test_a_backend_replaces_the_default_only_past_the_margin():
    margin = gpu_check.MARGIN
    assert gpu_check.table_entry({"torch": 3.0, "compiled": 2.0, "triton": 1.0}, "compiled") == "triton"
    assert gpu_check.table_entry({"compiled": 2.0, "triton": 2.0 * (1 - margin / 2)}, "compiled") == "compiled"
    assert gpu_check.table_entry({"compiled": 2.0, "triton": 2.0 * (1 - 2 * margin)}, "compiled") == "triton"
    assert gpu_check.table_entry({"torch": 2.0, "triton": 1.5}, "compiled") == "triton"  # default not timed


def test_the_printed_table_is_the_python_auto_reads_and_picks_the_measured_faster(monkeypatch):
    """Fake timings -> gpu_check's printed table -> executed -> "auto" runs the faster backend."""
    timings = {("newton_schulz", "tile-many"): {"torch": 9.0, "compiled": 4.0, "triton": 2.5, "triton_blocked": 3.0},
               ("memory_update", "tile-many"): {"torch": 9.0, "compiled": 4.0, "triton": 3.9},
               ("newton_schulz", "large-few"): {"torch": 5.0, "compiled": 6.0, "triton_blocked": 7.0}}
    source = gpu_check.auto_table_source("cuda", timings, "a fake device")
    namespace = {}
    exec(source, namespace)
    assert namespace["AUTO_TABLE"] == {("cuda", "newton_schulz", "tile-many"): "triton",
                                       ("cuda", "memory_update", "tile-many"): "compiled",  # 2.5% faster: noise
                                       ("cuda", "newton_schulz", "large-few"): "torch"}
    assert "triton 2.50" in source and "a fake device" in source
    monkeypatch.setattr(kernels, "AUTO_TABLE", namespace["AUTO_TABLE"])
    many = cuda_stand_in((16, 16, 64, 256))
    assert _resolve("newton_schulz", "auto", many, BACKENDS) == "triton"
    assert _resolve("memory_update", "auto", many, MEMORY_UPDATE_BACKENDS) == "compiled"
    assert _resolve("newton_schulz", "auto", cuda_stand_in((2, 2, 1024, 256)), BACKENDS) == "torch"


def test_timing_runs_each_backend_per_op_and_class_on_the_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # as on a CPU machine outside the tests
    timings = gpu_check.time_backends("cpu", ("torch", "fused_torch", "triton"), {"tile-few": ((1, 2), ((4, 8), (8, 4)))},
                                      repeats=1)
    assert set(timings) == {("newton_schulz", "tile-few"), ("memory_update", "tile-few"), ("token_step", "tile-few")}
    # Triton needs CUDA; fused_torch is a backend of the token step only
    assert all(list(row) == ["torch"] and row["torch"] > 0 for op, row in timings.items() if op[0] != "token_step")
    assert sorted(timings["token_step", "tile-few"]) == ["fused_torch", "torch"]


def test_the_token_step_check_compares_every_output_and_gradient_and_reports_a_kernel_that_fails(monkeypatch):
    """gpu_check's Triton token-step check (here under the interpreter): one result per output
    and gradient, within fp32 tolerance; a kernel that raises (an H100 ran out of shared
    memory) becomes one FAIL line instead of ending the check."""
    results = gpu_check.check_token_step("cpu", torch.float32, 1e-3)
    assert len(results) == 2 * len(gpu_check.TOKEN_STEP_PARTS) and all(r.ok for r in results)

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("out of resource: shared memory, Required: 266240")

    monkeypatch.setattr(kernels, "token_step_triton", out_of_memory)
    failed = gpu_check.check_token_step("cpu", torch.float32, 1e-3)
    assert [r.ok for r in failed] == [False, False] and "shared memory" in failed[0].detail


def test_auto_traces_into_one_graph(monkeypatch):
    """The table lookup reads constants only (no import under the trace): a table entry for
    this device compiles with fullgraph=True and gives the eager reference's result."""
    monkeypatch.setattr(kernels, "AUTO_TABLE", {("cpu", "memory_update", "tile-few"): "compiled"})
    g = torch.Generator().manual_seed(0)
    weight, momentum, grad = (torch.randn(2, 3, 8, 16, generator=g) for _ in range(3))
    eta, alpha = torch.rand(2, 3, generator=g), torch.rand(2, 3, generator=g)
    assert _resolve("memory_update", "auto", weight, MEMORY_UPDATE_BACKENDS) == "compiled"

    def step(*args):
        return memory_update(*args, 2, backend="auto")

    traced = torch.compile(step, fullgraph=True, backend="eager")(weight, momentum, grad, eta, alpha)
    for a, b in zip(traced, memory_update(weight, momentum, grad, eta, alpha, 2, backend="torch")):
        torch.testing.assert_close(a, b)
