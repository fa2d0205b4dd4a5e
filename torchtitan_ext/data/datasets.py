"""The project's datasets, registered into torchtitan's own text pipeline.

torchtitan's `HuggingFaceTextDataset` already does what pretraining needs and is
reused as is: BOS/EOS around each document, per-document positions (attention
never crosses a document boundary), DP-rank sharding with `split_dataset_by_node`,
and iterator state saved in checkpoints. This module only adds sources:

| name | source |
| --- | --- |
| `embedded` | the corpus that ships with CPython (`embedded_corpus.py`); no network |
| `fineweb_edu` | `HuggingFaceFW/fineweb-edu`, streamed; `dataset_path` may be `repo:subset` (default subset `sample-10BT`) or a local folder/file of parquet shards with its schema |
| `local` | `dataset_path` = a .txt/.jsonl/.json/.parquet file or a folder of them; a `text` column (one .txt file = one document) |

A local dataset's rows are checked before training (`check_local_rows`, run by the
launcher's preflight): an empty file, a .jsonl line that is not JSON or has no string `text`
field, bytes that are not UTF-8, or a parquet file without a `text` column end the run with
one line naming the file and the row, exit 2. With `--dataloader.skip_bad_rows` the same rows
(`bad_local_rows`) are kept as None texts (`keeping_bad_rows`), which the dataloader skips and
counts instead.

Each has a `<name>_validation` twin. The held-out split is by content: a document is
held out when `crc32(text) % 1000 < HELDOUT_PER_MILLE[name]`, so train and
validation never share a document, on any number of ranks, streaming or not.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from torchtitan.hf_datasets import DatasetConfig
from torchtitan.hf_datasets.text_datasets import DATASETS

from torchtitan_ext.data.embedded_corpus import embedded_documents
from torchtitan_ext.errors import UserError

FINEWEB_EDU_REPO = "HuggingFaceFW/fineweb-edu"
FINEWEB_EDU_DEFAULT_SUBSET = "sample-10BT"
HELDOUT_PER_MILLE = {"embedded": 50, "fineweb_edu": 5, "local": 10}
LOCAL_FORMATS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def is_heldout(text: str, per_mille: int) -> bool:
    return zlib.crc32(text.encode("utf-8")) % 1000 < per_mille


def _in_split(text: str | None, per_mille: int, validation: bool) -> bool:
    """Whether a row belongs to the held-out (`validation`) or the train split; a bad row
    (None, `keeping_bad_rows`) to the train split, where it is skipped and counted."""
    return not validation if text is None else is_heldout(text, per_mille) == validation


def _split(ds, per_mille: int, validation: bool):
    return ds.filter(lambda sample: _in_split(sample["text"], per_mille, validation))


def _local_files(path: Path) -> tuple[str, list[str]]:
    """(datasets builder name, files) for a local file or folder; UserError if unusable."""
    if not path.exists():
        raise UserError(f"dataset path '{path}' does not exist: pass --dataloader.dataset_path <existing file or folder>")
    files = sorted(p for p in path.rglob("*") if p.suffix in LOCAL_FORMATS) if path.is_dir() else [path]
    kinds = {LOCAL_FORMATS.get(p.suffix) for p in files}
    if not files or None in kinds or len(kinds) != 1:
        raise UserError(
            f"dataset path '{path}' must be one .txt/.jsonl/.json/.parquet file or a folder of one kind of them"
        )
    return kinds.pop(), [str(p) for p in files]


@dataclass(frozen=True)
class BadRow:
    """A row training cannot read: the one-line message naming its file, the row and the problem."""

    message: str


def _bad_row(file: Path, where: str, problem: str) -> BadRow:
    return BadRow(f"dataset file '{file}' {where}: {problem} (--dataloader.skip_bad_rows would skip it): fix or "
                  "remove it, or pass another --dataloader.dataset_path")


def _json_lines(file: Path) -> Iterator[str | BadRow]:
    """The `text` of each non-blank line of a JSON-lines file, or a BadRow where the line is
    not UTF-8, not JSON, or has no string `text` field."""
    with file.open("rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield _bad_row(file, f"line {number}", f"byte {e.start} is not UTF-8")
                continue
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                yield _bad_row(file, f"line {number}", f"not JSON ({e.msg})")
                continue
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                yield _bad_row(file, f"line {number}", "no string 'text' field")
            else:
                yield row["text"]


def _json_array(file: Path) -> Iterator[str | BadRow]:
    """The `text` of each element of a .json array, or a BadRow per element without one (one
    for the whole file when it is not a UTF-8 JSON array)."""
    try:
        rows = json.loads(file.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        yield _bad_row(file, "as a whole", f"not a UTF-8 JSON array ({e})")
        return
    for number, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            yield _bad_row(file, f"element {number}", "no string 'text' field")
        else:
            yield row["text"]


def _parquet_problem(file: Path) -> BadRow | None:
    """A parquet file without a `text` column or without rows (reads only the footer)."""
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(file)
    if "text" not in parquet.schema_arrow.names:
        return _bad_row(file, "has no 'text' column", f"columns {parquet.schema_arrow.names}")
    if parquet.metadata.num_rows == 0:
        return _bad_row(file, "is empty", "no rows")
    return None


def _rows(file: Path, builder: str) -> Iterator[str | BadRow]:
    """One local file's rows in order: each row's text, or a BadRow for a row training cannot
    read. An empty file, or a parquet file without a `text` column or rows, is one BadRow; a
    good parquet file yields nothing (datasets' builder reads its rows). A .txt file is one
    document."""
    if file.stat().st_size == 0:
        yield _bad_row(file, "is empty", "no rows")
    elif builder == "parquet":
        problem = _parquet_problem(file)
        yield from [problem] if problem else []
    elif builder == "text":
        try:
            yield file.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            yield _bad_row(file, f"byte {e.start}", "not UTF-8")
    elif file.suffix == ".json" and file.read_bytes().lstrip()[:1] == b"[":
        yield from _json_array(file)
    else:
        yield from _json_lines(file)


def bad_local_rows(path: Path) -> Iterator[BadRow]:
    """Every row training could not read in a local dataset (a file or folder,
    `_local_files`), in order: an empty file, non-UTF-8 bytes, a JSON line that does not parse
    or lacks a string `text`, a .json array element without one, a parquet file without a
    `text` column or without rows. Reads every text / JSON row once; for parquet only the
    footer. With `--dataloader.skip_bad_rows` training skips exactly these."""
    builder, files = _local_files(path)
    for file in map(Path, files):
        yield from (row for row in _rows(file, builder) if isinstance(row, BadRow))


def check_local_rows(path: Path) -> None:
    """UserError with the message of the first bad row of a local dataset (`bad_local_rows`)."""
    first = next(bad_local_rows(path), None)
    if first is not None:
        raise UserError(first.message)


_keep_bad_rows: ContextVar[bool] = ContextVar("keep_bad_rows", default=False)


@contextmanager
def keeping_bad_rows(keep: bool = True):
    """Within it, `load_local` keeps each bad row as a row whose text is None instead of failing
    (`--dataloader.skip_bad_rows`: the dataloader skips and counts them)."""
    token = _keep_bad_rows.set(keep)
    try:
        yield
    finally:
        _keep_bad_rows.reset(token)


def _with_bad_rows(builder: str, files: list[str]):
    """A local dataset with None for the text of each bad row (`_rows`), in file order;
    parquet files that cannot be read come after the readable ones. JSON and text rows are
    read into memory; parquet rows by datasets' builder."""
    from datasets import Dataset, Features, Value, concatenate_datasets, load_dataset

    if builder != "parquet":
        texts = [None if isinstance(row, BadRow) else row for file in files for row in _rows(Path(file), builder)]
        return Dataset.from_dict({"text": texts}, features=Features({"text": Value("string")}))
    bad = [file for file in files if list(_rows(Path(file), builder))]
    good = [file for file in files if file not in bad]
    parts = [load_dataset("parquet", data_files=good, split="train").select_columns(["text"])] if good else []
    features = parts[0].features if parts else Features({"text": Value("string")})
    return concatenate_datasets([*parts, Dataset.from_dict({"text": [None] * len(bad)}, features=features)])


def load_local(path: str, validation: bool = False, per_mille: int = HELDOUT_PER_MILLE["local"]):
    """A local dataset's train (or held-out `validation`) split; its bad rows kept as None
    texts (train split) inside `keeping_bad_rows`."""
    from datasets import load_dataset

    builder, files = _local_files(Path(path))
    if _keep_bad_rows.get():
        return _split(_with_bad_rows(builder, files), per_mille, validation)
    extra = {"sample_by": "document"} if builder == "text" else {}
    ds = load_dataset(builder, data_files=files, split="train", **extra)
    if "text" not in ds.column_names:
        raise UserError(f"dataset '{path}' has no 'text' column (columns: {ds.column_names})")
    return _split(ds, per_mille, validation)


def load_fineweb_edu(path: str, validation: bool = False):
    """FineWeb-Edu: a local copy (parquet, same schema) or the hub repo, streamed."""
    from datasets import load_dataset

    per_mille = HELDOUT_PER_MILLE["fineweb_edu"]
    if Path(path).exists():
        return load_local(path, validation, per_mille)
    repo, _, subset = path.partition(":")
    ds = load_dataset(repo, name=subset or FINEWEB_EDU_DEFAULT_SUBSET, split="train", streaming=True)
    return _split(ds, per_mille, validation)


def load_embedded(path: str, validation: bool = False):
    from datasets import Dataset

    per_mille = HELDOUT_PER_MILLE["embedded"]
    docs = [d for d in embedded_documents() if is_heldout(d, per_mille) == validation]
    return Dataset.from_dict({"text": docs})


def _text(sample: dict[str, Any]) -> str:
    return sample["text"]


def register() -> None:
    """Add the project's datasets to torchtitan's registry (idempotent)."""
    sources = {
        "embedded": ("embedded", load_embedded),
        "fineweb_edu": (FINEWEB_EDU_REPO, load_fineweb_edu),
        "local": ("", load_local),
    }
    for name, (default_path, loader) in sources.items():
        for suffix, validation in (("", False), ("_validation", True)):
            DATASETS[name + suffix] = DatasetConfig(
                path=default_path, loader=partial(loader, validation=validation), sample_processor=_text
            )


register()
