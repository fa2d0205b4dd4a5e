"""torchtitan's text dataloader with a choice of how data-parallel ranks split the data.

- `shard_by="document"` (torchtitan's behaviour, the default for large corpora): each
  rank reads its own documents (`split_dataset_by_node`) and packs them.
- `shard_by="sequence"`: every rank packs the same token stream and keeps sequences
  r, r+W, r+2W, ... So the global batch of a step is the same for any number of ranks
  W (at a fixed global batch size), and 1- and N-process runs see the same data. Costs
  each rank the tokenisation of the whole stream: meant for small corpora and checks.

`skip_bad_rows`: a local dataset's rows that training cannot read (`datasets.bad_local_rows`:
not JSON, no `text`, not UTF-8, an empty file, a parquet file without `text`) are skipped and
counted as the reader passes them, again on each pass over the data (`skipped_rows`, kept in
checkpoints; the trainer logs it as `data/skipped_rows`) instead of failing. Counted with
`num_workers` 0 (the default) only: workers count in their own processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader, HuggingFaceTextDataset

from torchtitan_ext.data import datasets  # registers the project's datasets


class TextDataset(HuggingFaceTextDataset):
    """torchtitan's text dataset that skips rows whose text is None (a local dataset's bad rows,
    kept under `datasets.keeping_bad_rows`) and counts them in `skipped_rows`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._skipped = 0

    @property
    def skipped_rows(self) -> int:
        """Bad rows this rank's data shard has passed so far."""
        return self._skipped

    def _get_data_iter(self):
        for sample in super()._get_data_iter():
            if "text" in sample and sample["text"] is None:
                self._sample_idx += 1  # the read position counts it, so a resumed run skips past it too
                self._skipped += 1
            else:
                yield sample

    def state_dict(self):
        return {**super().state_dict(), "skipped_rows": self._skipped}

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        self._skipped = state_dict.get("skipped_rows", 0)  # checkpoints before the count: 0


class SequenceShardedTextDataset(TextDataset):
    """Packs the full stream (as rank 0 of 1) and keeps every `world`-th sequence."""

    def __init__(self, *, dp_rank: int, dp_world_size: int, **kwargs):
        super().__init__(dp_rank=0, dp_world_size=1, **kwargs)
        self._keep_rank, self._keep_every = dp_rank, dp_world_size
        self._sequence_idx = 0

    @property
    def skipped_rows(self) -> int:
        """Every rank reads the whole stream: rank 0 reports its bad rows, the others 0, so
        that the ranks' sum is the dataset's count."""
        return self._skipped if self._keep_rank == 0 else 0

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

        skip_bad_rows: bool = False
        """Skip and count a local dataset's unreadable rows instead of failing (module docstring)."""

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer, seq_len: int,
                 local_batch_size: int, snapshot_every_n_steps: int | None = 1, **kwargs):
        dataset_cls = SequenceShardedTextDataset if config.shard_by == "sequence" else TextDataset
        with datasets.keeping_bad_rows(config.skip_bad_rows):
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
