"""torchtitan's Trainer plus the memory models' diagnostics in the logged metrics and a
checkpoint-then-stop on preemption (`preemption.py`)."""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from torchtitan_ext.families import family_of_spec
from torchtitan_ext.training import preemption


class MemoryTrainer(Trainer):
    """After each logged step, logs the `memory/...` diagnostics of families that have them
    (`Family.diagnostics`: Titans' `memory_diagnostics`, Mela's `mela_diagnostics`) to
    wandb/TensorBoard, and a one-line summary (each statistic averaged over layers) to the
    console. Values come from rank 0's last micro-batch. On SIGTERM (any rank), every rank
    stops after the same finished step and a full checkpoint of it is written."""

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

    def should_continue_training(self) -> bool:
        if self.step < self.config.training.steps and preemption.agreed():
            self._save_for_resume()
            preemption.mark_stopped(self.step)
            return False
        return super().should_continue_training()

    def _save_for_resume(self) -> None:
        """A full checkpoint of the finished step (optimizer, data order: resumable), unless
        checkpointing is off, nothing ran yet, or the interval just saved it."""
        checkpointer = self.checkpointer
        if not checkpointer.enable or self.step == 0 or self.step % checkpointer.interval == 0:
            return
        model_only, in_hf = checkpointer.last_save_model_only, checkpointer.last_save_in_hf
        checkpointer.last_save_model_only = checkpointer.last_save_in_hf = False
        try:
            checkpointer.save(self.step, last_step=True)  # forces a save; a full one with the flags off
        finally:
            checkpointer.last_save_model_only, checkpointer.last_save_in_hf = model_only, in_hf
        logger.info(f"preempted: checkpoint of step {self.step} written")
