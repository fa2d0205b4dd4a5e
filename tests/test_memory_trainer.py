"""MemoryTrainer's step: which steps compute the models' statistics (`models.layers.diagnostics`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torchtitan.trainer import Trainer

from models.layers.diagnostics import recording_on
from torchtitan_ext.training.trainer import MemoryTrainer


@pytest.mark.parametrize("device, graphs_off, logged, records", [
    ("cpu", False, False, False), ("cpu", False, True, True),  # no CUDA graph: logged steps only
    ("cuda", True, False, False), ("cuda", True, True, True),  # graphs turned off: the same
    ("cuda", False, False, True), ("cuda", False, True, True),  # the graph step: every step (its replays)
])
def test_statistics_are_recorded_on_logged_steps_and_on_every_cuda_graph_step(monkeypatch, device, graphs_off,
                                                                            logged, records):
    seen = []
    monkeypatch.setattr(Trainer, "train_step", lambda self, data: seen.append(recording_on()))
    monkeypatch.setattr(MemoryTrainer, "_log_skips", lambda self: None)  # what a logged step does after it
    trainer = MemoryTrainer.__new__(MemoryTrainer)  # the attributes train_step reads, nothing built
    trainer.step, trainer.device = 5, torch.device(device)
    trainer.config = SimpleNamespace(training=SimpleNamespace(disable_cuda_graphs=graphs_off),
                                     model_spec=SimpleNamespace(name="transformer"))
    trainer.metrics_processor = SimpleNamespace(should_log=lambda step: logged)
    trainer.train_step(iter(()))
    assert seen == [records]
    assert not recording_on()
