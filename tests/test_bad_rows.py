"""Bad rows of a local dataset (not JSON, no `text`, not UTF-8, an empty file, a parquet file
without `text`): refused by default (one line naming file and row), skipped and counted with
`--dataloader.skip_bad_rows`, at preflight, in the dataset and in a real training run."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import train
from torchtitan_ext.data import datasets
from torchtitan_ext.data.dataloader import SequenceShardedTextDataset, TextDataLoader, TextDataset
from torchtitan_ext.data.embedded_corpus import embedded_documents
from torchtitan_ext.data.tokenizer import AssetsTokenizer
from torchtitan_ext.errors import UserError
from training_runs import CONFIGS

GOOD = ["the first good document of the file", "a second good document, after the bad row"]
BESIDE = "a good document of the good file beside it"


def json_row(text: str) -> bytes:
    return json.dumps({"text": text}).encode()


def lines(*rows: bytes) -> bytes:
    return b"".join(row + b"\n" for row in rows)


# case: (file name, content, part of the message, good texts of the file in order)
CASES = {
    "not_json": ("rows.jsonl", lines(json_row(GOOD[0]), b'{"text": "cut here', json_row(GOOD[1])),
                 "line 2: not JSON", GOOD),
    "no_text": ("rows.jsonl", lines(json_row(GOOD[0]), b'{"body": "no text"}', json_row(GOOD[1])),
                "line 2: no string 'text' field", GOOD),
    "not_utf8": ("rows.jsonl", lines(json_row(GOOD[0]), b'{"text": "caf\xe9"}', json_row(GOOD[1])),
                 "line 2: byte 13 is not UTF-8", GOOD),
    "empty": ("rows.jsonl", b"", "is empty", []),
    "txt_not_utf8": ("doc.txt", b"plain \xff text", "byte 6: not UTF-8", []),
    "json_array": ("rows.json", json.dumps([{"text": GOOD[0]}, {"title": "b"}, {"text": GOOD[1]}]).encode(),
                   "element 1: no string 'text' field", GOOD),
    "no_column": ("rows.parquet", None, "has no 'text' column", []),
}


def write_case(folder, case: str):
    """A folder with the case's file and a good file of its kind after it; (bad file, texts of
    the good rows in reading order)."""
    name, content, _, good = CASES[case]
    folder.mkdir()
    bad, beside = folder / name, folder / f"zz_good{folder.joinpath(name).suffix}"
    if bad.suffix == ".parquet":
        pq.write_table(pa.table({"body": ["x", "y"]}), bad)
        pq.write_table(pa.table({"text": [BESIDE]}), beside)
    else:
        bad.write_bytes(content)
        beside.write_bytes({".jsonl": lines(json_row(BESIDE)), ".txt": BESIDE.encode(),
                            ".json": json.dumps([{"text": BESIDE}]).encode()}[bad.suffix])
    texts = [*good, BESIDE]
    return bad, [t for t in texts if not datasets.is_heldout(t, datasets.HELDOUT_PER_MILLE["local"])]


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return AssetsTokenizer(AssetsTokenizer.Config(), tokenizer_path=str(tokenizer_dir))


def dataset(cls, tokenizer, path, rank: int = 0, world: int = 1):
    """The train split of local `path` as the dataloader builds it with --dataloader.skip_bad_rows."""
    with datasets.keeping_bad_rows():
        return cls(dataset_name="local", dataset_path=str(path), tokenizer=tokenizer, seq_len=16, dp_rank=rank,
                   dp_world_size=world, infinite=False)


def pairs(dataset) -> list[tuple[int, int]]:
    """(input, label) token pairs the dataset yields, then those left in its buffers."""
    out = [p for sample, labels in dataset for p in zip(sample["input"].tolist(), labels.tolist())]
    return out + list(zip(dataset._inputs_buffer, dataset._labels_buffer))


def expected_pairs(tokenizer, texts) -> list[tuple[int, int]]:
    """The pairs packing yields for these documents (BOS/EOS around each)."""
    out = []
    for text in texts:
        ids = tokenizer.encode(text, add_bos=True, add_eos=True)
        out += list(zip(ids[:-1], ids[1:]))
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_row_is_refused_by_default_and_skipped_and_counted_with_the_flag(case, tmp_path, tokenizer):
    bad, good = write_case(tmp_path / "data", case)
    with pytest.raises(UserError) as raised:
        datasets.check_local_rows(bad.parent)
    assert str(bad) in str(raised.value) and CASES[case][2] in str(raised.value)
    assert [row.message for row in datasets.bad_local_rows(bad.parent)] == [str(raised.value)]
    data = dataset(TextDataset, tokenizer, bad.parent)
    assert pairs(data) == expected_pairs(tokenizer, good)
    assert data.skipped_rows == 1


@pytest.fixture
def bad_first(tmp_path):
    """A jsonl whose first and twelfth rows are bad, among 30 good ones."""
    docs = [f"document {i}: " + "memory " * (i % 7 + 3) for i in range(30)]
    rows = [json_row(d) for d in docs]
    path = tmp_path / "rows.jsonl"
    path.write_bytes(lines(b"not json", *rows[:10], b'{"text": 3}', *rows[10:]))
    return path


def test_the_count_survives_a_checkpoint_and_counts_each_bad_row_once(bad_first, tokenizer):
    whole = dataset(TextDataset, tokenizer, bad_first)
    reference = pairs(whole)
    first = dataset(TextDataset, tokenizer, bad_first)
    head = [p for sample, labels in [next(iter(first))] for p in zip(sample["input"].tolist(), labels.tolist())]
    assert first.skipped_rows == 1  # only the first bad row is behind the read position
    resumed = dataset(TextDataset, tokenizer, bad_first)
    resumed.load_state_dict(first.state_dict())
    assert head + pairs(resumed) == reference
    assert resumed.skipped_rows == whole.skipped_rows == 2


def test_sequence_sharded_ranks_report_the_count_once(bad_first, tokenizer):
    ranks = [dataset(SequenceShardedTextDataset, tokenizer, bad_first, rank, 2) for rank in range(2)]
    for data in ranks:
        pairs(data)
    assert [data.skipped_rows for data in ranks] == [2, 0]


def test_preflight_refuses_bad_rows_or_with_the_flag_says_how_many_it_will_skip(bad_first, capsys):
    from torchtitan_ext.training.preflight import check_dataset

    config = TextDataLoader.Config(dataset="local", dataset_path=str(bad_first))
    with pytest.raises(UserError, match="line 1: not JSON"):
        check_dataset(config, "dataloader", rows=True)
    config.skip_bad_rows = True
    check_dataset(config, "dataloader", rows=True)
    assert capsys.readouterr().out.splitlines() == [
        f"preflight: 2 bad rows in '{bad_first}' will be skipped (--dataloader.skip_bad_rows)"]


@pytest.mark.slow
def test_a_training_run_with_the_flag_skips_the_bad_rows_and_logs_their_count(tokenizer_dir, tmp_path):
    """Launcher preflight included: three bad rows (one of each JSON-lines kind) and a blank
    line before embedded-corpus documents (rows are counted as the reader passes them); the run
    trains 2 steps and its console counts the three."""
    path = tmp_path / "rows.jsonl"
    docs = [json_row(d) for d in embedded_documents()[:12]]
    path.write_bytes(lines(b'{"text": "cut', b'{"body": 1}', b"", b'{"text": "\xff"}', *docs))
    run = train(CONFIGS["transformer"] + ["--validator.no-enable", "--training.steps", "2", "--checkpoint.no-enable",
                                          "--dataloader.dataset", "local", "--dataloader.dataset_path", str(path),
                                          "--dataloader.skip_bad_rows", "--dump_folder", str(tmp_path / "run")],
                preflight=True)
    assert run.returncode == 0 and sorted(run.losses) == [1, 2], run
    assert f"preflight: 3 bad rows in '{path}' will be skipped (--dataloader.skip_bad_rows)" in run.output
    counts = [line.split("skipped_rows: ")[1].split()[0] for line in run.output.splitlines()
              if "skipped_rows: " in line]
    assert counts == ["3", "3"], run


def test_the_mixed_dataloader_skips_and_counts_bad_text_rows_with_the_flag(bad_first, tokenizer):
    """Without the flag reading the first row fails (preflight refuses the file first)."""
    from torchtitan_ext.data.mixed_data import MixedDataLoader

    config = MixedDataLoader.Config(dataset="local", dataset_path=str(bad_first), skip_bad_rows=True, task_fraction=0.0,
                                    tasks="kv_retrieval")  # task rows are built (and checked), never drawn
    mixed = MixedDataLoader(config, dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=64, local_batch_size=1)
    next(iter(mixed))  # one row of 64 tokens: past the first bad row, not the second (10 documents on)
    assert mixed.dataset.skipped_rows == 1
