"""torchtitan's text dataloader with a choice of how data-parallel ranks split the data.

- `shard_by="document"` (torchtitan's behaviour, the default for large corpora): each
  rank reads its own documents (`split_dataset_by_node`) and packs them.
- `shard_by="sequence"`: every rank packs the same token stream and keeps sequences
  r, r+W, r+2W, ... So the global batch of a step is the same for any number of ranks
  W (at a fixed global batch size), and 1- and N-process runs see the same data. Costs
  each rank the tokenisation of the whole stream: meant for small corpora and checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader, HuggingFaceTextDataset

import torchtitan_ext.data.datasets  # noqa: F401  (registers the project's datasets)


class SequenceShardedTextDataset(HuggingFaceTextDataset):
    """Packs the full stream (as rank 0 of 1) and keeps every `world`-th sequence."""

    def __init__(self, *, dp_rank: int, dp_world_size: int, **kwargs):
        super().__init__(dp_rank=0, dp_world_size=1, **kwargs)
        self._keep_rank, self._keep_every = dp_rank, dp_world_size
        self._sequence_idx = 0

    def __iter__(self):
        for sample in super().__iter__():
            index = self._sequence_idx
            self._sequence_idx += 1
            if index % self._keep_every == self._keep_rank:
                yield sample

    def state_dict(self):
        return {**super().state_dict(), "sequence_idx": self._sequence_idx}

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        self._sequence_idx = state_dict["sequence_idx"]


class TextDataLoader(ParallelAwareDataloader):
    @dataclass(kw_only=True, slots=True)
    class Config(HuggingFaceTextDataLoader.Config):
        shard_by: Literal["document", "sequence"] = "document"
        """How data-parallel ranks split the data (see module docstring)."""

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer, seq_len: int,
                 local_batch_size: int, snapshot_every_n_steps: int | None = 1, **kwargs):
        dataset_cls = SequenceShardedTextDataset if config.shard_by == "sequence" else HuggingFaceTextDataset
        dataset = dataset_cls(
            dataset_name=config.dataset, dataset_path=config.dataset_path, tokenizer=tokenizer,
            seq_len=seq_len, dp_rank=dp_rank, dp_world_size=dp_world_size, infinite=config.infinite,
        )
        super().__init__(
            dataset, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=local_batch_size,
            num_workers=config.num_workers, persistent_workers=config.persistent_workers,
            pin_memory=config.pin_memory, prefetch_factor=config.prefetch_factor,
            snapshot_every_n_steps=snapshot_every_n_steps,
        )
