"""The CPU support applies only without an accelerator and answers what torchtitan asks."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import torch
from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

from torchtitan_ext.training import cpu


def test_nothing_is_patched_when_an_accelerator_is_present(monkeypatch):
    import torchtitan.tools.utils as tt_utils

    monkeypatch.setattr(cpu, "has_accelerator", lambda: True)
    before = (tt_utils.device_type, tt_utils.device_module, collectives._get_gradient_divide_factors)
    assert cpu.apply() is False
    assert (tt_utils.device_type, tt_utils.device_module, collectives._get_gradient_divide_factors) == before


def test_cpu_device_module_reports_memory_and_capacity():
    stats = cpu.CpuDeviceModule.memory_stats()
    assert stats["active_bytes.all.peak"] > 10 * 2**20  # this process's peak RSS
    assert cpu.CpuDeviceModule.get_device_properties().total_memory > stats["active_bytes.all.peak"]


def test_gloo_reduction_is_a_plain_sum(monkeypatch):
    group = SimpleNamespace(size=lambda: 2)
    # FSDP2's own function, whatever this process patched before (cpu.apply() in earlier tests)
    monkeypatch.setattr(collectives, "_get_gradient_divide_factors", inspect.unwrap(collectives._get_gradient_divide_factors))
    before = collectives._get_gradient_divide_factors(group, None, torch.float32, "cpu", 1.0, False)
    assert before[2] != torch.distributed.ReduceOp.SUM  # PREMUL_SUM: unsupported by gloo
    cpu._patch_gloo_gradient_reduction()
    pre, post, reduce_scatter_op, all_reduce_op = collectives._get_gradient_divide_factors(
        group, None, torch.float32, "cpu", 1.0, False)
    assert reduce_scatter_op == all_reduce_op == torch.distributed.ReduceOp.SUM and post in (None, 1.0)
    _, post_mean, _, _ = collectives._get_gradient_divide_factors(group, None, torch.float32, "cpu", None, False)
    assert post_mean == 2.0  # no factor: the mean over ranks, as AVG would give


def test_measured_matmul_flops_is_plausible():
    assert 1e8 < cpu.measured_matmul_flops(512, 2) < 1e14
