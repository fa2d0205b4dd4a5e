"""torchtitan's Trainer plus the memory models' diagnostics in the logged metrics."""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from torchtitan_ext.families import family_of_spec


class MemoryTrainer(Trainer):
    """After each logged step, logs the `memory/...` diagnostics of families that have them
    (`Family.diagnostics`: Titans' `memory_diagnostics`, Mela's `mela_diagnostics`) to
    wandb/TensorBoard, and a one-line summary (each statistic averaged over layers) to the
    console. Values come from rank 0's last micro-batch."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        pass

    def train_step(self, data_iterator):
        super().train_step(data_iterator)
        if not self.metrics_processor.should_log(self.step):
            return
        diagnostics = family_of_spec(self.config.model_spec.name).diagnostics
        metrics = diagnostics(self.model_parts[0]) if diagnostics else {}
        if not metrics:
            return
        self.metrics_processor.logger.log(metrics, self.step)
        summary = {}
        for key, value in metrics.items():
            summary.setdefault(key.rsplit("/", 1)[1], []).append(value)
        logger.info("memory: " + "  ".join(f"{k}: {sum(v) / len(v):.4g}" for k, v in summary.items()))
