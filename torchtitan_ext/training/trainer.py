"""torchtitan's Trainer plus the memory models' diagnostics in the logged metrics, a
checkpoint-then-stop on preemption (`preemption.py`), a guard that skips the update of a
step whose loss or gradients are not finite, and the count of skipped data rows
(`--dataloader.skip_bad_rows`) in the logged metrics."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchtitan.config import TrainingConfig
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from models.layers.diagnostics import recording
from torchtitan_ext.families import family_of_spec
from torchtitan_ext.training import preemption


@dataclass(kw_only=True, slots=True)
class GuardedTrainingConfig(TrainingConfig):
    """torchtitan's `--training.*` options plus the non-finite step guard's."""

    max_nonfinite_skips: int = 3
    """Steps in a row whose loss or gradients are not finite that are skipped (update not
    applied) before the run stops with exit code 3; 0 stops at the first."""


NORM_JUMP = 2.0  # a fast-weight norm that grows more than this factor between two logged steps is reported


def memory_events(step: int, metrics: dict[str, float], previous_norms: dict[str, float]) -> tuple[str | None, dict]:
    """The one console line of a logged step's memory events, from its `memory/...` diagnostics:
    the layers whose surprise bound clipped in the last forward (`clipped_share` > 0, the models'
    `max_update_norm`) and those whose fast-weight norm (`weight_norm`) is not finite or grew
    more than NORM_JUMP times since the previous logged step (`previous_norms`, by layer).
    Returns (the line or None, the norms to pass next time)."""
    clipped, jumped, norms = [], [], {}
    for key, value in metrics.items():
        layer, _, name = key.removeprefix("memory/").rpartition("/")
        if name == "clipped_share" and value > 0:
            clipped.append(f"{layer} ({100 * value:.2g}% of sums)")
        elif name == "weight_norm":
            norms[layer] = value
            before = previous_norms.get(layer)
            if not math.isfinite(value) or (before and value > NORM_JUMP * before):
                jumped.append(f"{layer} ({before:.4g} -> {value:.4g})" if before else f"{layer} ({value:.4g})")
    parts = ([f"surprise clipped in {', '.join(clipped)}"] if clipped else []) + \
        ([f"fast-weight norm jumped in {', '.join(jumped)}"] if jumped else [])
    return (f"step {step}: memory " + "; ".join(parts) if parts else None), norms


class NonFiniteSteps(RuntimeError):
    """`max_nonfinite_skips` + 1 steps in a row had a non-finite loss or gradient."""


class MemoryTrainer(Trainer):
    """After each logged step, logs the `memory/...` diagnostics of families that have them
    (`Family.diagnostics`: Titans' `memory_diagnostics`, Mela's `mela_diagnostics`; the models
    compute them on logged steps only, `models.layers.diagnostics.recording`) to wandb/TensorBoard,
    and a one-line summary (each statistic averaged over layers) to the console, preceded by a warning line naming the layers whose surprise bound clipped or whose
    fast-weight norm jumped (`memory_events`), when any did. Values come from rank 0's last
    micro-batch (the forward of the logged step: clipping between two logged steps shows only
    where it lasts to the next). On SIGTERM (any rank), every rank stops after the same finished
    step and a full checkpoint of it is written.

    Non-finite guard: before the optimizer step the ranks agree (one all-reduce of two scalars) on
    whether any rank's loss or gradient shard holds a NaN or an infinity (after clipping: a
    non-finite total norm, a global reduction, makes every gradient NaN). If so the step is
    skipped: no optimizer or LR-schedule step, gradients zeroed, one warning line, counted in
    `training/skipped_nonfinite_steps` (from 0 at each start), and no interval checkpoint of
    it (the final and the preemption checkpoints are written): the newest checkpoint is always
    of an applied update, and a rerun retries the skipped batches. After
    `--training.max_nonfinite_skips` skips in a row, the next non-finite step stops the run
    (`NonFiniteSteps`, exit code 3 in `train.py`)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        training: GuardedTrainingConfig = field(default_factory=GuardedTrainingConfig)

        def __post_init__(self):
            if not isinstance(self.training, GuardedTrainingConfig):  # a recipe's plain TrainingConfig
                names = [f.name for f in dataclasses.fields(TrainingConfig)]
                self.training = GuardedTrainingConfig(**{name: getattr(self.training, name) for name in names})
            if self.training.max_nonfinite_skips < 0:
                raise ValueError(f"--training.max_nonfinite_skips {self.training.max_nonfinite_skips} is negative: "
                                 "pass 0 or more")
            Trainer.Config.__post_init__(self)  # zero-argument super() fails in slotted dataclasses

    def __init__(self, config: Config):
        super().__init__(config)
        self.skipped_nonfinite_steps = 0
        self._nonfinite_streak: list[int] = []
        self._loss_finite = torch.tensor(True)
        self._memory_norms: dict[str, float] = {}  # fast-weight norms by layer at the last logged step
        self.optimizers.step = self._optimizer_step_if_finite
        self.lr_schedulers.step = self._applied_steps_only(self.lr_schedulers.step)
        self.checkpointer.save = self._applied_steps_only(self.checkpointer.save)

    def forward_backward_step(self, **kwargs) -> torch.Tensor:
        loss = super().forward_backward_step(**kwargs)
        self._loss_finite = self._loss_finite & torch.isfinite(loss.detach()).all()
        return loss

    def _local_values_finite(self) -> torch.Tensor:
        """[this rank's losses of the step finite, its gradient shards finite] as 1.0 / 0.0."""
        grads = [p.grad for m in self.model_parts for p in m.parameters() if p.grad is not None]
        grads = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        grads = [g for g in grads if g.numel()]  # FSDP can leave a rank an empty shard (no inf-norm)
        grads_finite = torch.stack(torch._foreach_norm(grads, float("inf"))).isfinite().all() if grads else True
        loss_finite = self._loss_finite.to(self.device)
        return torch.stack([loss_finite, torch.as_tensor(grads_finite, device=self.device)]).float()

    def _nonfinite_part(self) -> str | None:
        """"loss" when some rank's loss is not finite, else "gradients" when some rank's
        gradients are not, else None (a collective: one MIN of two scalars)."""
        finite = self._local_values_finite()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        loss_finite, grads_finite = finite.tolist()
        return None if loss_finite and grads_finite else "gradients" if loss_finite else "loss"

    def _optimizer_step_if_finite(self, closure=None) -> None:
        """Replaces the optimizers' step: applies it when all ranks' values are finite, else
        zeroes the gradients and records the skip (one warning line), or stops the run when
        it is one skip too many."""
        part = self._nonfinite_part()
        self._loss_finite = torch.tensor(True)
        if part is None:
            self._nonfinite_streak.clear()
            type(self.optimizers).step(self.optimizers)
            return
        self.optimizers.zero_grad()
        self._nonfinite_streak.append(self.step)
        limit, streak = self.config.training.max_nonfinite_skips, self._nonfinite_streak
        subject = "Loss is" if part == "loss" else "Gradients are"
        if len(streak) > limit:
            raise NonFiniteSteps(f"{subject} not finite at step {self.step}: {len(streak)} non-finite steps in a row "
                                 f"(steps {streak[0]}-{self.step}, none applied), more than "
                                 f"--training.max_nonfinite_skips {limit}")
        self.skipped_nonfinite_steps += 1
        logger.warning(f"step {self.step}: {subject.lower()} not finite, update skipped ({len(streak)} in a row; "
                       f"{limit + 1} in a row stop the run)")

    def _update_skipped(self) -> bool:
        """Whether the guard skipped the update of the current step."""
        return bool(self._nonfinite_streak) and self._nonfinite_streak[-1] == self.step

    def _applied_steps_only(self, step_fn):
        """`step_fn` wrapped to do nothing on a step whose update was skipped, unless called
        with `last_step=True` (the final or the preemption checkpoint)."""

        def step(*args, **kwargs):
            if kwargs.get("last_step") or not self._update_skipped():
                step_fn(*args, **kwargs)

        return step

    def train_step(self, data_iterator):
        logged = self.metrics_processor.should_log(self.step)
        # torchtitan's CUDA-graph step (on CUDA unless --training.disable_cuda_graphs) runs step 1
        # eagerly, captures step 2 and replays it: a replay runs what the capture ran, whatever the
        # Python flags. So there every step records: the capture holds the statistics, and each
        # replay refreshes them in the tensors the model keeps (else a logged replay would report the
        # warmup step's). Elsewhere the statistics cost launches on logged steps only.
        graph_step = self.device.type == "cuda" and not self.config.training.disable_cuda_graphs
        try:
            with recording(logged or graph_step):
                super().train_step(data_iterator)
        except RuntimeError as e:  # torchtitan's "Loss is not finite" of a step the guard skipped
            if isinstance(e, NonFiniteSteps) or not self._update_skipped():
                raise
        if not logged:
            return
        self._log_skips()
        family_metrics = family_of_spec(self.config.model_spec.name).diagnostics
        metrics = family_metrics(self.model_parts[0]) if family_metrics else {}
        if not metrics:
            return
        self.metrics_processor.logger.log(metrics, self.step)
        event, self._memory_norms = memory_events(self.step, metrics, self._memory_norms)
        if event:
            logger.warning(event)
        summary = {}
        for key, value in metrics.items():
            summary.setdefault(key.rsplit("/", 1)[1], []).append(value)
        logger.info("memory: " + "  ".join(f"{k}: {sum(v) / len(v):.4g}" for k, v in summary.items()))

    def _skipped_rows(self) -> int | None:
        """Data rows skipped so far over the data-parallel ranks (`--dataloader.skip_bad_rows`;
        a collective over the batch mesh), or None when the flag is off or the dataset does
        not count them (`dataloader.TextDataset` does)."""
        dataset = self.dataloader.dataset
        if not getattr(self.config.dataloader, "skip_bad_rows", False) or not hasattr(dataset, "skipped_rows"):
            return None
        local = torch.tensor(float(dataset.skipped_rows), device=self.device)
        return int(dist_utils.dist_sum(local, self.parallel_dims.get_optional_mesh("batch")))

    def _log_skips(self) -> None:
        """The skip counts in the logged metrics, and a console line once any is nonzero."""
        counts = {"training/skipped_nonfinite_steps": self.skipped_nonfinite_steps}
        rows = self._skipped_rows()
        if rows is not None:
            counts["data/skipped_rows"] = rows
        self.metrics_processor.logger.log(counts, self.step)
        if any(counts.values()):
            logger.info("skipped: " + "  ".join(f"{key.split('/')[1]}: {value}" for key, value in counts.items()))

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
