"""The memory budget calculator (torchtitan_ext/training/memory_budget.py, scripts/memory_budget.py).

The prediction (a meta-device step under a live-bytes dispatch mode, extrapolated in sequence
length from two shorter simulated lengths, plus fp32 parameters, gradients and AdamW states)
is held against the measured peak of a real forward + backward + fused AdamW step on this
CPU. "Measured" = bytes of torch CPU tensors live at the step's start (parameters, buffers,
optimizer states) + the largest running sum of the CPU allocator's allocation and free events
during the step (torch.profiler's `[memory]` records), i.e. what an accelerator's allocator
would hold, not the process RSS. Both run in fp32 with the config's activation checkpointing.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from torchtitan_ext.families import family_of_config_function
from torchtitan_ext.training import memory_budget as mb
from conftest import load_script

TOLERANCE = 0.15


def job(name: str):
    return getattr(importlib.import_module(family_of_config_function(name).config_module), name)()


# (config, batch, seq_len, memory checkpoint_chunks (None: the config's)); seq_len is above the
# simulated lengths (max_sim_tokens 256), so the linear extrapolation in T is what is checked.
CASES = [
    pytest.param("transformer_debug", 4, 512, None, id="transformer"),
    pytest.param("titans_mac_debug", 4, 512, 0, id="titans_mac-ckpt0"),
    pytest.param("titans_mac_debug", 4, 512, 2, id="titans_mac-ckpt2"),
    pytest.param("mela_debug", 2, 384, None, id="mela", marks=pytest.mark.slow),  # 30-70 s here (the HMM's many small ops)
]


@pytest.mark.parametrize("name,batch,seq_len,groups", CASES)
def test_prediction_within_15_percent_of_measured_cpu_peak(name, batch, seq_len, groups):
    torch.manual_seed(0)
    config = job(name)
    budget = mb.budget_of_job(config, local_batch=batch, seq_len=seq_len, dtype="fp32", checkpoint_chunks=groups,
                              max_sim_tokens=256, compare=False)
    assert budget.simulated != (seq_len,) or budget.simulated_depths != (None,)  # something was extrapolated
    model = mb.job_model(config, groups, device="cpu")
    measured = mb.measured_cpu_peak(model, batch, seq_len, getattr(config.loss, "num_chunks", 1),
                                    extra=mb.attention_metadata(config))
    assert abs(budget.peak / measured - 1) <= TOLERANCE, (budget.peak, measured, budget.lines())


def test_checkpoint_chunks_lowers_the_predicted_activations():
    """Recompute groups of 2 chunks (a debug MAC segment holds 4) keep fewer bytes than none."""
    budget = mb.budget_of_job(job("titans_mac_debug"), local_batch=2, seq_len=256, dtype="fp32",
                              checkpoint_chunks=2, max_sim_tokens=128)
    modes = {label.split(" (")[0]: value for label, value in budget.activations_by_mode.items()}
    assert {"checkpoint_chunks off", "checkpoint_chunks 2"} <= set(modes)
    assert modes["checkpoint_chunks 2"] == budget.activations
    assert modes["checkpoint_chunks off"] > budget.activations
    assert 0 < budget.fast_state < budget.activations


def test_live_bytes_counts_saved_tensors_and_frees():
    """A linear layer's step on meta: the input saved for backward is live at the forward's end
    (with the output); after backward only the parameters' gradients are left (no hook moved
    them to `grad` here)."""
    layer = nn.Linear(64, 32, device="meta")
    tracker = mb.LiveBytes()
    tracker.ignore(layer.parameters())
    with tracker:
        x = torch.empty(16, 64, device="meta", requires_grad=True)
        y = layer(x)
        at_forward_end = tracker.current["act"]
        y.sum().backward()
        del x, y
    assert at_forward_end >= (16 * 64 + 16 * 32) * 4
    assert tracker.current["act"] == sum(p.grad.nbytes for p in layer.parameters())


def test_fsdp_ranks_shard_the_static_terms():
    one = mb.budget_of_job(job("transformer_debug"), local_batch=2, seq_len=128, compare=False)
    four = mb.budget_of_job(job("transformer_debug"), local_batch=2, seq_len=128, ranks=4, compare=False)
    assert four.params * 4 == pytest.approx(one.params, rel=1e-6) and four.optimizer == 2 * four.params
    # gradients / 4 weigh less, so the peak may move to a moment with more activations live
    assert four.activations >= one.activations and four.grads_at_peak <= one.grads_at_peak
    assert four.peak < one.peak


def test_warning_line_and_script(capsys):
    config = job("transformer_debug")
    budget = mb.budget_of_job(config, local_batch=2, seq_len=128, compare=False)
    assert mb.warning_line(config, budget.peak // 2, budget=budget).startswith("warning: predicted peak memory")
    assert mb.warning_line(config, budget.peak * 2, budget=budget) is None
    load_script("memory_budget").main(["--config", "transformer_debug", "--local-batch", "2", "--seq-len", "128",
                                       "--fsdp-ranks", "2", "--device-gib", "80"])
    out = capsys.readouterr().out
    assert "predicted peak" in out and "fits:" in out and "FSDP over 2 rank(s)" in out


def test_preflight_warns_only_when_asked_and_the_prediction_exceeds_the_device(monkeypatch, capsys):
    from types import SimpleNamespace

    from torchtitan_ext.training import preflight

    config = job("transformer_debug")
    config.training.local_batch_size, config.training.seq_len = 2, 128
    peak = mb.budget_of_job(config, compare=False).peak
    device = SimpleNamespace(total_memory=peak)  # 90% headroom: this device is too small
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: device)
    monkeypatch.delenv("MEMORY_BUDGET", raising=False)
    assert preflight.warn_memory_budget(config, 1) is None
    monkeypatch.setenv("MEMORY_BUDGET", "1")
    line = preflight.warn_memory_budget(config, 1)
    assert line.startswith("warning: predicted peak memory") and line in capsys.readouterr().err
    device.total_memory = 2 * peak
    assert preflight.warn_memory_budget(config, 1) is None
