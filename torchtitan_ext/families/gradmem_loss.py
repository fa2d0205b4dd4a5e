"""GradMem's outer objective for torchtitan's trainer (`GradMemLoss`, set by train_configs/gradmem.py):
apart from torchtitan_ext/families/gradmem.py so that the family's plain model builds where
torchtitan cannot be imported (scripts/bench_models.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchtitan.components.loss import ChunkedLossWrapper, IGNORE_INDEX

WRITE_LOSS_WEIGHT = 0.5  # the public KV-retrieval script's inner-loss weight in the outer loss


def weighted_write_loss(write_loss: torch.Tensor, labels: torch.Tensor, weight: float) -> torch.Tensor:
    """weight x sum_i L_write,i x n_i, n_i = sample i's labelled (answer) tokens: divided by the
    labelled tokens of the batch (torchtitan's normaliser) it is the write loss's batch mean
    weighted like the read loss, a plain mean when every answer has the same length.
    write_loss (B,), labels (B, L) -> scalar."""
    return weight * (write_loss * (labels != IGNORE_INDEX).sum(1)).sum()


class GradMemLoss(ChunkedLossWrapper):
    """The outer objective: the read's cross-entropy on the answer tokens (torchtitan's chunked
    loss over the hidden states the model returns) + `write_weight` x the write loss of the
    last inner step (`weighted_write_loss`), both over torchtitan's global token count."""

    @dataclass(kw_only=True, slots=True)
    class Config(ChunkedLossWrapper.Config):
        num_chunks: int = 1
        write_weight: float = WRITE_LOSS_WEIGHT

    def __init__(self, config: Config, **kwargs):
        super().__init__(config, **kwargs)
        self.write_weight = config.write_weight

    def __call__(self, pred, labels, global_valid_tokens=None, **loss_inputs):
        hidden, write_loss = pred
        loss, metrics = super().__call__(hidden, labels, global_valid_tokens, **loss_inputs)
        extra = weighted_write_loss(write_loss, labels, self.write_weight)
        if global_valid_tokens is not None:
            extra = extra / global_valid_tokens
        return loss + extra, metrics
